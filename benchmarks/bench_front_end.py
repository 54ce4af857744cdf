"""What a request costs an HTTP front end's process (``--api-server-count``), in CPU time.

    PYTHONPATH=$PWD python benchmarks/bench_front_end.py [--requests 200] [--clients 8]
        [--max-tokens 16,256] [--api-server-count 1]

Starts ``python -m demo --model builtin-tiny --api-server-count N``, sends ``--requests``
streamed chat requests per reply length from ``--clients`` clients at once, and reads each
process's CPU time (``/proc/PID/stat``: user + system) before and after: a front end's CPU per
request and per streamed token, the engine process's per request, and req/s. The pids come
from the supervisor's log lines (``engine process: pid``, ``front end I: pid``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def start(args, log_path: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "demo", "--model", "builtin-tiny", "--port", "0"]
    cmd += ["--api-server-count", str(args.api_server_count), "--max-batch-size", str(args.clients)]
    env = {**os.environ, "PYTHONPATH": ROOT}
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    for line in proc.stdout:
        if "serving on " in line:
            return proc, line.split("serving on ", 1)[1].strip()
    raise RuntimeError(f"the server exited with {proc.wait()}: {open(log_path).read()[-2000:]}")


def ask(url: str, k: int, max_tokens: int) -> int:
    body = {
        "messages": [{"role": "user", "content": f"Question {k}: tell me about Lima."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "logit_bias": {"1": -100},  # builtin-tiny's eos: every reply runs to max_tokens
    }
    events = 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            events += line.startswith(b"data: {")
    return events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", default="16,256")
    p.add_argument("--api-server-count", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "server.log")
        proc, url = start(args, log)
        try:
            text = open(log).read()
            engine = int(re.findall(r"engine process: pid (\d+)", text)[-1])
            fronts = [int(pid) for _, pid in re.findall(r"front end (\d+): pid (\d+)", text)]
            for k in range(4):  # warm-up: first requests pay for lazy imports
                ask(url, k, 8)
            print(
                f"front-end CPU: {args.requests} streamed chat requests per length, {args.clients} clients, "
                f"--api-server-count {args.api_server_count}, load {os.getloadavg()[0]:.1f}"
            )
            print(
                f"{'max_tokens':>10} {'req/s':>6} {'events/s':>8} {'front end ms/req':>16} {'us/event':>8} {'engine ms/req':>13}"
            )
            for max_tokens in [int(n) for n in args.max_tokens.split(",")]:
                before = [cpu_s(pid) for pid in fronts], cpu_s(engine)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.clients) as pool:
                    events = sum(pool.map(lambda k, n=max_tokens: ask(url, k, n), range(args.requests)))
                wall = time.perf_counter() - t0
                front = sum(cpu_s(pid) for pid in fronts) - sum(before[0])
                eng = cpu_s(engine) - before[1]
                print(
                    f"{max_tokens:>10} {args.requests / wall:>6.2f} {events / wall:>8.0f} "
                    f"{front / args.requests * 1e3:>16.2f} {front / events * 1e6:>8.0f} "
                    f"{eng / args.requests * 1e3:>13.2f}"
                )
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
