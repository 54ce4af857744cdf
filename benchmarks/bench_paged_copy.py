"""Fused paged gather / scatter vs the per-layer torch path vs a plain copy of the same bytes.

    python benchmarks/bench_paged_copy.py                 # cuda if available, else cpu
    python benchmarks/bench_paged_copy.py --device cpu --iters 3

Model shape: 32 layers, 8 KV heads, head dim 128, bf16, block size 16; prefixes of 2,048
and 64 tokens in shuffled blocks of a pool (CPU block ids, the sync-free path). GB/s counts
the K+V payload once (each byte is read once and written once). "fused" is the CUDA kernel,
"per-layer" the reference path through the same op (RADIXKV_FORCE_REFERENCE), "plain copy"
is ``dst.copy_(src)`` of one contiguous buffer of the payload's size. GPU timings use CUDA
events after a warmup; targets there: fused >= 80% of plain copy, >= 2x the per-layer path.
"""

from __future__ import annotations

import argparse
import time

import torch

import cuda_ext

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Mean seconds per call of ``fn``."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    start_s = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start_s) / iters


def with_reference(fn):
    def run():
        cuda_ext.set_force_reference(True)
        try:
            fn()
        finally:
            cuda_ext.set_force_reference(None)

    return run


def bench(args, device: torch.device, tokens: int) -> list[tuple]:
    dtype = DTYPES[args.dtype]
    layers, heads, dim, bs = args.layers, args.heads, args.head_dim, args.block_size
    needed = -(-tokens // bs)
    num_blocks = needed * (4 if device.type == "cuda" else 2)
    pools = [
        torch.full((num_blocks, bs, heads, dim), 1.5, dtype=dtype, device=device) for _ in range(2 * layers)
    ]
    k_pools, v_pools = pools[:layers], pools[layers:]
    ids = torch.randperm(num_blocks)[:needed].view(1, needed)  # shuffled blocks, on the CPU
    caches = [torch.full((1, heads, tokens, dim), 2.5, dtype=dtype, device=device) for _ in range(2 * layers)]
    k_cache, v_cache = caches[:layers], caches[layers:]
    payload = 2 * layers * tokens * heads * dim * dtype.itemsize
    src = torch.ones(payload // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)

    def gather():
        cuda_ext.paged_gather(k_pools, v_pools, ids, tokens, k_cache, v_cache)

    def scatter():
        cuda_ext.paged_scatter(k_cache, v_cache, ids, k_pools, v_pools)

    kernel = cuda_ext.backend_for(device) == "cuda-kernel"
    iters = args.iters or (200 if device.type == "cuda" else 3)
    warmup = 10 if device.type == "cuda" else 1
    plain = timed(lambda: dst.copy_(src), device, iters, warmup)
    rows = []
    for name, fn in (("gather", gather), ("scatter", scatter)):
        fused = timed(fn, device, iters, warmup) if kernel else None
        per_layer = timed(with_reference(fn), device, iters, warmup)
        rows.append((tokens, name, payload, fused, per_layer, plain))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 64])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=0, help="0: 200 on cuda, 3 on cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    backend = cuda_ext.backend_for(device)
    print(f"device: {name} | backend: {backend} | {args.layers} layers x {args.heads} kv heads x "
          f"head dim {args.head_dim}, {args.dtype}, block size {args.block_size}")  # fmt: skip
    if backend != "cuda-kernel":
        print("note: the fused kernel needs a CUDA GPU (and nvcc); its columns show n/a")

    def gbs(nbytes, seconds):
        return f"{nbytes / seconds / 1e9:10.1f}" if seconds else f"{'n/a':>10}"

    header = f"{'tokens':>6} {'op':<8} {'MB':>7} {'fused GB/s':>10} {'layer GB/s':>10} {'copy GB/s':>10}"
    print(header + f" {'fused/plain':>11} {'fused vs per-layer':>18} {'fused us':>9} {'per-layer us':>12}")
    for tokens in args.tokens:
        for tok, op, payload, fused, per_layer, plain in bench(args, device, tokens):
            ratio = f"{plain / fused:11.0%}" if fused else f"{'n/a':>11}"
            speedup = f"{per_layer / fused:17.1f}x" if fused else f"{'n/a':>18}"
            fused_us = f"{fused * 1e6:9.1f}" if fused else f"{'n/a':>9}"
            print(f"{tok:>6} {op:<8} {payload / 1e6:7.1f} {gbs(payload, fused)} {gbs(payload, per_layer)} "
                  f"{gbs(payload, plain)} {ratio} {speedup} {fused_us} {per_layer * 1e6:12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
