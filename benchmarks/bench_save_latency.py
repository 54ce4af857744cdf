"""Request latency while periodic saves of a large cache run, against no saves.

Run by hand (CPU, the demo's built-in model, in process: the Flask app and its engine, the
demo's periodic save thread):

    python -m benchmarks.bench_save_latency                 # 2 GiB of KV, 120 requests a phase
    python -m benchmarks.bench_save_latency --mib 256 --requests 60

The store holds ``--mib`` MiB of random KV plus a real ~2,000-token table; one client sends
chat requests about the table one after another (4 new tokens each: the table is cached, the
question computed). Phases alternate: no saves; periodic saves back to back (``every`` =
0.2 s, the demo's periodic thread) as the demo runs them (SCHED_IDLE, at most 256 MB/s), and
without the rate cap at SCHED_IDLE, nice 10 and nice 0; twice each. Printed: p50 and p99 request latency of each kind of phase, counting in the
saving phases only the requests that overlapped a save, and the ratio of p99s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import demo.cache_files as cache_files
from benchmarks.bench_http import questions, table
from benchmarks.bench_persist import _fill
from demo.api.app import build_engine, create_app
from demo.config import Config
from hf_patch.model_spec import layer_specs


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=120, help="requests per phase")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kv.safetensors")
        engine = build_engine(Config(model="builtin", block_size=16, cache_tokens=1 << 14))
        tokens = (args.mib << 20) // sum(s.bytes_per_token for s in layer_specs(engine.model)) // 1024 * 1024
        config = Config(model="builtin", block_size=16, cache_tokens=tokens + 16384, cache_file=path)
        engine = build_engine(config)
        with torch.no_grad():
            _fill(engine.model, engine.store, tokens)
        client = create_app(config, engine).test_client()
        files = client.application.extensions["radixkv"]["cache_files"]
        saves: list[tuple[float, float]] = []
        save = files.save

        def timed_save(*a, **k):
            started = time.monotonic()
            try:
                return save(*a, **k)
            finally:
                saves.append((started, time.monotonic()))

        files.save = timed_save
        doc, qs = table(60), questions(args.requests)
        body = {"messages": [{"role": "user", "content": doc + qs[0]}], "max_tokens": 4, "temperature": 0}
        assert client.post("/v1/chat/completions", json=body).status_code == 200  # the table is cached

        def phase(how: tuple[str, float | None] | None) -> list[float]:
            saves.clear()
            if how is not None:
                cache_files.PERIODIC_SCHEDULING, cache_files.PERIODIC_RATE = how
                files.every = 0.2
                files._stop.clear()
                files.start_periodic()
                while not saves:  # from the first save on
                    time.sleep(0.05)
            spans = []
            for q in qs:
                started = time.monotonic()
                body["messages"][0]["content"] = doc + q
                r = client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.get_json()
                spans.append((started, time.monotonic()))
            if how is not None:
                files.stop()
                # only requests that overlapped a save
                spans = [s for s in spans if any(a < s[1] and s[0] < b for a, b in saves)]
            return [b - a for a, b in spans]

        kinds = {
            "no saves": None,
            "SCHED_IDLE, 256 MB/s": ("idle", 256e6),  # the demo's periodic saves
            "SCHED_IDLE, no cap": ("idle", None),
            "nice 10, no cap": ("nice", None),
            "nice 0, no cap": ("normal", None),
        }
        results: dict[str, list[float]] = {name: [] for name in kinds}
        save_seconds: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(2):
            for name, how in kinds.items():
                results[name] += phase(how)
                save_seconds[name] += [b - a for a, b in saves]
        size = os.path.getsize(path)
        print(f"cache {size / 2**20:.0f} MiB; {os.cpu_count()} cores")
        base = pct(results["no saves"], 0.99)
        for name, values in results.items():
            took = f"one save {statistics.median(save_seconds[name]):5.2f} s" if save_seconds[name] else ""
            print(
                f"   {name:21s} {len(values):4d} requests   p50 {pct(values, 0.5) * 1e3:6.1f} ms   "
                f"p99 {pct(values, 0.99) * 1e3:6.1f} ms   p99 / no saves {pct(values, 0.99) / base:5.2f}x   {took}"
            )


if __name__ == "__main__":
    main()
