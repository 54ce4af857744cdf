"""The demo's running batch over one cached document: copied prefixes vs prefixes read from the pool.

Issue 41's demo target: N concurrent requests over one 4,000-token document hold it once. A
RunningBatch (hf_patch.running_batch: the demo's step loop keeps its rows there) is driven
directly: CPU, fp32, random Llama (hidden 512, 8 heads / 4 KV heads of 64, 8 layers: 16 KiB of
KV per token, 62.5 MiB for the document), the document cached in the store before (block size
16, the pool preallocated and touched before the baseline: the cache's budget, not the rows').

- ``memory``: for N = 1, 8, 16, 32 rows (the document + a different 32-token question each,
  seated as the demo seats newcomers, then 16 greedy steps), each N and path in its own process
  (``RunningBatch(pooled=False)``: each row's slot holds a copy of the document, as before; the
  pool path: only its own columns), glibc told to mmap big blocks so that freed buffers leave
  the RSS: peak RSS and RSS after the last step (rows still running), above RSS before they
  were seated, in copies of the document's KV.
- ``engine`` (not run by default): the demo's engine itself (builtin model) with N requests
  over the cached document submitted at once (``--max-batch-tokens`` and
  ``--max-prefill-tokens`` set high and ``--prefill-chunk 0`` so that both paths seat them together,
  not sliced): RSS peak and when
  the most rows ran together.
- ``speed``: the decode step of 16 such rows (median interval over 32 steps after the first),
  both paths in one process, rounds interleaved (each path first in turn), medians; and the largest logit difference
  between the paths at every step (the pool path sums as the copy does: 0 expected).

    python -m benchmarks.bench_step_pool                     # both parts
    python -m benchmarks.bench_step_pool --parts speed --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import hf_patch
from benchmarks.bench_shared_prefix import PeakRss, build_model, rss, tokens
from hf_patch import RadixCache
from hf_patch.running_batch import RunningBatch, prefill_keys

DOC, QUESTION, NEW = 4000, 32, 16
DOC_BYTES = DOC * 8 * 2 * 4 * 64 * 4  # tokens x layers x (K, V) x KV heads x head size x fp32
COUNTS = (1, 8, 16, 32)
PATHS = ("copy", "pool")


def warm_store(model, doc: list[int]):
    """A store holding the document, its pool touched (room for 32 rows' commits too)."""
    store = hf_patch.build_store(model, block_size=16, budget_tokens=8192)
    for t in (*store.pool.k, *store.pool.v):
        t.zero_()
    with torch.no_grad():
        model.generate(torch.tensor([doc]), past_key_values=RadixCache(store=store), max_new_tokens=1)
    return store


def seat(model, store, rows: int, pooled: bool, seed: int) -> tuple[RunningBatch, list[int]]:
    batch = RunningBatch(model, store, pad_id=0, eos=(), pooled=pooled)
    prompts = [doc_tokens() + tokens(QUESTION, seed + i) for i in range(rows)]
    keys = prefill_keys(model, RadixCache(store=store), rows)
    _, cached = batch.seat(prompts, keys)
    assert cached == [DOC // 16 * 16] * rows, cached
    return batch, cached


def doc_tokens() -> list[int]:
    return tokens(DOC, 1)


def decode(batch: RunningBatch, steps: int, times: list[float] | None = None) -> list[torch.Tensor]:
    """``steps`` greedy steps; returns each step's logits (``times``: when each step ended)."""
    seen = []
    for _ in range(steps):
        logits = batch.step()
        seen.append(logits)
        batch.set_next(logits.argmax(dim=-1).tolist())
        if times is not None:
            times.append(time.perf_counter())
    return seen


def memory_child(rows: int, path: str) -> dict:
    """One measurement in this (fresh) process; returns copies of the document's KV."""
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    model = build_model()
    store = warm_store(model, doc_tokens())
    probe, _ = seat(model, store, 1, path == "pool", 10)  # the once-per-model probes, before the baseline
    decode(probe, 1)
    probe.clear()
    before = rss()
    t0 = time.perf_counter()
    with PeakRss() as peak:
        batch, _ = seat(model, store, rows, path == "pool", 100)
        decode(batch, NEW)
        after = rss()
    seconds = time.perf_counter() - t0
    out = {
        "peak": round((peak.peak - before) / DOC_BYTES, 2),
        "after": round((after - before) / DOC_BYTES, 2),
        "kv_columns": batch.kv_width,
        "seconds": round(seconds, 2),
    }
    batch.clear()
    return out


def engine_child(rows: int, path: str) -> dict:
    """The demo's engine (builtin model: 6 layers, 4 KV heads of 64, 12 KiB of KV a token, 46.9
    MiB for the document; its vocabulary 754 tokens) in this fresh process: ``rows`` requests over the cached document
    submitted at once, each 48 new tokens; RSS sampled every 5 ms until all are answered."""
    os.environ["RADIXKV_STEP_POOL"] = "1" if path == "pool" else "0"
    from demo.api.app import build_engine
    from demo.config import Config
    from demo.engine.engine import Params

    torch.set_grad_enabled(False)
    config = Config(
        model="builtin", cache_tokens=8192, max_batch_size=32, max_batch_tokens=1 << 20,
        max_prefill_tokens=4096, max_queue=64, prefill_chunk=0,
    )  # fmt: skip
    engine = build_engine(config)
    for t in (*engine.store.pool.k, *engine.store.pool.v):
        t.zero_()  # the cache's budget, not the rows'
    doc_bytes = DOC * 6 * 2 * 4 * 64 * 4
    doc = [3 + t % 700 for t in tokens(DOC, 1)]
    params = Params(48, temperature=0.0)
    engine.submit(doc, Params(1, temperature=0.0)).collect()  # the document cached
    engine.submit(doc + [5, 6, 7], Params(2, temperature=0.0)).collect()  # (probes, compiling)
    before = rss()
    gens = [
        engine.submit(doc + [3 + t % 700 for t in tokens(QUESTION, 100 + i)], params) for i in range(rows)
    ]
    peak, together, both = before, 0, 0
    while not all(g.finished.is_set() for g in gens):
        now, running = rss(), len(engine.loop.batch.rows)
        peak = max(peak, now)
        if running > together:
            together, both = running, now
        time.sleep(0.005)
    results = [g.collect() for g in gens]
    assert all(r.cached_tokens >= DOC // 16 * 16 for r in results), [r.cached_tokens for r in results]
    engine.shutdown(0.5)
    return {
        "peak": round((peak - before) / doc_bytes, 2),
        "together": together,
        "at_most_rows": round((both - before) / doc_bytes, 2),
    }


def child_runs(spec: str, rounds: int) -> list[dict]:
    """``rounds`` runs of ``--child spec``, each in a fresh process (its RSS its own): their JSON."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    cmd = [sys.executable, "-m", "benchmarks.bench_step_pool", "--child", spec]
    runs = []
    for _ in range(rounds):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return runs


def engine_part(rounds: int) -> None:
    print(
        f"engine: the demo's engine (builtin model), N requests over the cached {DOC}-token document "
        f"submitted at once: RSS above the RSS before, in copies of the document's KV, peak / when "
        f"the most rows ran together (how many), median of {rounds}"
    )
    for rows in COUNTS:
        line = [f"  {rows:3d} requests"]
        for path in PATHS:
            runs = child_runs(f"engine:{rows}:{path}", rounds)
            peak = statistics.median(r["peak"] for r in runs)
            held = statistics.median(r["at_most_rows"] for r in runs)
            line.append(f"{path} {peak:6.2f} / {held:6.2f} ({runs[0]['together']} rows)")
        print("   ".join(line), flush=True)


def memory(rounds: int) -> None:
    print(
        f"memory: RSS above the RSS before the rows were seated, in copies of the document's KV "
        f"({DOC} tokens, {DOC_BYTES / 2**20:.1f} MiB), peak / after {NEW} steps, median of {rounds}"
    )
    for rows in COUNTS:
        line = [f"  {rows:3d} rows"]
        for path in PATHS:
            runs = child_runs(f"{rows}:{path}", rounds)
            peak = statistics.median(r["peak"] for r in runs)
            after = statistics.median(r["after"] for r in runs)
            line.append(f"{path} {peak:6.2f} / {after:6.2f} ({runs[0]['kv_columns']} KV columns)")
        print("   ".join(line), flush=True)


def speed(rounds: int) -> None:
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    model = build_model()
    store = warm_store(model, doc_tokens())
    steps: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(rounds):
        for k, path in enumerate(PATHS if r % 2 == 0 else PATHS[::-1]):  # (each first in turn)
            # new questions each time: only the document is cached
            batch, _ = seat(model, store, 16, path == "pool", 5000 + 100 * r + 50 * k)
            times: list[float] = []
            decode(batch, 34, times)
            steps[path].append(statistics.median(b - a for a, b in zip(times[1:], times[2:])))
            batch.clear()
    print(
        f"decode: 16 rows over the cached document, 8 layers, median step of 32 (medians of {rounds}), 1 thread"
    )
    for path, ts in steps.items():
        m = statistics.median(ts)
        print(f"  {path:5s} {m * 1e3:7.1f} ms/step   {16 / m:7.1f} tokens/s")
    # the same 16 questions on both paths, each over a store holding the document only
    seen = {}
    for path in PATHS:
        batch, _ = seat(model, warm_store(model, doc_tokens()), 16, path == "pool", 9000)
        seen[path] = decode(batch, 16)
        batch.clear()
    gap = max((a - b).abs().max().item() for a, b in zip(seen["copy"], seen["pool"]))
    same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(seen["copy"], seen["pool"]))
    print(f"  largest logit difference pool vs copy over 16 steps: {gap:.3g}; tokens equal: {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="memory,speed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        parts = args.child.split(":")
        if parts[0] == "engine":
            print(json.dumps(engine_child(int(parts[1]), parts[2])))
        else:
            print(json.dumps(memory_child(int(parts[0]), parts[1])))
        return
    parts = args.parts.split(",")
    if "memory" in parts:
        memory(args.rounds)
    if "speed" in parts:
        speed(args.rounds)
    if "engine" in parts:
        engine_part(args.rounds)


if __name__ == "__main__":
    main()
