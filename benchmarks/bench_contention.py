"""radixkv against stock generate() on a busy machine: quiet, then beside a competing load.

Runs `benchmarks.bench_batch --parts cold` (a cold batch of questions over one 2,000-token
document: RadixCache with in-batch sharing against stock batched generate) in a child process
per setting (torch threads, OMP wait policy: both fixed when the OpenMP runtime starts), once
quiet and once beside a competitor: a second process multiplying 512x512 matrices on every
core. Prints each time and the radix/stock lead in both conditions.

    python benchmarks/bench_contention.py --settings 2,2:passive,1 --questions 8
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPETITOR = (
    "import os, torch\n"
    "torch.set_num_threads(os.cpu_count())\n"
    "a = torch.randn(512, 512)\n"
    "while True:\n"
    "    a = torch.tanh(a @ a)\n"
)


def run_cold(threads: int, policy: str | None, questions: int) -> tuple[float, float]:
    """(stock seconds, radix seconds) of one bench_batch cold run."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": str(threads)}
    if policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    cmd = [sys.executable, "-m", "benchmarks.bench_batch", "--parts", "cold", "--repeats", "1"]
    cmd += ["--questions", str(questions), "--threads", str(threads)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    stock = float(re.search(r"stock batched generate\s+([\d.]+)", out).group(1))
    radix = float(re.search(r"RadixCache, in-batch sharing\s+([\d.]+)", out).group(1))
    return stock, radix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="2,2:passive,1", help="threads[:wait policy], comma-separated")
    p.add_argument("--questions", type=int, default=8)
    args = p.parse_args()
    rows = []
    for setting in args.settings.split(","):
        threads, _, policy = setting.partition(":")
        quiet = run_cold(int(threads), policy or None, args.questions)
        load_quiet = os.getloadavg()[0]
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR])
        try:
            time.sleep(2)
            loaded = run_cold(int(threads), policy or None, args.questions)
            load_busy = os.getloadavg()[0]
        finally:
            competitor.kill()
            competitor.wait()
        rows.append((setting, quiet, loaded, load_quiet, load_busy))
    print(
        f"\ncold batch: {args.questions} questions over one 2,000-token document (bench_batch --parts cold)"
    )
    print(f"{'threads':>10} {'':>6} {'stock s':>8} {'radix s':>8} {'lead':>6} {'load':>5}")
    for setting, quiet, loaded, lq, lb in rows:
        for name, (stock, radix), load in (("quiet", quiet, lq), ("busy", loaded, lb)):
            print(f"{setting:>10} {name:>6} {stock:>8.2f} {radix:>8.2f} {stock / radix:>5.1f}x {load:>5.1f}")


if __name__ == "__main__":
    main()
