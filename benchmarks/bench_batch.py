"""Batch jobs with RadixCache: a cold batch sharing one document, and generate_many over a job.

Run by hand (CPU, fp32, the bench_hf model: random Llama hidden 512, 8 layers, vocab 32k):

    python -m benchmarks.bench_batch --parts cold     # 1. 16 questions x one 2,000-token document
    python -m benchmarks.bench_batch --parts many     # 2. 400 prompts over 8 documents
    python -m benchmarks.bench_batch --parts dp       # 3. the same job on 2 torchrun ranks

Every figure is a ratio against a baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import hf_patch
import hf_patch.call
from benchmarks.bench_hf import build_model, document
from hf_patch import RadixCache


def left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return input_ids, mask


def time_first_token(model, input_ids, mask, cache=None) -> tuple[float, torch.Tensor]:
    """Seconds for generate(max_new_tokens=1) on the whole batch: its time to first token."""
    kwargs = {} if cache is None else {"past_key_values": cache}
    t0 = time.perf_counter()
    out = model.generate(
        input_ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=0, **kwargs
    )
    return time.perf_counter() - t0, out


def part_cold(model, args) -> None:
    rng = random.Random(5)
    doc = document(rng, 2000)
    rows = [doc + document(rng, rng.randrange(26, 35)) for _ in range(args.questions)]
    input_ids, mask = left_pad(rows)
    time_first_token(model, *left_pad([r[:64] for r in rows[:2]]))  # warm-up
    share = hf_patch.call.can_share  # what hf_patch.call.sharing asks before in-batch sharing
    results = {}
    stock_s, stock_out = time_first_token(model, input_ids, mask)
    results["stock batched generate"] = stock_s
    hf_patch.call.can_share = lambda model_kwargs: False  # RadixCache as it was before in-batch sharing
    try:
        before_s, before_out = time_first_token(
            model, input_ids, mask, RadixCache(store=hf_patch.build_store(model))
        )
    finally:
        hf_patch.call.can_share = share
    results["RadixCache, no in-batch sharing"] = before_s
    after = []
    for _ in range(args.repeats):
        cache = RadixCache(store=hf_patch.build_store(model))  # a cold store every time
        seconds, after_out = time_first_token(model, input_ids, mask, cache)
        after.append(seconds)
    results["RadixCache, in-batch sharing"] = statistics.median(after)
    same = torch.equal(stock_out, before_out) and torch.equal(stock_out, after_out)
    print(
        f"\n1. cold batch: {args.questions} questions of 26-34 tokens over one 2,000-token document, "
        f"one generate() call, empty store (first tokens equal to stock: {same})"
    )
    print(f"   {'method':<34}{'TTFT s':>8}{'vs stock':>10}")
    for name, seconds in results.items():
        print(f"   {name:<34}{seconds:>8.2f}{stock_s / seconds:>9.1f}x")
    print(f"   cached tokens per row after: {cache.cached_tokens[:4]} ...")


def part_many(model, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # a smaller Llama than bench_hf's, so 400 stock prompts fit in a minute or two
    small = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=32000,
            max_position_embeddings=2048,
        )  # fmt: skip
    ).eval()
    rng = random.Random(6)
    docs = [document(rng, args.doc_tokens) for _ in range(args.docs)]
    # A dataset lists its questions in its own order, not grouped by document.
    prompts = [
        docs[rng.randrange(args.docs)] + document(rng, rng.randrange(15, 30)) for _ in range(args.prompts)
    ]
    new = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    total_tokens = sum(map(len, prompts))
    small.generate(torch.tensor([prompts[0][:32]]), **new)  # warm-up

    t0 = time.perf_counter()
    loop = [small.generate(torch.tensor([p]), **new)[0, len(p) :].tolist() for p in prompts]
    loop_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    batched = []
    for start in range(0, len(prompts), args.batch):
        rows = prompts[start : start + args.batch]
        input_ids, mask = left_pad(rows)
        out = small.generate(input_ids, attention_mask=mask, **new)
        batched += out[:, input_ids.shape[1] :].tolist()
    batched_s = time.perf_counter() - t0

    store = hf_patch.build_store(small)
    t0 = time.perf_counter()
    results = hf_patch.generate_many(
        small, prompts, store=store, max_batch_size=args.batch, progress=False, **new
    )
    many_s = time.perf_counter() - t0
    hit = sum(r.cached_tokens for r in results) / total_tokens
    same = sum(r.token_ids == t for r, t in zip(results, loop))
    print(
        f"\n2. batch job: {len(prompts)} prompts = one of {args.docs} documents of {args.doc_tokens} tokens "
        f"+ a 15-29-token question, 4 new tokens; Llama 256x4 (vocab 32k), batches of {args.batch}"
    )
    print(f"   {'method':<38}{'s':>7}{'prompts/s':>11}{'vs loop':>9}{'hit rate':>10}")
    for name, seconds, rate in (
        ("plain loop of stock generate()", loop_s, 0.0),
        ("stock batched generate, input order", batched_s, 0.0),
        ("generate_many (RadixCache)", many_s, hit),
    ):
        print(
            f"   {name:<38}{seconds:>7.1f}{len(prompts) / seconds:>11.1f}{loop_s / seconds:>8.1f}x{rate:>10.2f}"
        )
    print(f"   generate_many tokens equal to the stock loop for {same}/{len(prompts)} prompts")


def part_dp(model, args) -> None:
    """Two torchrun CPU processes over one batch file: prefix-affine routing vs round robin."""
    import json
    import os
    import re
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from demo.model.loading import build_builtin

    work = Path(tempfile.mkdtemp(prefix="bench_dp_"))
    small, tokenizer = build_builtin("builtin")  # Llama 512x6, vocab 2048, with a tokenizer to save
    small.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    rng = random.Random(7)
    docs = [[rng.randrange(300, 750) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    with open(work / "requests.jsonl", "w") as f:
        for i in range(args.prompts):
            prompt = docs[rng.randrange(args.docs)] + [
                rng.randrange(300, 750) for _ in range(rng.randrange(15, 30))
            ]
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            f.write(
                json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
                + "\n"
            )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    print(
        f"\n3. data parallel, 2 torchrun CPU processes (1 thread each): {args.prompts} completions = one of "
        f"{args.docs} documents of {args.doc_tokens} tokens + a 15-29-token question, 4 new tokens, Llama 512x6 (demo builtin, vocab 754)"
    )
    outputs = {}
    for routing in ("round-robin", "affine"):
        out = work / f"{routing}.jsonl"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "batchrun", "--model", str(work / "model"), "--input", str(work / "requests.jsonl"),
               "--output", str(out), "--routing", routing, "--cpu", "--no-progress"]  # fmt: skip
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - t0
        if res.returncode:
            raise SystemExit(res.stdout[-2000:] + res.stderr[-3000:])
        for line in res.stdout.splitlines():
            if line.startswith(("rank ", "job:")):
                print(f"   [{routing}] {line}")
        job = re.search(
            r"prompt tokens (\d+), computed (\d+), hit rate ([\d.]+), wall ([\d.]+) s", res.stdout
        )
        print(f"   [{routing}] torchrun wall incl. start-up {seconds:.1f} s")
        outputs[routing] = ([json.loads(x)["response"]["body"]["choices"][0]["text"] for x in open(out)], job)
    same = outputs["affine"][0] == outputs["round-robin"][0]
    rr, af = outputs["round-robin"][1], outputs["affine"][1]
    print(
        f"   prefill tokens computed: round robin {rr[2]}, affine {af[2]} ({int(rr[2]) / int(af[2]):.2f}x fewer); "
        f"documents alone: {args.docs * args.doc_tokens} tokens; results identical: {same}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="cold,many")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--doc-tokens", type=int, default=500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: a second thread spin-waits badly on a busy 2-core machine)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = build_model()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, model: Llama 512x8, vocab 32k, fp32"
    )
    parts = {"cold": part_cold, "many": part_many, "dp": part_dp}
    for name in args.parts.split(","):
        parts[name](model, args)


if __name__ == "__main__":
    main()
