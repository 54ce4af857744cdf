"""Running rows' inter-token latency when a 4,000-token prompt arrives (issue 27, item 4).

In-process on the built-in model: `--rows` greedy requests decode `--tokens` each; one second
in, a ~4,000-token prompt arrives (or none, the baseline). Prints the running rows' time
between tokens (mean, p99, max) and the long prompt's time to first token, for each
`--prefill-chunk` (0: the long prompt joins the batch at once, and every row waits for its
prefill; else it is prefilled in slices that take turns with decode chunks).

    python benchmarks/bench_long_prompt.py --rows 16 --tokens 200 --prefill-chunks 0,512
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_http import table  # noqa: E402
from demo.api.app import build_engine  # noqa: E402
from demo.config import Config  # noqa: E402
from demo.engine.engine import Params  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Readers:
    """A thread per request iterating its deltas, as the HTTP threads do; ``gaps``: the times
    between a reply's streamed pieces, all requests together. ``join()`` waits for the ends."""

    def __init__(self, gens) -> None:
        self.gaps: list[float] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read, args=(g,)) for g in gens]
        for t in self._threads:
            t.start()

    def _read(self, gen) -> None:
        last = None
        for _ in gen:
            now = time.perf_counter()
            if last is not None:
                with self._lock:
                    self.gaps.append(now - last)
            last = now

    def join(self) -> list[float]:
        for t in self._threads:
            t.join()
        return self.gaps


def run(engine, rows: int, tokens: int, arrival: bool, tag: str) -> tuple[list[float], float]:
    """(gaps between the running rows' tokens, the long prompt's TTFT or nan)."""
    gens = [
        engine.submit(engine.text_ids(f"{tag} row {i} tells about Lima."), Params(tokens, temperature=0.0))
        for i in range(rows)
    ]
    readers = Readers(gens)
    ttft = float("nan")
    if arrival:
        time.sleep(1.0)
        doc = engine.text_ids(f"{tag} document.\n" + table(228) + "Who lives in Lima?")
        ttft = engine.submit(doc, Params(4, temperature=0.0)).collect().ttft_s
    return readers.join(), ttft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--prefill-chunks", default="0,512")
    args = p.parse_args()
    engine = build_engine(Config(model=args.model, max_batch_size=args.rows + 1))
    run(engine, args.rows, 4, False, "warm-up")
    print(f"{args.rows} rows x {args.tokens} tokens, greedy, --decode-chunk {engine.scheduler.decode_chunk}")
    print(f"{'case':>28} {'ITL mean':>9} {'p99':>8} {'max':>8} {'long TTFT':>10} {'load':>5}")
    cases = [("no arrival", None)] + [
        (f"arrival, prefill chunk {c}", int(c)) for c in args.prefill_chunks.split(",")
    ]
    for k, (name, chunk) in enumerate(cases):
        if chunk is not None:
            engine.scheduler.prefill_chunk = chunk
        gaps, ttft = run(engine, args.rows, args.tokens, chunk is not None, f"case {k}")
        print(
            f"{name:>28} {sum(gaps) / len(gaps) * 1e3:>6.0f} ms {pct(gaps, 0.99) * 1e3:>5.0f} ms "
            f"{max(gaps) * 1e3:>5.0f} ms {ttft:>9.1f}s {os.getloadavg()[0]:>5.1f}"
        )


if __name__ == "__main__":
    main()
