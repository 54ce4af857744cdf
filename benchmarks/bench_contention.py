"""radixkv against stock generate() on a busy machine: quiet, then beside a competing load.

Runs `benchmarks.contention_job` (a cold batch of questions over one 2,000-token document, and
8 rows decoding 32 tokens over a cached prefix: RadixCache against stock generate) in a child
process per setting (torch threads, OMP wait policy: both fixed when the OpenMP runtime
starts), once quiet and once beside a competitor: a second process multiplying 512x512
matrices on every core. Prints each time and the radix/stock lead in both conditions.

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


def run_job(threads: int | None, policy: str | None, questions: int) -> dict[str, tuple[float, float]]:
    """{case: (stock seconds, radix seconds)} of one contention_job run."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    cmd = [sys.executable, "-m", "benchmarks.contention_job", "--questions", str(questions)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    return {m[0]: (float(m[1]), float(m[2])) for m in re.findall(r"^(\w+) ([\d.]+) ([\d.]+)$", out, re.M)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default="default,2:passive,1", help="threads[:wait policy], comma-separated")
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--busy-only", action="store_true", help="skip the quiet runs")
    args = p.parse_args()
    print(f"cold: {args.questions} questions over one 2,000-token document; decode: 8 rows x 32 tokens")
    print(
        f"{'threads':>10} {'':>6} {'case':>7} {'stock s':>8} {'radix s':>8} {'lead':>6} {'load':>5}",
        flush=True,
    )
    for setting in args.settings.split(","):
        threads, _, policy = setting.partition(":")
        threads = None if threads == "default" else int(threads)
        for name in ("busy",) if args.busy_only else ("quiet", "busy"):
            competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if name == "busy" else None
            try:
                time.sleep(2 if competitor else 0)
                cases = run_job(threads, policy or None, args.questions)
                load = os.getloadavg()[0]
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
            for case, (stock, radix) in cases.items():
                print(
                    f"{setting:>10} {name:>6} {case:>7} {stock:>8.2f} {radix:>8.2f} {stock / radix:>5.1f}x {load:>5.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
