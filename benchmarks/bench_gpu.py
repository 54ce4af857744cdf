"""The prefix cache on a CUDA GPU: TTFT with and without reuse, a cold shared batch, decode
overhead, and how often bf16 greedy text matches stock's exactly.

Model: a random Llama built from a config (no hub), bf16 on ``cuda``: by default ~1.1B
parameters (hidden 2048, 16 layers, 32 heads, 8 KV heads, vocab 32k). Every ratio is against
stock generate() measured in the same run; times are medians of ``--repeats`` after a warm-up,
wall clock around generate() with torch.cuda.synchronize().

    python benchmarks/bench_gpu.py                  # needs CUDA
    python benchmarks/bench_gpu.py --layers 4 --hidden 512   # a quick look

Parts:
1. repeat questions: a ``--doc-tokens`` document + a 30-token question; TTFT of stock
   generate() (no cache) vs RadixCache with the document in the store (cached_tokens shown).
2. cold batch: 16 questions over one 2,000-token document in one generate() call, empty store:
   stock batched vs RadixCache (in-batch sharing computes the document once).
3. decode: 128 new tokens after a 512-token prompt, stock vs RadixCache (the per-step cost of
   the cache once the prompt is in).
4. bf16 agreement: 32 greedy tokens for ``--agree`` prompts sharing the document, stock vs a
   warm RadixCache: the share of replies equal token for token. In bf16 the cached path
   computes the question's KV in a different kernel shape than stock's full prefill, so rounding
   can differ; fp32 equality is what tests/test_gpu_paths.py asserts.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_patch
from hf_patch import RadixCache

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_batch import left_pad  # noqa: E402

DEVICE = "cuda"  # --device cpu: a dry run of the script's logic


def build(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        vocab_size=32000,
        max_position_embeddings=8192,
    )
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16 if DEVICE == "cuda" else torch.float32).eval()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def doc(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 32000) for _ in range(n)]


def timed(model, input_ids, mask=None, cache=None, new: int = 1) -> tuple[float, torch.Tensor]:
    kwargs = {} if cache is None else {"past_key_values": cache}
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
            pad_token_id=0, **kwargs,
        )  # fmt: skip
    sync()
    return time.perf_counter() - t0, out


def part_repeat(model, store, args, rng) -> None:
    document = doc(rng, args.doc_tokens)
    questions = [doc(rng, 30) for _ in range(args.repeats + 1)]
    one = lambda q: torch.tensor([document + q], device=DEVICE)  # noqa: E731
    timed(model, one(questions[0]))  # warm-up
    timed(model, one(questions[0]), cache=RadixCache(store=store))  # the document into the store
    stock, radix, cached = [], [], []
    for q in questions[1:]:
        stock.append(timed(model, one(q))[0])
        cache = RadixCache(store=store)
        radix.append(timed(model, one(q), cache=cache)[0])
        cached.append(cache.cached_tokens[0])
    s, r = statistics.median(stock), statistics.median(radix)
    if args.profile:  # where a warm radix call's time goes (Python level; GPU waits show at syncs)
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        for q in questions[1:]:
            timed(model, one(q), cache=RadixCache(store=store))
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    print(f"\n1. repeat questions over a {args.doc_tokens}-token document (+30-token question), TTFT median")
    print(f"   stock {s * 1e3:8.1f} ms   radix {r * 1e3:8.1f} ms   {s / r:5.1f}x   cached {cached[:3]}")


def part_cold(model, args, rng) -> None:
    document = doc(rng, 2000)
    rows = [document + doc(rng, rng.randrange(26, 35)) for _ in range(16)]
    input_ids, mask = (t.to(DEVICE) for t in left_pad(rows))
    timed(model, input_ids[:2, -64:], mask[:2, -64:])  # warm-up
    stock = statistics.median(timed(model, input_ids, mask)[0] for _ in range(args.repeats))
    radix = []
    for _ in range(args.repeats):
        cache = RadixCache(store=hf_patch.build_store(model, budget_tokens=1 << 16))  # cold each time
        radix.append(timed(model, input_ids, mask, cache)[0])
    r = statistics.median(radix)
    print("\n2. cold batch: 16 questions over one 2,000-token document, one generate(), empty store")
    print(f"   stock {stock * 1e3:8.1f} ms   radix {r * 1e3:8.1f} ms   {stock / r:5.1f}x")


def part_decode(model, store, args, rng) -> None:
    prompt = torch.tensor([doc(rng, 512)], device=DEVICE)
    timed(model, prompt, new=8)
    stock = statistics.median(timed(model, prompt, new=128)[0] for _ in range(args.repeats))
    radix = statistics.median(
        timed(model, prompt, cache=RadixCache(store=store), new=128)[0] for _ in range(args.repeats)
    )
    print("\n3. decode: 128 new tokens after a 512-token prompt (prompt cached after the first radix run)")
    print(
        f"   stock {stock * 1e3:8.1f} ms ({stock / 128 * 1e3:.2f} ms/token)   radix {radix * 1e3:8.1f} ms "
        f"({radix / 128 * 1e3:.2f} ms/token)   radix/stock {radix / stock:.2f}"
    )


def part_agree(model, store, args, rng) -> None:
    document = doc(rng, 1000)
    timed(model, torch.tensor([document + doc(rng, 20)], device=DEVICE), cache=RadixCache(store=store))
    same = tokens_same = 0
    for _ in range(args.agree):
        q = torch.tensor([document + doc(rng, rng.randrange(10, 40))], device=DEVICE)
        a = timed(model, q, new=32)[1][0, q.shape[1] :]
        b = timed(model, q, cache=RadixCache(store=store), new=32)[1][0, q.shape[1] :]
        same += torch.equal(a, b)
        first_diff = (a != b).nonzero()
        tokens_same += int(first_diff[0]) if len(first_diff) else 32
    print(
        f"\n4. bf16 greedy agreement, {args.agree} prompts sharing a 1,000-token cached document, 32 tokens"
    )
    print(
        f"   replies equal to stock: {same}/{args.agree}; tokens before the first difference: "
        f"{tokens_same / args.agree:.1f} of 32 on average"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--agree", type=int, default=20)
    p.add_argument("--parts", default="repeat,cold,decode,agree")
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="torch's cuDNN attention off, as the demo and batchrun run",
    )
    p.add_argument("--profile", action="store_true", help="part 1: cProfile the warm radix calls")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run, tiny sizes")
    args = p.parse_args()
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device (--device cpu for a dry run)")
    model = build(args)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(
        f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else 'CPU'}, torch {torch.__version__}; random Llama {params:.2f}B params, "
        f"hidden {args.hidden}, {args.layers} layers, {'bf16' if DEVICE == 'cuda' else 'fp32'}"
    )
    rng = random.Random(7)
    store = hf_patch.build_store(model, budget_tokens=1 << 16)
    parts = args.parts.split(",")
    if "repeat" in parts:
        part_repeat(model, store, args, rng)
    if "cold" in parts:
        part_cold(model, args, rng)
    if "decode" in parts:
        part_decode(model, store, args, rng)
    if "agree" in parts:
        part_agree(model, store, args, rng)
    print(f"\nstore: {store.stats()}")


if __name__ == "__main__":
    main()
