"""The sidecar: what sharing one prefix cache between processes saves. Run by hand (never a test)::

    python -m benchmarks.bench_sidecar                         # all parts
    python -m benchmarks.bench_sidecar --parts ttft,memory     # a subset: ranks, ttft, memory, write, calls

1. ``ranks``: two CPU ranks under torchrun, without and with one sidecar, against one process:
   evalrun (lm-eval, ``split=docs``: lm-eval's document striding, so both ranks meet every task's
   few-shot preamble) and batchrun (``--routing round-robin``: both ranks meet every document).
   Prompt tokens computed and wall time (torchrun start-up included). "wait": with
   ``RADIXKV_SIDECAR_WAIT_S=10``, a rank that misses a prefix the other rank is computing right
   now waits for it instead of computing it too.
2. ``ttft``: replica B's first request on a 2,000-token document that replica A computed:
   through the sidecar (B's own pool is empty), against a local hit in B's device pool, a local
   host-tier hit, and computing the document. A and B are two stores with two sidecar connections
   in this process: B's read is the same socket round trip and shared-memory copy as across
   processes. Sides interleaved, medians.
3. ``memory``: four processes sharing one 2,000-token system prompt, one after another: four
   private host tiers (the prompt demoted into each) against no host tier and one sidecar.
   Measured: the resident bytes of each host pool's mappings (/proc/self/smaps), against the
   shared pool's resident pages over all five processes (Pss_Shmem: each page counted once), in
   copies of the prompt's KV. Each process also holds the prompt in its own (device) pool,
   either way.
4. ``write``: the cost of write-through: generate() of a 2,000-token miss with a local store vs
   one with a sidecar (the copy to the sidecar is queued), and the background write's duration.
5. ``calls``: one look-up's round trip (``SidecarTier.call``, a 2,000-token prompt, a miss and
   a hit of the whole document pinned then released), ``--calls`` times: median, p99, max
   (what ``RADIXKV_SIDECAR_TIMEOUT_S``, 10 s by default, is measured against).

Model: benchmarks/bench_hf.py's random Llama (hidden 512, 8 layers, 4 KV heads, fp32: 16 KiB of
KV per token) for parts 2-3; demo's builtin (Llama 512x6) for part 1, as bench_eval/bench_batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def start_sidecar(path: Path, host_bytes: str = "2G") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.sidecar", "--socket", str(path), "--host-bytes", host_bytes,
         "--log-level", "WARNING"], env=env, cwd=ROOT,
    )  # fmt: skip
    while not path.exists():
        if proc.poll() is not None:
            raise SystemExit("the sidecar did not start")
        time.sleep(0.05)
    return proc


def sidecar_stats(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "radixkv.sidecar", "stats", "--socket", str(path)],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    return json.loads(out.stdout)


# -- 1. ranks -------------------------------------------------------------------------------------
def _run(cmd: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(res.stdout[-2000:] + res.stderr[-3000:])
    return seconds, res.stdout


def _sides(work: Path, launch, env: dict, parse) -> None:
    sides = (("one process", 1, None), ("2 ranks", 2, None), ("2 ranks + sidecar", 2, "0"),
             ("2 ranks + sidecar, wait", 2, "10"))  # fmt: skip
    for name, nproc, wait in sides:
        side_env = dict(env)
        proc = None
        if wait is not None:
            path = work / f"s{time.monotonic_ns()}.sock"
            proc = start_sidecar(path)
            side_env.update(RADIXKV_SIDECAR=str(path), RADIXKV_SIDECAR_WAIT_S=wait)
        try:
            seconds, stdout = _run(launch(nproc, re.sub(r"\W+", "_", name)), side_env)
        finally:
            if proc is not None:
                stats = sidecar_stats(path)
                proc.kill()
                proc.wait()
        prompt, computed = parse(stdout)
        extra = f", sidecar hit tokens {stats['hit_tokens']}, waits {stats['waits']}" if proc else ""
        print(
            f"   {name:<24} prompt tokens {prompt:7d}, computed {computed:7d}, wall {seconds:6.1f} s{extra}",
            flush=True,
        )


def part_ranks(args) -> None:
    from benchmarks.bench_eval import MC_SHAPE, save_models
    from tests.eval_tasks import offline_env, write_tasks

    work = Path(tempfile.mkdtemp(prefix="bench_sidecar_"))
    model_dir = save_models(work / "models", ["builtin"])["builtin"]
    tasks_dir = work / "tasks"
    tasks = [
        write_tasks(tasks_dir, f"subject{i}", questions=args.rank_questions, seed=10 + i, **MC_SHAPE)[0]
        for i in range(4)
    ]
    env = {**offline_env(work), "OMP_NUM_THREADS": "1"}
    figure = re.compile(r"^\|(rank \d+|all ranks)\s*\|\s*(\d+)\|\s*(\d+)\|\s*(\d+)\|", re.M)

    def eval_cmd(nproc: int, name: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "-m", "evalrun", "--model", "radixkv",
                "--model_args", f"pretrained={model_dir},dtype=float32,split=docs",
                "--tasks", ",".join(tasks), "--include_path", str(tasks_dir), "--batch_size", "8", "--device", "cpu"]  # fmt: skip

    def eval_figures(stdout: str) -> tuple[int, int]:
        rows = {m[1]: (int(m[2]), int(m[4])) for m in figure.finditer(stdout)}
        return rows.get("all ranks") or rows["rank 0"]

    if not args.skip_eval:
        _eval_part(work, eval_cmd, env, eval_figures, args)
    _batch_part(work, args)


def _eval_part(work, eval_cmd, env, eval_figures, args) -> None:
    print(f"\n1a. evalrun split=docs, 4 MMLU-shape tasks x {args.rank_questions} questions x 4 choices, "
          "Llama 512x6 (demo builtin), 1 thread a rank", flush=True)  # fmt: skip
    _sides(work, eval_cmd, env, eval_figures)


def _batch_part(work: Path, args) -> None:
    from demo.model.loading import build_builtin

    rng = random.Random(7)
    docs = [[rng.randrange(300, 750) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    with open(work / "requests.jsonl", "w") as f:
        for i in range(args.prompts):
            prompt = docs[rng.randrange(args.docs)] + [
                rng.randrange(300, 750) for _ in range(rng.randrange(15, 30))
            ]
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            f.write(
                json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
                + "\n"
            )
    small, tokenizer = build_builtin("builtin")
    small.save_pretrained(work / "batch_model")
    tokenizer.save_pretrained(work / "batch_model")

    def batch_cmd(nproc: int, name: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "-m", "batchrun", "--model", str(work / "batch_model"), "--input", str(work / "requests.jsonl"),
                "--output", str(work / f"{name}.jsonl"), "--routing", "round-robin", "--cpu", "--no-progress",
                "--max-batch-size", "4"]  # fmt: skip

    def batch_figures(stdout: str) -> tuple[int, int]:
        m = re.search(r"job:.*prompt tokens (\d+), computed (\d+), hit rate", stdout)
        return int(m[1]), int(m[2])

    print(f"\n1b. batchrun --routing round-robin, {args.prompts} completions over {args.docs} documents of "
          f"{args.doc_tokens} tokens (+ a 15-29-token question, 4 new tokens), batches of 4", flush=True)  # fmt: skip
    _sides(work, batch_cmd, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, batch_figures)


# -- 2. ttft --------------------------------------------------------------------------------------
def part_ttft(args) -> None:
    import torch

    import hf_patch
    from benchmarks.bench_hf import build_model, document, ids, timed, ttft
    from hf_patch import RadixCache

    model = build_model()
    work = Path(tempfile.mkdtemp(prefix="bench_sidecar_"))
    path = work / "s.sock"
    proc = start_sidecar(path)
    rng = random.Random(3)
    n = args.ttft_tokens
    budget = dict(block_size=16, budget_tokens=4 * n)
    local = hf_patch.build_store(model, **budget)
    host = hf_patch.build_store(model, **budget, host_cache_tokens=4 * n)
    a = hf_patch.build_store(model, **budget, sidecar=path)
    timed(model, ids(document(rng, 32)))  # warm-up
    times: dict[str, list[float]] = {
        k: [] for k in ("compute", "local hit", "local host-tier hit", "sidecar hit")
    }
    cached: dict[str, list[int]] = {k: [] for k in times}
    try:
        for r in range(args.rounds):
            doc = document(rng, n)
            # The document computed once in every store that serves it (replica A through the sidecar).
            for store in (local, host, a):
                model.generate(
                    ids(doc + document(rng, 16)), past_key_values=RadixCache(store), max_new_tokens=1
                )
            assert a.remote.flush(60)
            with host._lock:  # every unpinned device block demoted: the document now lives on the host tier
                host._make_room_locked(0, host.pool.num_blocks)
            b = hf_patch.build_store(model, **budget, sidecar=path)  # replica B: nothing of its own yet
            sides = {
                "compute": lambda: RadixCache(hf_patch.build_store(model, **budget)),
                "local hit": lambda: RadixCache(local),
                "local host-tier hit": lambda: RadixCache(host),
                "sidecar hit": lambda b=b: RadixCache(b),
            }
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            question = document(rng, 16)
            for name in order:
                cache = sides[name]()
                times[name].append(ttft(timed(model, ids(doc + question), past_key_values=cache)))
                cached[name].append(cache.cached_tokens[0])
            b.remote.close()
    finally:
        proc.kill()
        proc.wait()
    print(f"\n2. TTFT, a {n}-token document + a 16-token question, 1 new token, Llama 512x8 fp32 "
          f"({local.pool.bytes_per_token} bytes of KV a token), torch threads {torch.get_num_threads()}, "
          f"{args.rounds} rounds", flush=True)  # fmt: skip
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, value in med.items():
        print(f"   {name:<20} median {value * 1e3:8.1f} ms, cached {statistics.median(cached[name]):6.0f} tokens; "
              f"compute/this {med['compute'] / value:5.1f}x, this/local host hit {value / med['local host-tier hit']:4.2f}x")  # fmt: skip


# -- 4. write-through cost ------------------------------------------------------------------------
def part_write(args) -> None:
    """A miss computed and committed: generate() wall time with a local store vs one with a
    sidecar (write-through queued), and how long the background write then takes."""
    import hf_patch
    from benchmarks.bench_hf import build_model, document, ids
    from hf_patch import RadixCache

    model = build_model()
    work = Path(tempfile.mkdtemp(prefix="bench_sidecar_"))
    path = work / "s.sock"
    proc = start_sidecar(path)
    n = args.ttft_tokens
    rng = random.Random(9)
    budget = dict(block_size=16, budget_tokens=(args.rounds + 2) * (n + 32))
    sides = {"local store": hf_patch.build_store(model, **budget),
             "store + sidecar": hf_patch.build_store(model, **budget, sidecar=path)}  # fmt: skip
    model.generate(ids(document(rng, 32)), max_new_tokens=1)
    walls: dict[str, list[float]] = {k: [] for k in sides}
    flushes: list[float] = []
    try:
        for r in range(args.rounds):
            prompt = ids(document(rng, n))
            for name in sides if r % 2 == 0 else reversed(list(sides)):
                store = sides[name]
                t0 = time.perf_counter()
                model.generate(prompt, past_key_values=RadixCache(store), max_new_tokens=1, do_sample=False)
                walls[name].append(time.perf_counter() - t0)
                if store.remote is not None:
                    t0 = time.perf_counter()
                    assert store.remote.flush(60)
                    flushes.append(time.perf_counter() - t0)
    finally:
        proc.kill()
        proc.wait()
    base = statistics.median(walls["local store"])
    print(f"\n4. write-through: a {n}-token miss computed and committed, {args.rounds} rounds", flush=True)
    for name, values in walls.items():
        print(
            f"   {name:<16} generate() median {statistics.median(values) * 1e3:8.1f} ms ({statistics.median(values) / base:4.2f}x)"
        )
    print(f"   background write to the sidecar after it: median {statistics.median(flushes) * 1e3:.1f} ms "
          f"({n // 16} blocks of 16 tokens, {n * 16 / 1024:.0f} MiB)", flush=True)  # fmt: skip


# -- 5. call round trips ---------------------------------------------------------------------------
def part_calls(args) -> None:
    """A look-up's round trip to a live sidecar: a miss, and a hit whose lease is released."""
    import hf_patch
    from benchmarks.bench_hf import build_model, document, ids
    from hf_patch.keys.weights import model_scope
    from hf_patch.stores import sidecar_namer
    from radixkv import pack_tokens

    model = build_model()
    work = Path(tempfile.mkdtemp(prefix="bench_sidecar_"))
    path = work / "s.sock"
    proc = start_sidecar(path)
    rng = random.Random(5)
    n = args.ttft_tokens
    try:
        store = hf_patch.build_store(model, block_size=16, budget_tokens=4 * n, sidecar=path)
        tier = store.remote
        ident, ns = sidecar_namer(model, store.pool)((model_scope(model), None))
        key = {"ident": ident.hex(), "ns": ns.decode(), "have": 0}
        cached = document(rng, n)
        model.generate(
            ids(cached), past_key_values=hf_patch.RadixCache(store), max_new_tokens=1, do_sample=False
        )
        assert tier.flush(60)
        bodies = {"miss": bytes(pack_tokens(document(rng, n))), "hit": bytes(pack_tokens(cached))}
        times: dict[str, list[float]] = {k: [] for k in bodies}
        for _ in range(args.calls):
            for name, body in bodies.items():
                t0 = time.perf_counter()
                answer, _, generation = tier.call({"op": "match", **key}, body)
                times[name].append(time.perf_counter() - t0)
                if answer["lease"]:
                    tier.tell({"op": "release", "lease": answer["lease"]}, generation)
        assert answer["num_tokens"] > 0, "the hit side missed"
        stats = tier.stats()
    finally:
        proc.kill()
        proc.wait()
    print(
        f"\n5. a look-up's round trip to the sidecar, {n}-token prompt, {args.calls} calls each", flush=True
    )
    for name, values in times.items():
        q = statistics.quantiles(values, n=100)
        print(f"   {name:<5} median {statistics.median(values) * 1e3:7.3f} ms, p99 {q[98] * 1e3:7.3f} ms, "
              f"max {max(values) * 1e3:7.1f} ms")  # fmt: skip
    print(f"   timeouts {stats['sidecar_timeouts']} (timeout_s {tier.timeout_s:g} s)", flush=True)


# -- 3. memory ------------------------------------------------------------------------------------
WORKER = r"""
import sys, time, random, torch
sys.path.insert(0, {root!r})
import hf_patch
from benchmarks.bench_hf import build_model, document, ids
torch.set_num_threads(1)
model = build_model()
rng = random.Random(11)
prompt = document(rng, {n})
kw = dict(block_size=16, budget_tokens={device})
store = hf_patch.build_store(model, **kw, sidecar={sidecar!r}) if {sidecar!r} else hf_patch.build_store(model, **kw, host_cache_tokens={host})
cache = hf_patch.RadixCache(store)
model.generate(ids(prompt + document(random.Random({i}), 16)), past_key_values=cache, max_new_tokens=1)
if store.remote is not None:
    store.remote.flush(60)
if store.host_pool is not None:
    with store._lock:
        store._make_room_locked(0, store.pool.num_blocks)

def resident(tensors):
    # Bytes of the tensors' pages resident in memory (mincore over each tensor's own range).
    import ctypes, mmap
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = 0
    for t in tensors:
        start = t.data_ptr() // page * page
        length = t.data_ptr() + t.numel() * t.element_size() - start
        pages = -(-length // page)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        total += sum(v & 1 for v in vec) * page
    return total

host = resident([*store.host_pool.k, *store.host_pool.v]) if store.host_pool is not None else 0
print("ready", cache.cached_tokens[0], host, flush=True)
time.sleep(3600)
"""


def shmem_pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss_Shmem:"))


def part_memory(args) -> None:
    n = args.memory_tokens
    work = Path(tempfile.mkdtemp(prefix="bench_sidecar_"))
    copy = n * 16 * 1024
    print(f"\n3. four processes sharing one {n}-token system prompt (Llama 512x8 fp32, 16 KiB a token: "
          f"{copy / 2**20:.1f} MiB of KV), started one after another", flush=True)  # fmt: skip
    for side in ("private host tiers", "one sidecar"):
        sidecar_proc = None
        sock = ""
        if side == "one sidecar":
            sock = str(work / "s.sock")
            sidecar_proc = start_sidecar(Path(sock))
        workers = []
        try:
            for i in range(4):
                code = WORKER.format(root=str(ROOT), n=n, device=n + 512, host=n + 512, sidecar=sock, i=i)
                p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
                line = p.stdout.readline().split()
                if not line or line[0] != "ready":
                    raise SystemExit(f"worker {i} failed")
                workers.append((p, int(line[1]), int(line[2])))
            cached = [c for _, c, _ in workers]
            if sidecar_proc is None:
                host = [h for *_, h in workers]
                print(f"   {side:<19} host-tier memory resident per process {[round(h / 2**20, 1) for h in host]} MiB, "
                      f"total {sum(host) / 2**20:.1f} MiB = {sum(host) / copy:.2f} copies; cached {cached}", flush=True)  # fmt: skip
            else:
                pids = [sidecar_proc.pid] + [p.pid for p, *_ in workers]
                shared = sum(shmem_pss(pid) for pid in pids)
                stats = sidecar_stats(Path(sock))
                print(f"   {side:<19} shared pool resident (Pss_Shmem over all 5 processes) {shared / 2**20:.1f} MiB "
                      f"= {shared / copy:.2f} copies (sidecar used_bytes {stats['used_bytes'] / 2**20:.1f} MiB); "
                      f"cached {cached}", flush=True)  # fmt: skip
        finally:
            for p, *_ in workers:
                p.kill()
                p.wait()
            if sidecar_proc is not None:
                sidecar_proc.kill()
                sidecar_proc.wait()
    print(
        "   (each process also holds the prompt in its own device pool either way: on a GPU, GPU memory)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="ranks,ttft,memory,write")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ttft-tokens", type=int, default=2000)
    parser.add_argument("--memory-tokens", type=int, default=2000)
    parser.add_argument("--skip-eval", action="store_true", help="part ranks: batchrun only")
    parser.add_argument("--rank-questions", type=int, default=32, help="per task, four tasks")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--doc-tokens", type=int, default=600)
    parser.add_argument("--calls", type=int, default=1000, help="part calls: look-ups per side")
    args = parser.parse_args()
    print(f"load {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    parts = args.parts.split(",")
    if "ttft" in parts:
        part_ttft(args)
    if "memory" in parts:
        part_memory(args)
    if "write" in parts:
        part_write(args)
    if "ranks" in parts:
        part_ranks(args)
    if "calls" in parts:
        part_calls(args)
    print(f"load after {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
