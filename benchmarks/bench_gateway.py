"""Two demo replicas behind the SGLang Model Gateway: hit rate and req/s, cache_aware vs round_robin.

Starts two `python -m demo` replicas (built-in-tiny model, `--cache-tokens` each) and the
gateway in front of them, once per policy, and sends questions about documents whose prompts
together are about twice what one replica's pool holds (so only a split of the documents
between the replicas keeps them all cached): `--clients` clients, each question about a random
document. Prints the hit rate (cached / prompt tokens) and req/s per policy.

    python -m benchmarks.bench_gateway                # ~2 minutes
    python -m benchmarks.bench_gateway --requests 400 --cache-tokens 8192
"""

from __future__ import annotations

import argparse
import os
import random
import select
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica(cache_tokens: int) -> tuple[subprocess.Popen, str]:
    args = ["--model", "builtin-tiny", "--cache-tokens", str(cache_tokens), "--port", "0"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "demo", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    while select.select([proc.stdout], [], [], 120)[0]:
        line = proc.stdout.readline()
        if "serving on " in line:
            return proc, line.split("serving on ", 1)[1].strip()
        if not line:
            break
    raise RuntimeError(f"replica exited with {proc.wait()}")


def router(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port()), "--policy", policy, "--worker-urls", *urls]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            workers = requests.get(url + "/workers", timeout=2).json()["workers"]
            if len(workers) == len(urls) and all(w["is_healthy"] for w in workers):
                return proc, url
        except (requests.ConnectionError, requests.Timeout, KeyError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the gateway did not register the replicas")


def document(d: int, lines: int) -> str:
    return f"Document {d}.\n" + "\n".join(
        f"| Person {d}-{i} | {20 + i % 50} | Town {(d * 7 + i) % 13} |" for i in range(lines)
    )


def run(policy: str, args) -> tuple[float, float]:
    procs = [replica(args.cache_tokens) for _ in range(2)]
    gate = None
    try:
        gate, url = router([u for _, u in procs], policy)
        rng = random.Random(0)
        plan = [(rng.randrange(args.docs), i) for i in range(args.requests)]

        def ask(item) -> tuple[int, int]:
            d, i = item
            body = {"model": "builtin-tiny", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": document(d, args.lines) + f"\nQ{i}: who is {i % 40}?"}]}  # fmt: skip
            usage = requests.post(url + "/v1/chat/completions", json=body, timeout=300).json()["usage"]
            return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(ask, plan))
        wall = time.perf_counter() - t0
        return sum(c for c, _ in results) / sum(p for _, p in results), len(plan) / wall
    finally:
        if gate is not None:
            gate.terminate()
        for proc, _ in procs:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-tokens", type=int, default=4096, help="each replica's pool")
    p.add_argument("--docs", type=int, default=9)
    p.add_argument("--lines", type=int, default=40, help="table lines per document")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--clients", type=int, default=4)
    args = p.parse_args()
    from demo.model.loading import build_builtin

    _, tokenizer = build_builtin("builtin-tiny")
    per_doc = len(tokenizer(document(0, args.lines))["input_ids"])
    print(f"{args.docs} documents x ~{per_doc} tokens = {args.docs * per_doc} tokens; "
          f"each replica holds {args.cache_tokens} ({args.docs * per_doc / args.cache_tokens:.1f}x)")  # fmt: skip
    rows = {policy: run(policy, args) for policy in ("round_robin", "cache_aware")}
    print(f"\n{'policy':<12} {'hit rate':>8} {'req/s':>7}")
    for policy, (hit, rate) in rows.items():
        print(f"{policy:<12} {hit:>8.2f} {rate:>7.2f}")
    ratio = rows["cache_aware"][0] / max(rows["round_robin"][0], 1e-9)
    print(f"\nhit rate, cache_aware / round_robin: {ratio:.2f}x")


if __name__ == "__main__":
    main()
