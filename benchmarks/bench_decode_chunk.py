"""What a pause between decode chunks costs: the same batch generated with a pause every k steps.

Runs in-process on the built-in model: `--rows` requests (short prompts, mixed options: half
greedy, the rest sampled with seeds, top_p, logit_bias, logprobs) generating `--tokens` each,
once without pauses and once per chunk size, with every chunk boundary forced to pause and
resume (as under load, when requests always wait). Prints seconds per decoded step and the
cost of one pause/resume cycle in steps, which sets the admission floor (docs/batching.md).

    python benchmarks/bench_decode_chunk.py --rows 8 --tokens 128 --chunks 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from demo.api.app import build_engine  # noqa: E402
from demo.config import Config  # noqa: E402
from demo.engine.engine import Params  # noqa: E402


def mixed_params(i: int, tokens: int, mixed: bool) -> Params:
    if not mixed or i % 2 == 0:
        return Params(tokens, temperature=0.0)
    return [
        Params(tokens, temperature=0.8, seed=i),
        Params(tokens, temperature=1.0, top_p=0.9, seed=i),
        Params(tokens, temperature=0.7, logit_bias=((5, 2.0),), seed=i),
        Params(tokens, temperature=0.0, top_logprobs=2),
    ][(i // 2) % 4]


def run(engine, rows: int, tokens: int, chunk: int, mixed: bool, tag: str) -> float:
    """Seconds to generate the batch; chunk 0: no pauses."""
    sched = engine.scheduler
    sched.pause_for = (lambda batch: lambda generated: generated >= chunk) if chunk else (lambda batch: None)
    release = threading.Event()
    generate = engine.model.generate

    def held(*a, **k):  # the requests queue while the worker waits, then run as one batch
        release.wait(60)
        return generate(*a, **k)

    engine.model.generate = held
    gens = [
        engine.submit(engine.text_ids(f"{tag} client {i} asks about Lima."), mixed_params(i, tokens, mixed))
        for i in range(rows)
    ]
    time.sleep(0.2)
    t0 = time.perf_counter()
    release.set()
    threads = [threading.Thread(target=g.collect) for g in gens]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    engine.model.generate = generate
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--chunks", default="1,2,4,8,16")
    p.add_argument("--greedy", action="store_true", help="all rows greedy (default: mixed options)")
    p.add_argument("--block-size", type=int, default=16, help="the store's block size")
    args = p.parse_args()
    engine = build_engine(
        Config(model=args.model, max_batch_size=max(8, args.rows), block_size=args.block_size)
    )
    run(engine, args.rows, 8, 0, not args.greedy, "warm-up")
    base = run(engine, args.rows, args.tokens, 0, not args.greedy, "base")
    step = base / args.tokens
    print(
        f"{args.rows} rows x {args.tokens} tokens, {'greedy' if args.greedy else 'mixed options'}; load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'chunk':>6} {'seconds':>8} {'s/step':>8} {'vs none':>8} {'pause cost (steps)':>19}")
    print(f"{'none':>6} {base:>8.2f} {step * 1e3:>6.1f}ms {1.0:>8.2f} {'':>19}")
    for chunk in [int(c) for c in args.chunks.split(",")]:
        t = run(engine, args.rows, args.tokens, chunk, not args.greedy, f"chunk {chunk}")
        pauses = (args.tokens - 1) // chunk
        cost = (t - base) / max(pauses, 1) / step
        print(f"{chunk:>6} {t:>8.2f} {t / args.tokens * 1e3:>6.1f}ms {t / base:>8.2f} {cost:>19.1f}")


if __name__ == "__main__":
    main()
