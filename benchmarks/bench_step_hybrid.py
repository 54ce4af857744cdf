"""A hybrid model's requests through the demo's engine: the step loop (rows' recurrent states kept
per slot, hf_patch.slot_states) against the generate() path (calls paused every --decode-chunk
steps), on a Qwen3.5-style text model (``linear_attention`` : ``full_attention`` 3:1, random
weights, fp32, the built-in tokenizer), for --concurrent requests of different prompt lengths
submitted at once, greedy, each --new tokens. Per round, both engines take turns on a fresh
store; printed: the wall time until every reply is done, decode tokens per second, and whether
the two paths' replies are equal (they must be: both equal stock generate()).

    python benchmarks/bench_step_hybrid.py                        # 8 requests, 48 tokens, 3 rounds
    python benchmarks/bench_step_hybrid.py --concurrent 4 --hidden 512 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import warnings

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from demo.engine.engine import Engine, Params  # noqa: E402
from demo.model.loading import build_tokenizer  # noqa: E402


def build(hidden: int, layers: int):
    tok = build_tokenizer(512)
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    heads = max(2, hidden // 64)
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=64, linear_num_key_heads=heads // 2 or 1, linear_num_value_heads=heads,
        linear_key_head_dim=64, linear_value_head_dim=64, layer_types=types,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False, initializer_range=0.2,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.suppress_tokens = [tok.eos_token_id]  # every reply runs its --new tokens
    return model, tok


def serve(model, tok, prompts, new: int, step_loop: bool, batch: int) -> tuple[float, float, list[str], str]:
    engine = Engine(model, tok, 4096, block_size=16, max_batch_size=batch, step_loop=step_loop)
    path = "step loop" if engine.loop is not None else "generate()"
    try:
        start = time.perf_counter()
        gens = [engine.submit(p, Params(new, temperature=0.0)) for p in prompts]
        out: list = [None] * len(gens)
        threads = [
            threading.Thread(target=lambda i=i: out.__setitem__(i, gens[i].collect()))
            for i in range(len(gens))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    finally:
        engine.shutdown(5.0)
    ttft = statistics.median(r.ttft_s for r in out)
    return wall, ttft, [r.text for r in out], path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrent", type=int, default=8)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    model, tok = build(args.hidden, args.layers)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(10, 500, (int(n),), generator=g).tolist()
        for n in torch.linspace(60, 300, args.concurrent)
    ]
    times: dict[str, list[float]] = {}
    ttfts: dict[str, list[float]] = {}
    equal = True
    for _ in range(args.rounds):
        replies = {}
        for step_loop in (True, False):
            wall, ttft, texts, path = serve(model, tok, prompts, args.new, step_loop, args.concurrent)
            times.setdefault(path, []).append(wall)
            ttfts.setdefault(path, []).append(ttft)
            replies[path] = texts
        equal &= replies["step loop"] == replies["generate()"]
    load = os.getloadavg()[0]
    print(f"{args.concurrent} requests x {args.new} tokens, hidden {args.hidden} x {args.layers} layers, "
          f"{args.threads} torch thread(s), load {load:.1f}")  # fmt: skip
    for path, ts in times.items():
        wall = statistics.median(ts)
        ttft = statistics.median(ttfts[path]) * 1e3
        print(
            f"{path:12s} wall {wall:6.2f} s  {args.concurrent * args.new / wall:7.1f} tokens/s  median TTFT {ttft:6.0f} ms"
        )
    print("replies equal across the paths:", equal)


if __name__ == "__main__":
    main()
