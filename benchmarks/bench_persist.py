"""The cache on disk: warm-restart time to first token, save/restore throughput, checksums.

Run by hand (CPU, fp32, bench_hf's random Llama: hidden 512, 8 layers, 4 KV heads: 16 KiB of
KV per token):

    python -m benchmarks.bench_persist                        # all three parts
    python -m benchmarks.bench_persist --parts throughput --sizes 256,2048 --rounds 5

1. restart: a 2,000-token document + 30-token questions (bench_hf's QA shape). The first
   request after a "restart" (a new store) with the saved file restored vs without it,
   interleaved. Restoring happens at start-up, before the first request; its time is
   printed too, and the total (restore + first answer) against the cold first answer.
2. throughput: for each size (MiB of KV), save and restore of a store holding that much, in
   MB/s, against ``cp`` + fsync (for the save) and ``cp`` (for the restore) of the same file,
   in the same run, interleaved per round; medians. Rounds alternate a restore into a new store
   with zeros written into a new store's pool and ``cp`` to a new file at the same point: the
   cost of touching new memory, which a restore into a new store pays too (``cp`` over its old
   copy reuses the pages it frees). ``cp`` overwrites its copy of the round
   before, as a save replaces its file. A restore goes into a new store (as at start-up: its
   pool's pages are first touched by the restore, and on the test VM memory freed a while ago
   is slow to touch again) and into a flushed store (pages touched before); the file is read
   back from the page cache, as ``cp`` reads it. Then where the time went
   (radixkv.persist.file_io.IoTimes: steps on two threads overlap).
3. hashes: the checksum candidates over 256 MiB in memory, in GB/s, on this machine.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

import hf_patch
from benchmarks.bench_hf import build_model, document, ids, timed, ttft
from hf_patch import RadixCache
from hf_patch.keys.weights import model_scope
from hf_patch.model_spec import layer_specs
from radixkv.persist.cache_file import read_manifest


def new_store(model, tokens: int):
    return hf_patch.build_store(model, block_size=16, budget_tokens=tokens)


def part_restart(model, args, directory: str) -> None:
    rng = random.Random(0)
    doc = document(rng, 2000)
    questions = [[rng.randrange(100, 32000) for _ in range(30)] for _ in range(args.rounds + 1)]
    path = os.path.join(directory, "restart.safetensors")
    store = new_store(model, 8192)
    timed(model, ids(doc + questions[0]), past_key_values=RadixCache(store=store))
    saved = hf_patch.save_cache(model, path, store)
    cold, warm, restore = [], [], []
    for q in questions[1:]:
        fresh = new_store(model, 8192)
        cold.append(ttft(timed(model, ids(doc + q), past_key_values=RadixCache(store=fresh))))
        started = time.perf_counter()
        restored = new_store(model, 8192)
        hf_patch.restore_cache(model, path, restored)
        restore.append(time.perf_counter() - started)
        cache = RadixCache(store=restored)
        warm.append(ttft(timed(model, ids(doc + q), past_key_values=cache)))
        assert cache.cached_tokens == [len(doc) // 16 * 16], cache.cached_tokens
    c, w, r = (statistics.median(x) for x in (cold, warm, restore))
    print(f"\n1. warm restart: 2,000-token document + 30-token question, median of {args.rounds} rounds")
    print(f"   file: {saved.num_tokens} tokens, {saved.file_bytes / 2**20:.1f} MiB")
    print(f"   first request without the file (cold)     TTFT {c * 1e3:8.1f} ms")
    print(f"   first request after restoring the file    TTFT {w * 1e3:8.1f} ms   -> {c / w:5.1f}x faster")
    print(f"   restore at start-up (read, check, insert)      {r * 1e3:8.1f} ms")
    print(
        f"   restore + first request                        {(r + w) * 1e3:8.1f} ms   -> {c / (r + w):5.1f}x faster"
    )


def _fill(model, store, tokens: int) -> None:
    """Commit random KV for ``tokens`` tokens (in 1,024-token prompts) under the model's namespace."""
    namespace = (model_scope(model), None)
    specs = store.pool.layers
    g = torch.Generator().manual_seed(0)
    for _ in range(0, tokens, 1024):
        seq = torch.randint(100, 32000, (1024,), generator=g).tolist()
        ks = [torch.randn(1, s.num_kv_heads, 1024, s.k_head_dim, generator=g) for s in specs]
        vs = [torch.randn(1, s.num_kv_heads, 1024, s.v_head_dim, generator=g) for s in specs]
        store.commit(seq, ks, vs, namespace=namespace)


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _cp(src: str, dst: str, sync: bool) -> None:
    # dst exists from the round before: cp truncates it, freeing its pages, as a save's rename
    # frees the old file's
    subprocess.run(["cp", src, dst], check=True)
    if sync:
        fd = os.open(dst, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _split(times, fields: tuple[str, ...]) -> str:
    return ", ".join(f"{f} {statistics.median(getattr(t, f) for t in times):.3f}" for f in fields)


def part_throughput(model, args, directory: str) -> None:
    for mib in (int(x) for x in args.sizes.split(",")):
        _throughput(model, args, directory, mib)


def _throughput(model, args, directory: str, mib: int) -> None:
    per_token = sum(spec.bytes_per_token for spec in layer_specs(model))
    tokens = (mib << 20) // per_token // 1024 * 1024
    store = new_store(model, tokens)
    _fill(model, store, tokens)
    path = os.path.join(directory, "big.safetensors")
    copy = os.path.join(directory, "copy.safetensors")
    hf_patch.save_cache(model, path, store)  # warm-up (and the page cache)
    warm = new_store(model, tokens)  # restored into, flushed, restored into again: its pages touched
    hf_patch.restore_cache(model, path, warm)
    save, restore, cp, cp_sync, save_times, restore_times, again, touch, cp_new = ([] for _ in range(9))
    for i in range(2 * args.rounds):  # wall-clock times of the whole calls (the model's identity included)
        if i % 2 == 0:
            started = time.perf_counter()
            result = hf_patch.save_cache(model, path, store)
            save.append(time.perf_counter() - started)
            save_times.append(result.times)
        cp_sync.append(_timed(lambda: _cp(path, copy, sync=True)))
        if i % 2:  # at the same point of a round as a restore into a new store: cp to a new file
            cp_new.append(_timed(lambda: _cp(path, copy + ".new", sync=False)))
            os.unlink(copy + ".new")
        target = new_store(model, tokens)
        if i % 2 == 0:
            started = time.perf_counter()
            restored = hf_patch.restore_cache(model, path, target)
            restore.append(time.perf_counter() - started)
            assert restored.restored_tokens == tokens and restored.dropped_tokens == 0
            restore_times.append(restored.times)
        else:  # at the same point of a round: what merely touching the new pool's pages costs
            touch.append(_timed(lambda p=target.pool: [t.fill_(0) for t in p.k + p.v]))
        del target
        cp.append(_timed(lambda: _cp(path, copy, sync=False)))
        warm.flush()
        again.append(_timed(lambda: hf_patch.restore_cache(model, path, warm)))
    size = os.path.getsize(path)
    manifest = read_manifest(path)
    kv = manifest["counts"]["tokens"] * store.pool.bytes_per_token
    mb = size / 1e6
    s, r, c, cs, w, f, cn = (statistics.median(x) for x in (save, restore, cp, cp_sync, again, touch, cp_new))
    print(
        f"\n2. throughput: {mib} MiB of KV ({manifest['counts']['tokens']} tokens), median of {args.rounds} rounds"
    )
    print(
        f"   file {size / 2**20:.1f} MiB, overhead {100 * (size - kv) / kv:.3f}%, checksum {manifest['checksum']}"
    )
    print(f"   cp + fsync         {mb / cs:8.0f} MB/s")
    print(f"   save (with fsync)  {mb / s:8.0f} MB/s   = {cs / s:4.2f}x cp + fsync")
    print(f"   cp                 {mb / c:8.0f} MB/s")
    print(f"   restore            {mb / r:8.0f} MB/s   = {c / r:4.2f}x cp   (into a new store)")
    print(f"   cp to a new file   {mb / cn:8.0f} MB/s   restore into a new store = {cn / r:4.2f}x it")
    print(f"   zeros into a new store's pool (its first touch alone) {mb / f:6.0f} MB/s = {c / f:4.2f}x cp")
    print(
        f"   restore            {mb / w:8.0f} MB/s   = {c / w:4.2f}x cp   (into a flushed store: pages touched before)"
    )
    print(f"   save, seconds:    total {s:.3f}; {_split(save_times, ('gather', 'hash', 'write', 'fsync'))}")
    print(f"   restore, seconds: total {r:.3f}; {_split(restore_times, ('read', 'hash', 'copy'))}")
    for name in (path, copy):
        os.unlink(name)
    del store


def part_hashes(args) -> None:
    import concurrent.futures
    import hashlib

    import blake3

    data = torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy()
    chunk = 4 << 20
    pool = concurrent.futures.ThreadPoolExecutor(os.cpu_count())

    def sha256_chunks() -> None:
        list(pool.map(lambda at: hashlib.sha256(data[at : at + chunk]).digest(), range(0, len(data), chunk)))

    candidates = {
        "sha256, one thread": lambda: hashlib.sha256(data).digest(),
        f"sha256 of 4 MiB chunks, {os.cpu_count()} threads": sha256_chunks,
        "blake3, one thread": lambda: blake3.blake3(data).digest(),
        "blake3, max_threads=AUTO": lambda: blake3.blake3(data, max_threads=blake3.blake3.AUTO).digest(),
    }
    try:
        import xxhash  # not a dependency: measured where installed, for scale (not cryptographic)

        candidates["xxh3_128 (non-cryptographic), one thread"] = lambda: xxhash.xxh3_128(data).digest()
    except ImportError:
        pass
    print(f"\n3. checksums over 256 MiB in memory, best of {args.rounds}")
    for name, fn in candidates.items():
        best = min(_timed(fn) for _ in range(args.rounds))
        print(f"   {name:44s} {len(data) / best / 1e9:6.2f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="restart,throughput,hashes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="256,2048", help="MiB of KV for the throughput part")
    parser.add_argument("--dir", default=None, help="where the files go (default: a temporary directory)")
    # One thread: on a busy 2-core machine a second intra-op thread spin-waits and makes the
    # short warm prefill ~5x slower and noisy (see tests/hf_models.py one_torch_thread).
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model()
    print(f"torch threads: {torch.get_num_threads()}; machine: {os.cpu_count()} cores")
    directory = args.dir or tempfile.mkdtemp(prefix="bench_persist.")
    try:
        parts = args.parts.split(",")
        with torch.no_grad():
            if "restart" in parts:
                part_restart(model, args, directory)
            if "throughput" in parts:
                part_throughput(model, args, directory)
            if "hashes" in parts:
                part_hashes(args)
    finally:
        if args.dir is None:
            shutil.rmtree(directory)


if __name__ == "__main__":
    main()
