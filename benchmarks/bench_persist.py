"""The cache on disk: warm-restart time to first token, save/restore throughput, file overhead.

Run by hand (CPU, fp32, bench_hf's random Llama: hidden 512, 8 layers, 4 KV heads):

    python -m benchmarks.bench_persist                    # both parts
    python -m benchmarks.bench_persist --parts restart    # or: throughput

1. restart: a 2,000-token document + 30-token questions (bench_hf's QA shape). The first
   request after a "restart" (a new store) with the saved file restored vs without it,
   interleaved. Restoring happens at start-up, before the first request; its time is
   printed too, and the total (restore + first answer) against the cold first answer.
2. throughput: save and restore of a store holding ``--tokens`` tokens of KV, in MB/s,
   against ``cp`` (and ``cp`` + fsync) of the same file in the same run; the file's size
   against the KV bytes it holds. The file is read back from the page cache in both cases.
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
    subprocess.run(["cp", src, dst], check=True)
    if sync:
        fd = os.open(dst, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def part_throughput(model, args, directory: str) -> None:
    store = new_store(model, args.tokens)
    _fill(model, store, args.tokens)
    path = os.path.join(directory, "big.safetensors")
    copy = os.path.join(directory, "copy.safetensors")
    hf_patch.save_cache(model, path, store)  # warm-up (and the page cache)
    save, restore, cp, cp_sync = [], [], [], []
    for _ in range(args.rounds):
        save.append(_timed(lambda: hf_patch.save_cache(model, path, store)))
        target = new_store(model, args.tokens)
        restore.append(_timed(lambda t=target: hf_patch.restore_cache(model, path, t)))
        cp.append(_timed(lambda: _cp(path, copy, sync=False)))
        cp_sync.append(_timed(lambda: _cp(path, copy, sync=True)))
        del target
    size = os.path.getsize(path)
    manifest = read_manifest(path)
    kv = manifest["counts"]["tokens"] * store.pool.bytes_per_token
    mb = size / 1e6
    s, r, c, cs = (statistics.median(x) for x in (save, restore, cp, cp_sync))
    print(f"\n2. throughput: {manifest['counts']['tokens']} tokens, median of {args.rounds} rounds")
    print(
        f"   file {size / 2**20:.1f} MiB for {kv / 2**20:.1f} MiB of KV: overhead {100 * (size - kv) / kv:.3f}%"
    )
    print(f"   cp                 {mb / c:8.0f} MB/s")
    print(f"   cp + fsync         {mb / cs:8.0f} MB/s")
    print(f"   save (with fsync)  {mb / s:8.0f} MB/s   = {c / s:4.2f}x cp, {cs / s:4.2f}x cp+fsync")
    print(f"   restore            {mb / r:8.0f} MB/s   = {c / r:4.2f}x cp")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="restart,throughput")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16384, help="KV tokens in the throughput file")
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
    finally:
        if args.dir is None:
            shutil.rmtree(directory)


if __name__ == "__main__":
    main()
