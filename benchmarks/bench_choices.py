"""n sampled choices from one long prompt: the prompt computed once (prefix cache) vs n times.

For each prompt length, fresh prompts (never cached), n=4 sampled choices of a few tokens:
- once:   the demo engine with the cache on (a greedy one-token pass commits the prompt, the
          n rows read it from the store);
- n rows: the same request with cache_prompt=false (each of the n rows computes the prompt).
Prints medians and the ratio measured in the same run.

    python benchmarks/bench_choices.py                       # built-in model, n=4
    python benchmarks/bench_choices.py --n 8 --lengths 1000 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

from demo.api.app import build_engine
from demo.config import Config
from demo.engine.engine import Params


def run(engine, n: int, length: int, cache_prompt: bool, new_tokens: int) -> float:
    words = f"[{uuid.uuid4().hex}] " + "the cache prefix token block tree node pool key value " * length
    ids = engine.text_ids(words)[:length]
    t0 = time.perf_counter()
    engine.submit(ids, Params(new_tokens, 1.0, n=n, seed=0, cache_prompt=cache_prompt)).collect()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--lengths", type=int, nargs="+", default=[500, 2000])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    engine = build_engine(Config(model=args.model))
    run(engine, args.n, 64, True, 2)  # warm-up
    print(f"model {args.model}, n={args.n}, {args.new_tokens} new tokens, median of {args.repeats}")
    for length in args.lengths:
        once = statistics.median(
            run(engine, args.n, length, True, args.new_tokens) for _ in range(args.repeats)
        )
        rows = statistics.median(
            run(engine, args.n, length, False, args.new_tokens) for _ in range(args.repeats)
        )
        print(
            f"prompt {length:5d} tokens: prompt once {once * 1000:8.1f} ms, "
            f"n rows {rows * 1000:8.1f} ms, ratio {rows / once:.2f}x"
        )


if __name__ == "__main__":
    main()
