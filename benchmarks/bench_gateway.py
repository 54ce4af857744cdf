"""Two demo replicas behind a router: hit rate and req/s, per routing policy.

Policies: the SGLang Model Gateway's `round_robin` and `cache_aware` (which guesses what each
replica holds from the requests it routed), and `kv_events`: examples/kv_router.py, which
routes by what the replicas' KV events say they hold (docs/kv-events.md).

Starts two `python -m demo` replicas (built-in-tiny model, `--cache-tokens` each; with KV events
on IPC sockets for `kv_events`) and the router in front of them, once per policy, and sends questions about documents whose prompts
together are about twice what one replica's pool holds (so only a split of the documents
between the replicas keeps them all cached): `--clients` clients, each question about a random
document. Prints the hit rate (cached / prompt tokens) and req/s per policy.

    python -m benchmarks.bench_gateway                # ~2 minutes
    python -m benchmarks.bench_gateway --requests 400 --cache-tokens 8192
    python -m benchmarks.bench_gateway --policies cache_aware,kv_events
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_url(proc: subprocess.Popen, what: str) -> str:
    """The URL ``proc`` prints once it listens ("serving on URL"); RuntimeError if it exits."""
    while select.select([proc.stdout], [], [], 120)[0]:
        line = proc.stdout.readline()
        if "serving on " in line:
            return line.split("serving on ", 1)[1].strip()
        if not line:
            break
    raise RuntimeError(f"{what} exited with {proc.wait()}")


def replica(cache_tokens: int, events: dict | None = None) -> tuple[subprocess.Popen, str]:
    args = ["--model", "builtin-tiny", "--cache-tokens", str(cache_tokens), "--port", "0"]
    if events is not None:
        args += ["--kv-events-config", json.dumps(events)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "demo", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    return proc, serving_url(proc, "replica")


def kv_router(replicas: list[tuple[str, dict]]) -> tuple[subprocess.Popen, str]:
    """examples/kv_router.py in front of ``(url, events config)`` replicas."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "examples", "kv_router.py"),
        "--port",
        "0",
        "--tokenizer",
        "builtin-tiny",
    ]
    for url, events in replicas:
        cmd += ["--replica", f"{url}={events['endpoint']},{events['replay_endpoint']}"]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    return proc, serving_url(proc, "kv_router")


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


def run(policy: str, args, tmp: str) -> tuple[float, float]:
    events = [
        {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp}/{policy}{i}.pub",
         "replay_endpoint": f"ipc://{tmp}/{policy}{i}.replay"}
        for i in range(2)
    ] if policy == "kv_events" else [None, None]  # fmt: skip
    procs = [replica(args.cache_tokens, e) for e in events]
    gate = None
    try:
        if policy == "kv_events":
            gate, url = kv_router([(u, e) for (_, u), e in zip(procs, events)])
        else:
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
    p.add_argument("--policies", default="round_robin,cache_aware,kv_events")
    args = p.parse_args()
    from demo.model.loading import build_builtin

    _, tokenizer = build_builtin("builtin-tiny")
    per_doc = len(tokenizer(document(0, args.lines))["input_ids"])
    print(f"{args.docs} documents x ~{per_doc} tokens = {args.docs * per_doc} tokens; "
          f"each replica holds {args.cache_tokens} ({args.docs * per_doc / args.cache_tokens:.1f}x)")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        rows = {policy: run(policy, args, tmp) for policy in args.policies.split(",")}
    print(f"\n{'policy':<12} {'hit rate':>8} {'req/s':>7}")
    for policy, (hit, rate) in rows.items():
        print(f"{policy:<12} {hit:>8.2f} {rate:>7.2f}")
    base = rows.get("round_robin")
    for policy, (hit, _) in rows.items():
        if base is not None and policy != "round_robin":
            print(f"hit rate, {policy} / round_robin: {hit / max(base[0], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
