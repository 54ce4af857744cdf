"""The workload bench_contention.py times (run in a child process: torch threads and the OMP
wait policy are fixed when it starts). Prints one line `name stock_s radix_s` per case:

- cold: `--questions` questions of 26-34 tokens over one 2,000-token document, one generate()
  call (max_new_tokens=1), stock batched generate() vs RadixCache on an empty store;
- decode: 8 rows of ~500 tokens (a cached 480-token prefix) generating 32 tokens, stock vs
  RadixCache on a warm store (what the demo server's worker does).
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

import hf_patch
from benchmarks.bench_batch import left_pad
from benchmarks.bench_hf import build_model, document
from hf_patch import RadixCache


def timed(model, input_ids, mask, new: int, cache=None) -> float:
    kwargs = {} if cache is None else {"past_key_values": cache}
    t0 = time.perf_counter()
    model.generate(
        input_ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs
    )
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--questions", type=int, default=8)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    model = build_model()
    rng = random.Random(5)
    doc = document(rng, 2000)
    rows = [doc + document(rng, rng.randrange(26, 35)) for _ in range(args.questions)]
    timed(model, *left_pad([r[:64] for r in rows[:2]]), 1)  # warm-up
    stock = timed(model, *left_pad(rows), 1)
    radix = timed(model, *left_pad(rows), 1, RadixCache(store=hf_patch.build_store(model)))
    print(f"cold {stock:.3f} {radix:.3f}")
    prefix = document(rng, 480)
    rows = [prefix + document(rng, rng.randrange(10, 30)) for _ in range(8)]
    store = hf_patch.build_store(model)
    timed(model, *left_pad(rows), 1, RadixCache(store=store))  # the store holds the prompts
    stock = timed(model, *left_pad(rows), 32)
    radix = timed(model, *left_pad(rows), 32, RadixCache(store=store))
    print(f"decode {stock:.3f} {radix:.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
