"""Streaming a reply's text: demo.engine.textstream's window against decoding every id at each
token (what it did before), in one run.

1. The stream alone, on the built-in tokenizer: CPU time to stream replies of 512 to 8,192
   tokens, one token per push, both ways.
2. The engine, in process: `--rows` greedy requests of `--tokens` each (EOS biased away, so
   every reply is that long), each read by its own thread as the HTTP threads read them; tokens/s,
   the process's CPU time and the gaps between a reply's tokens, alternating the two ways
   `--repeats` times. Decoding every id holds the GIL for O(n) per token, which the step loop's
   thread waits for.

    python benchmarks/bench_stream_text.py                        # 16 rows x 2,000 tokens
    python benchmarks/bench_stream_text.py --rows 32 --tokens 1000 --repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from demo.engine.textstream import TextStream  # noqa: E402


@contextlib.contextmanager
def every_id(on: bool):
    """TextStream decoding every id at each push (the stream before the window) while on."""
    window = TextStream._full
    if on:
        TextStream._full = lambda self: self._decode(self._ids)
    try:
        yield
    finally:
        TextStream._full = window


def stream_alone(lengths: list[int]) -> None:
    from demo.model.loading import build_tokenizer

    tok = build_tokenizer(2048)
    rng = random.Random(0)
    words = tok.encode(" ".join(f"word{rng.randrange(500)} and more" for _ in range(4000)))

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    print("the stream alone (built-in tokenizer; CPU seconds to stream one reply, a token per push):")
    for n in lengths:
        ids = (words * (n // len(words) + 1))[:n]
        spent = {}
        for whole in (True, False):
            with every_id(whole):
                s = TextStream(decode)
                t0 = time.process_time()
                for i in ids:
                    s.push([i])
                s.finish()
                spent[whole] = time.process_time() - t0
            assert s.text == decode(ids)
        print(
            f"  {n:>5} tokens: every id {spent[True]:.3f} s, window {spent[False]:.3f} s "
            f"({spent[True] / max(spent[False], 1e-9):.0f}x)"
        )


def engine_run(engine, rows: int, tokens: int, tag: str) -> tuple[float, float, list[float]]:
    """(tokens/s, process CPU seconds, gaps between a reply's streamed pieces)."""
    from benchmarks.bench_long_prompt import Readers
    from demo.engine.engine import Params

    away = tuple((e, -100.0) for e in engine.runner.eos)
    gens = [
        engine.submit(engine.text_ids(f"{tag} row {i} tells a long story about Lima."), Params(tokens, temperature=0.0, logit_bias=away))
        for i in range(rows)
    ]  # fmt: skip
    t0, c0 = time.perf_counter(), time.process_time()
    gaps = Readers(gens).join()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    made = sum(g.result.completion_tokens for g in gens)
    assert made == rows * tokens, made
    return made / wall, cpu, gaps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="512,2000,4000,8192", help="part 1: reply lengths")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=2, help="part 2: runs of each way, alternating")
    p.add_argument("--model", default="builtin")
    args = p.parse_args()
    stream_alone([int(n) for n in args.lengths.split(",")])
    if args.rows <= 0:
        return
    from demo.api.app import build_engine
    from demo.config import Config

    engine = build_engine(Config(model=args.model, max_batch_size=max(32, args.rows)))
    print(
        f"\nthe engine ({args.model}, in process): {args.rows} streamed rows x {args.tokens} tokens, "
        f"load {os.getloadavg()[0]:.1f} at the start"
    )
    engine_run(engine, args.rows, 8, "warm-up")  # the engine's first requests, timed by neither way
    for k in range(args.repeats):
        for whole in (True, False):
            with every_id(whole):
                rate, cpu, gaps = engine_run(engine, args.rows, args.tokens, f"run {k} {whole}")
            gaps.sort()
            print(
                f"  {'every id' if whole else 'window  '}: {rate:6.0f} tokens/s, CPU {cpu:5.1f} s, gap mean "
                f"{statistics.mean(gaps) * 1e3:5.1f} ms, p99 {gaps[int(0.99 * len(gaps))] * 1e3:5.1f} ms "
                f"(load {os.getloadavg()[0]:.1f})"
            )
    os._exit(0)  # the engine's worker thread is not ours to join


if __name__ == "__main__":
    main()
