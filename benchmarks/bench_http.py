"""Time to first token over HTTP, prefix reuse on vs off: the "long table, many questions" demo.

Starts `python -m demo` twice on 127.0.0.1 (a free port; RADIXKV_REUSE=1, then 0), sends a
~2,000-token markdown table of people followed by different questions, streaming, and measures
the time to the first generated text on the client. Then several clients at once.

    python benchmarks/bench_http.py                  # built-in model
    python benchmarks/bench_http.py --model PATH --rows 300 --questions 8 --concurrency 4

Load mode: `--load` starts the server twice, with --max-batch-size 1 (one request at a time)
and with the default batching, and runs 32 clients for `--seconds` each: a mix of
shared-prefix (the table + a question) and unrelated short prompts, streaming and not. It
prints requests/s, p50/p99 latency and TTFT (streaming requests) and the 503 count.

    python benchmarks/bench_http.py --load           # ~2 minutes

Tenants mode: `--tenants 8` runs the batched server of load mode twice, with one API key and
with 8 (client c sends key c % 8), and prints req/s of each: tenants share batches (per-row
cache namespaces), so 8 keys should serve about what 1 does.

    python benchmarks/bench_http.py --load --tenants 8

Mixed mode: `--mixed` runs the batched server with each `--chunks` value as --decode-chunk
(default 0 and 16: a batch that runs to its end, head-of-line blocking, and today's chunk), 32
streaming clients for `--seconds`: half ask for 16 tokens, a quarter for 256, a quarter for
1,024 (short unrelated prompts). `--options mixed`: half the clients greedy, the rest spread
over temperature, top_p, seed, logit_bias and logprobs. `--long-prompt-every S`: one more
client sends a ~4,000-token prompt every S seconds. `--server-root DIR` starts the server from
another checkout (before/after in one sitting); `--server-args` adds flags to each server.
It prints the short requests' TTFT p50/p99 against an idle server's (all of them, and
*steady*: those sent after the first `--warmup` seconds, default 5, since every client starts
at once), req/s, and the inter-token latency (mean gap between streamed chunks) of the long
replies.

    python benchmarks/bench_http.py --mixed --model builtin --seconds 60
    python benchmarks/bench_http.py --mixed --options mixed --chunks 16 --server-root /work/main
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST = ["Alice", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kenji", "Lena"]
LAST = ["Smith", "Okafor", "Tanaka", "Rossi", "Novak", "Silva", "Haddad", "Kim", "Berg", "Moreau"]
CITIES = ["Berlin", "Lagos", "Lima", "Osaka", "Paris", "Porto", "Quito", "Rome", "Seoul", "Tunis", "Vienna"]
JOBS = ["baker", "doctor", "engineer", "farmer", "lawyer", "nurse", "pilot", "teacher", "writer"]


def table(rows: int) -> str:
    lines = ["| id | name | age | city | job |", "|---|---|---|---|---|"]
    for i in range(rows):
        name = f"{FIRST[i % len(FIRST)]} {LAST[(i * 7) % len(LAST)]}"
        lines.append(
            f"| {i} | {name} | {18 + (i * 37) % 60} | {CITIES[(i * 5) % len(CITIES)]} | {JOBS[(i * 3) % len(JOBS)]} |"
        )
    return "Here is a table of people:\n\n" + "\n".join(lines) + "\n\n"


def questions(n: int) -> list[str]:
    forms = [
        "Who lives in {}?",
        "How many people are {}s?",
        "What is the average age in {}?",
        "Name every {}.",
    ]
    values = [CITIES, JOBS, CITIES, JOBS]
    qs = [forms[i % 4].format(values[i % 4][(i * 5) % len(values[i % 4])]) for i in range(n)]
    return [f"Question {i + 1}: {q}" for i, q in enumerate(qs)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    reuse: bool, model: str | None, threads: int | None, extra: list[str] = (), root: str = ROOT
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # the checkout first; the rest of PYTHONPATH stays (packages installed to a --target folder)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "RADIXKV_REUSE": "1" if reuse else "0", "PYTHONPATH": path}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "demo", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", model] if model else []
    cmd += list(extra)
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    url = f"http://127.0.0.1:{port}"
    for line in proc.stdout:  # wait for the line demo/__main__.py prints once it listens
        if "serving on" in line:
            return proc, url
    raise RuntimeError(f"server exited with {proc.wait()} before listening")


def ask(url: str, content: str, max_tokens: int) -> dict:
    """One streaming chat request; client-side TTFT = first non-empty content delta."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, usage = None, None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {
        "ttft": ttft if ttft is not None else total,
        "total": total,
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "completion": usage["completion_tokens"],
    }


def run_mode(reuse: bool, args) -> tuple[list[dict], list[dict], float]:
    proc, url = start_server(reuse, args.model, args.threads)
    try:
        ask(url, "warm-up", 4)  # first-call overheads (allocations, lazy imports) out of the table
        doc = table(args.rows)
        sequential = [ask(url, doc + q, args.max_tokens) for q in questions(args.questions)]
        more = questions(args.questions + args.concurrency)[args.questions :]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            concurrent = list(pool.map(lambda q: ask(url, doc + q, args.max_tokens), more))
        return sequential, concurrent, time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def load_request(
    url: str, content: str, max_tokens: int, stream: bool, key: str | None = None, options: dict | None = None
) -> dict:
    """One chat request under load: status, latency, TTFT and the gaps between streamed
    chunks after the first (streaming only). ``options``: more body fields (sampling)."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        **(options or {}),
    }
    gaps: list[float] = []
    t0 = time.perf_counter()
    ttft = None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with requests.post(
        url + "/v1/chat/completions", json=body, stream=stream, timeout=300, headers=headers
    ) as r:
        if r.status_code != 200:
            _ = r.content  # read the error body so the connection is reusable
            return {
                "status": r.status_code,
                "total": time.perf_counter() - t0,
                "ttft": None,
                "retry_after": float(r.headers.get("Retry-After", 0)),
            }
        if stream:
            last = None
            for line in r.iter_lines(decode_unicode=True):
                if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    now = time.perf_counter()
                    ttft = now - t0 if ttft is None else ttft
                    if last is not None:
                        gaps.append(now - last)
                    last = now
        else:
            r.json()
    return {"status": 200, "total": time.perf_counter() - t0, "ttft": ttft, "gaps": gaps}


def run_load(batch_size: int, args, keys: int = 0) -> tuple[list[dict], float, float]:
    """`args.clients` clients, each sending requests back to back for `args.seconds`; with
    `keys`, the server takes that many API keys and client c sends key c % keys."""
    extra = ["--max-batch-size", str(batch_size), "--max-queue", str(args.max_queue)]
    names = [f"key-{i}" for i in range(keys)]
    extra += ["--api-keys", ",".join(names)] if keys else []
    proc, url = start_server(True, args.model, args.threads, extra)
    try:
        doc = table(args.load_rows)
        for key in names or [None]:  # the shared prefix is cached (per tenant), as in steady state
            load_request(url, doc + "warm-up", 2, False, key)
        results: list[dict] = []
        deadline = time.perf_counter() + args.seconds

        def client(c: int) -> None:
            k = 0
            while time.perf_counter() < deadline:
                shared = (c + k) % 2 == 0
                content = (
                    doc + f"Client {c}, question {k}: who is from Lima?"
                    if shared
                    else (
                        f"Client {c} asks unrelated question {k}: tell me about {CITIES[(c + k) % len(CITIES)]}."
                    )
                )
                key = names[c % keys] if keys else None
                results.append(load_request(url, content, args.max_tokens, (c + k) % 4 < 2, key))
                time.sleep(results[-1].get("retry_after", 0))  # a polite client honours a 503's Retry-After
                k += 1

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client, range(args.clients)))
        wall = time.perf_counter() - t0
        metrics = requests.get(url + "/metrics", timeout=30).text
        sums = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith(("radixkv_batch_size_sum", "radixkv_batch_size_count"))
        }
        mean_batch = sums["radixkv_batch_size_sum"] / max(1, sums["radixkv_batch_size_count"])
        return results, wall, mean_batch
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# The sampled half of `--options mixed` (the other half is greedy), one per client in turn.
MIXED_OPTIONS = [
    {"temperature": 0.8},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 0.7, "seed": 1234},
    {"temperature": 0, "logit_bias": {"5": 3}},
    {"temperature": 0, "logprobs": True, "top_logprobs": 2},
    {"temperature": 0.9, "top_p": 0.95, "seed": 7, "logprobs": True},
]


def client_options(c: int, mode: str) -> dict:
    if mode != "mixed" or c % 2 == 0:
        return {}
    return MIXED_OPTIONS[(c // 2) % len(MIXED_OPTIONS)]


def run_mixed(
    decode_chunk: int, args, api_servers: int | None = None
) -> tuple[list[dict], float, list[float], str]:
    """Mixed lengths under load; returns (results tagged with max_tokens, wall, idle TTFTs,
    /metrics text). ``api_servers``: the server's --api-server-count (None: not passed)."""
    extra = ["--max-queue", str(args.max_queue), "--decode-chunk", str(decode_chunk)]
    extra += ["--api-server-count", str(api_servers)] if api_servers is not None else []
    extra += ["--max-batch-size", str(args.max_batch_size)] + args.server_args.split()
    proc, url = start_server(True, args.model, args.threads, extra, args.server_root or ROOT)
    try:
        idle = []
        for i in range(5):  # a short request on the idle server: the reference TTFT
            idle.append(load_request(url, f"Idle probe {i}: tell me about Lima.", 16, True)["ttft"])
        results: list[dict] = []
        t0 = time.perf_counter()
        deadline = t0 + args.seconds
        lengths = (16, 16, 256, 1024)

        def client(c: int) -> None:
            k = 0
            while time.perf_counter() < deadline:
                max_tokens = lengths[c % 4]
                content = f"Client {c} asks question {k}: tell me about {CITIES[(c + k) % len(CITIES)]}."
                sent = time.perf_counter() - t0
                r = load_request(url, content, max_tokens, True, options=client_options(c, args.options))
                results.append({**r, "max_tokens": max_tokens, "sent": sent})
                time.sleep(r.get("retry_after", 0))
                k += 1

        def long_prompts(_) -> None:  # a ~4,000-token document every `long_prompt_every` s
            k = 0
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                doc = f"Document {k}.\n" + table(228)
                r = load_request(url, doc + "Who lives in Lima?", 16, True)
                results.append({**r, "max_tokens": "long prompt", "sent": t - t0})
                time.sleep(max(0.0, args.long_prompt_every - (time.perf_counter() - t)))
                k += 1

        jobs = [(client, c) for c in range(args.clients)]
        jobs += [(long_prompts, None)] if args.long_prompt_every else []
        with ThreadPoolExecutor(len(jobs)) as pool:
            list(pool.map(lambda job: job[0](job[1]), jobs))
        wall = time.perf_counter() - t0
        return results, wall, idle, requests.get(url + "/metrics", timeout=30).text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def mixed_main(args) -> None:
    chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [0, args.decode_chunk]
    counts = [int(n) for n in args.api_server_counts.split(",")] if args.api_server_counts else [None]
    rows, loads = {}, {}
    for _ in range(args.repeat):
        for n in counts:  # alternating, so that a change in the machine's load hits every row
            for chunk in chunks:
                label = f"{chunk if chunk else 'off (0)'}" + (f" api {n}" if n is not None else "")
                label += f" #{_ + 1}" if args.repeat > 1 else ""
                rows[label] = run_mixed(chunk, args, n)
                loads[label] = os.getloadavg()[0]
    print(
        f"\nmixed: {args.clients} streaming clients for {args.seconds:.0f} s each, --max-batch-size "
        f"{args.max_batch_size}; half ask for 16 tokens, a quarter 256, a quarter 1,024; options "
        f"{args.options}; a 4,000-token prompt every {args.long_prompt_every or '-'} s; server "
        f"{args.server_root or ROOT} {args.server_args}; load {os.getloadavg()[0]:.1f}; steady: "
        f"requests sent after the first {args.warmup:g} s (all {args.clients} clients start at once)\n"
    )
    print(
        f"{'decode chunk':>12} {'done':>5} {'req/s':>6} {'short TTFT p50':>15} {'p99':>7} {'steady p50':>11} "
        f"{'p99':>7} {'idle TTFT':>10} {'503':>4} {'long ITL p50':>12} {'p99':>7} {'long-prompt TTFT':>16} "
        f"{'forward':>8} {'load':>5}"
    )
    for label, (results, wall, idle, metrics) in rows.items():
        ok = [r for r in results if r["status"] == 200]
        short = [r["ttft"] for r in ok if r["max_tokens"] == 16 and r["ttft"] is not None]
        steady = [
            r["ttft"]
            for r in ok
            if r["max_tokens"] == 16 and r["ttft"] is not None and r["sent"] >= args.warmup
        ]
        gaps = [g for r in ok if r["max_tokens"] in (256, 1024) for g in r["gaps"]]
        docs = [r["ttft"] for r in ok if r["max_tokens"] == "long prompt" and r["ttft"] is not None]
        print(
            f"{label:>12} {len(ok):>5} {len(ok) / wall:>6.2f} "
            f"{pct(short, 0.5) * 1e3:>12.0f} ms {pct(short, 0.99) * 1e3:>4.0f} ms "
            f"{pct(steady, 0.5) * 1e3:>8.0f} ms {pct(steady, 0.99) * 1e3:>4.0f} ms "
            f"{statistics.median(idle) * 1e3:>7.0f} ms {sum(r['status'] == 503 for r in results):>4} "
            f"{pct(gaps, 0.5) * 1e3:>9.0f} ms {pct(gaps, 0.99) * 1e3:>4.0f} ms "
            f"{(statistics.median(docs) * 1e3 if docs else float('nan')):>13.0f} ms "
            f"{mean_forward(metrics) * 1e3:>5.1f} ms {loads[label]:>5.1f}"
        )
    print("forward: the mean step-loop forward (radixkv_forward_seconds); load: after the row")


def mean_forward(metrics: str) -> float:
    """The server's mean step-loop forward, from its /metrics (nan for a server without it)."""
    values = {
        line.split()[0]: float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith(("radixkv_forward_seconds_sum", "radixkv_forward_seconds_count"))
    }
    count = values.get("radixkv_forward_seconds_count", 0)
    return values["radixkv_forward_seconds_sum"] / count if count else float("nan")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def load_main(args) -> None:
    rows = {}
    if args.tenants:
        for keys in (1, args.tenants):
            rows[f"{keys} key{'s' if keys > 1 else ''}"] = run_load(args.max_batch_size, args, keys)
    else:
        for batch_size in (1, args.max_batch_size):
            rows[f"batch {batch_size}"] = run_load(batch_size, args)
    print(
        f"\nload: {args.clients} clients for {args.seconds:.0f} s each, max_tokens {args.max_tokens}, "
        f"--max-queue {args.max_queue}; half shared-prefix (~{args.load_rows}-row table), half unrelated; "
        "half streaming\n"
    )
    print(
        f"{'server':>8} {'done':>5} {'req/s':>6} {'p50 ms':>8} {'p99 ms':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'503':>4} {'mean batch':>10}"
    )
    rates = {}
    for name, (results, wall, mean_batch) in rows.items():
        ok = [r for r in results if r["status"] == 200]
        ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
        rates[name] = len(ok) / wall
        print(
            f"{name:>8} {len(ok):>5} {rates[name]:>6.2f} {pct([r['total'] for r in ok], 0.5) * 1e3:>8.0f} "
            f"{pct([r['total'] for r in ok], 0.99) * 1e3:>8.0f} {pct(ttfts, 0.5) * 1e3:>9.0f} "
            f"{pct(ttfts, 0.99) * 1e3:>9.0f} {sum(r['status'] == 503 for r in results):>4} {mean_batch:>10.2f}"
        )
    first, last = rows
    what = f"{args.tenants} keys / 1 key" if args.tenants else "batched / one at a time"
    print(f"\nrequests/s, {what}: {rates[last] / rates[first]:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="passed to python -m demo --model (default: built-in)")
    p.add_argument(
        "--rows", type=int, default=110, help="table rows (110 = ~2,000 tokens on the built-in model)"
    )
    p.add_argument("--questions", type=int, default=6, help="sequential questions per mode")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4, help="clients at once, after the sequential part")
    p.add_argument(
        "--threads", type=int, help="OMP_NUM_THREADS for the server (steadier on a shared machine)"
    )
    p.add_argument("--load", action="store_true", help="load mode: batched vs one at a time")
    p.add_argument("--clients", type=int, default=32, help="load mode: concurrent clients")
    p.add_argument("--seconds", type=float, default=40.0, help="load mode: duration per server")
    p.add_argument("--load-rows", type=int, default=25, help="load mode: rows of the shared table")
    p.add_argument("--max-batch-size", type=int, default=8, help="load mode: the batched server's size")
    p.add_argument("--max-queue", type=int, default=32, help="load mode: the servers' --max-queue")
    p.add_argument(
        "--tenants", type=int, default=0, help="load mode: 1 API key vs this many (batched server)"
    )
    p.add_argument(
        "--mixed", action="store_true", help="mixed lengths: --decode-chunk 0 vs the chunked server"
    )
    p.add_argument(
        "--decode-chunk", type=int, default=16, help="mixed mode: the chunked server's --decode-chunk"
    )
    p.add_argument(
        "--chunks", help="mixed mode: --decode-chunk values to run, comma-separated (default 0,16)"
    )
    p.add_argument(
        "--options", choices=("greedy", "mixed"), default="greedy", help="mixed mode: sampling options"
    )
    p.add_argument(
        "--long-prompt-every",
        type=float,
        default=0.0,
        help="mixed mode: a 4,000-token prompt every S seconds",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="mixed mode: the steady columns leave out requests sent in the first S seconds",
    )
    p.add_argument(
        "--api-server-counts",
        help="mixed mode: --api-server-count values to run, comma-separated (e.g. 0,1,2; default: not passed)",
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="mixed mode: run every row this many times, alternating"
    )
    p.add_argument("--server-root", help="mixed mode: start the server from this checkout (e.g. /work/main)")
    p.add_argument("--server-args", default="", help="mixed mode: more flags for each server")
    args = p.parse_args()
    if args.mixed:
        mixed_main(args)
        return
    if args.load:
        load_main(args)
        return

    results = {}
    for reuse in (True, False):
        results[reuse] = run_mode(reuse, args)
    print(
        f"\nlong-table benchmark: {args.rows} rows, {args.questions} questions, max_tokens {args.max_tokens}, "
        "client-side time to first token (streaming)\n"
    )
    print(f"{'reuse':>5} {'req':>4} {'prompt':>7} {'cached':>7} {'TTFT ms':>9} {'total ms':>9}")
    for reuse in (True, False):
        for i, r in enumerate(results[reuse][0]):
            print(
                f"{'on' if reuse else 'off':>5} {i + 1:>4} {r['prompt']:>7} {r['cached']:>7} "
                f"{r['ttft'] * 1e3:>9.1f} {r['total'] * 1e3:>9.1f}"
            )
    on, off = results[True][0], results[False][0]
    on_next = statistics.median(r["ttft"] for r in on[1:])
    off_next = statistics.median(r["ttft"] for r in off[1:])
    print(
        f"\nreuse on : first {on[0]['ttft'] * 1e3:.1f} ms, following (median) {on_next * 1e3:.1f} ms "
        f"-> {on[0]['ttft'] / on_next:.1f}x faster"
    )
    print(
        f"reuse off: first {off[0]['ttft'] * 1e3:.1f} ms, following (median) {off_next * 1e3:.1f} ms "
        f"-> {off[0]['ttft'] / off_next:.1f}x"
    )
    print(f"following requests, off / on: {off_next / on_next:.1f}x")
    print(f"\n{args.concurrency} clients at once (one generation at a time on the server):")
    for reuse in (True, False):
        rs, wall = results[reuse][1], results[reuse][2]
        ttfts = sorted(r["ttft"] * 1e3 for r in rs)
        print(
            f"  reuse {'on ' if reuse else 'off'}: TTFT min {ttfts[0]:.1f} / median {statistics.median(ttfts):.1f} "
            f"/ max {ttfts[-1]:.1f} ms, all {len(rs)} done in {wall * 1e3:.1f} ms, "
            f"cached {[r['cached'] for r in rs]}"
        )


if __name__ == "__main__":
    main()
