"""SIGTERM with a large cache and a short deadline: time to exit, what was saved, the restart.

Run by hand (CPU, the demo's built-in model: 6 layers, 4 KV heads of 64, 12 KiB of KV per
token; real processes, the file on the same disk as the rest):

    python -m benchmarks.bench_shutdown                    # 2 GiB, --cache-save-timeout 10
    python -m benchmarks.bench_shutdown --mib 256 --timeout 5

A cache file of ``--mib`` MiB of random KV for the built-in model is written first (the
server's identity: same seeded weights). For each scenario the server starts on a copy of it
(restoring it all), answers one real request (a ~2,000-token table and a question: the most
recent prefix), and gets SIGTERM with ``--cache-save-timeout``:

- "first save at SIGTERM": no save has run in the process; the shutdown save measures the disk
  with a first save sized for 100 MB/s over a quarter of the time, then saves the rest;
- "after an admin save": ``POST /v1/cache/save`` ran before (its throughput sizes the shutdown
  save; periodic saves are paced, so they measure nothing).

Printed: start-up time (restore included), time from SIGTERM to exit, what the shutdown log
line says was saved and skipped, then the restarted server's start-up time and its first
request (the same table, another question): latency and cached_tokens, against a server
started without the file.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import tempfile
import time

import requests
import torch

import hf_patch
from benchmarks.bench_http import questions, table
from benchmarks.bench_persist import _fill
from demo.model.loading import build_builtin
from hf_patch.model_spec import layer_specs
from tests.demo_process import start_demo

SAVED = re.compile(
    r"saved (\d+) tokens \((\d+) nodes, ([\d.]+) MiB\) in ([\d.]+)s, skipped (\d+) less recently used tokens \((\d+) nodes\)"
)
RESTORED = re.compile(r"restored (\d+) cached tokens from \S+ in ([\d.]+)s")


def ask(url: str, content: str) -> tuple[float, int, int]:
    """(seconds, cached_tokens, prompt tokens) of a one-token chat request: its time to first token."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    usage = r.json()["usage"]
    return (
        time.perf_counter() - started,
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"],
    )


def start(args: list[str], log: str) -> tuple[object, str, float]:
    started = time.monotonic()
    proc, url = start_demo(args, log, timeout=600)
    return proc, url, time.monotonic() - started


def stop(proc) -> float:
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=600)
    assert code == 0, code
    return time.monotonic() - started


def make_file(path: str, mib: int) -> int:
    """A cache file of ``mib`` MiB of random KV for the built-in model; returns the pool tokens."""
    model, _ = build_builtin("builtin")
    per_token = sum(spec.bytes_per_token for spec in layer_specs(model))
    tokens = (mib << 20) // per_token // 1024 * 1024
    store = hf_patch.build_store(model, block_size=16, budget_tokens=tokens)
    with torch.no_grad():
        _fill(model, store, tokens)
    hf_patch.save_cache(model, path, store)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=2048, help="MiB of KV in the cache (default 2048)")
    parser.add_argument("--timeout", type=float, default=10.0, help="--cache-save-timeout (default 10)")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    parser.add_argument("--scenarios", default="first,admin", help="first, admin or both")
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="bench_shutdown.")
    original, path, log = (
        os.path.join(directory, n) for n in ("original.safetensors", "kv.safetensors", "log")
    )
    try:
        tokens = make_file(original, args.mib)
        size = os.path.getsize(original)
        common = ["--model", "builtin", "--port", "0", "--cache-tokens", str(tokens + 4096)]
        doc, (q1, q2) = table(60), questions(2)
        print(f"cache: {tokens} tokens of random KV + one real request, file {size / 2**20:.0f} MiB")
        print(f"--cache-save-timeout {args.timeout:g} s; {os.cpu_count()} cores")
        proc, url, _ = start(common, log)  # the baseline: the first request of a server without the file
        cold = ask(url, doc + q2)
        stop(proc)
        print(
            f"first request, server started without the file: {cold[0] * 1e3:.0f} ms, cached {cold[1]} of {cold[2]}"
        )
        scenarios = {
            "first": ("first save at SIGTERM", []),
            "admin": ("after an admin save", ["--admin-token", "adm"]),
        }
        for scenario, extra in (scenarios[name] for name in args.scenarios.split(",")):
            shutil.copyfile(original, path)
            os.truncate(log, 0)
            server = [*common, "--cache-file", path, "--cache-save-timeout", str(args.timeout), *extra]
            proc, url, boot = start(server, log)
            restored = RESTORED.search(open(log).read())
            if extra:  # an unpaced save before: its throughput is then known
                r = requests.post(
                    url + "/v1/cache/save", json={}, headers={"X-Admin-Token": "adm"}, timeout=600
                )
                assert r.status_code == 200, r.text
            ask(url, doc + q1)
            exit_seconds = stop(proc)
            text = open(log).read()
            saved = SAVED.search(text)
            steps = re.findall(r"shutdown save step: (.*)", text)
            os.truncate(log, 0)
            proc, url, reboot = start(server, log)
            again = RESTORED.search(open(log).read())
            first = ask(url, doc + q2)
            stop(proc)
            print(f"\n{scenario}:")
            print(f"   start-up, restoring {int(restored[1]) if restored else 0} tokens: {boot:.1f} s")
            print(f"   SIGTERM to exit: {exit_seconds:.2f} s (deadline {args.timeout:g} s)")
            for step in steps:
                print(f"   a save: {step}")
            if saved:
                print(
                    f"   saved {saved[1]} tokens ({saved[2]} nodes, {saved[3]} MiB) in {saved[4]} s; "
                    f"skipped {saved[5]} tokens ({saved[6]} nodes)"
                )
            else:
                print("   nothing saved: " + text.strip().splitlines()[-1])
            print(
                f"   restart: start-up {reboot:.1f} s (restored {int(again[1]) if again else 0} tokens in "
                f"{float(again[2]) if again else 0:.2f} s); first request {first[0] * 1e3:.0f} ms, "
                f"cached {first[1]} of {first[2]} tokens"
            )
    finally:
        if args.dir is None:
            shutil.rmtree(directory)


if __name__ == "__main__":
    main()
