"""Decode attention over each row's own columns of a left-padded KV batch, on the CPU (numba).

    out = ragged_decode(query, key, value, starts, end, scale)

``query`` ``[B, Hq, D]`` (one token per row), ``key`` / ``value`` ``[B, Hkv, W, D]`` /
``[B, Hkv, W, Dv]`` float32 CPU tensors (views of bigger buffers are fine), ``Hq`` a multiple
of ``Hkv`` (grouped-query heads share a KV head); row b attends to columns
``starts[b]:end`` only (``0 <= starts[b] < end <= W``). Returns ``[B, Hq, Dv]``: softmax(q k^T
* scale) v over those columns, as SDPA with a mask hiding the others computes it (sums in
another order: ~1e-6 apart).

Why: an SDPA call reads every row's W columns, padding included; on a CPU a decode step's
attention is bound by those reads, so for a batch of many short rows beside a long one most of
its time is spent reading padding. This kernel reads ``sum(end - starts)`` columns, its
(row, KV head) pairs spread over torch's intra-op thread count (numba's threading layer: OpenMP
here; one call at a time, under a lock, without the GIL). numba compiles it on first use
(~1-3 s; cached on disk where numba finds a writable directory, else per process). Like any OpenMP code, not
for a process that forks and computes in the child (the project never does).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

__all__ = ["available", "ragged_decode"]

try:  # optional (the demo extra); without it callers keep SDPA
    import numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None

logger = logging.getLogger(__name__)

_kernel = None
# one call at a time: numba's fallback threading layer (workqueue, where no OpenMP or TBB is
# found) aborts the process on concurrent parallel calls
_lock = threading.Lock()


def available() -> bool:
    """Whether numba is installed (the kernel can be compiled)."""
    return numba is not None


def _compile():
    """The compiled kernel, cached on disk where numba finds a writable place (next to this file,
    else the user's cache directory); compiled for this process only where it finds none."""
    try:
        return _jit(True)
    except RuntimeError as e:  # "cannot cache function ...: no locator available"
        logger.info("ragged_decode: compiling without numba's disk cache: %s", e)
        return _jit(False)


def _jit(cache: bool):
    # reassoc/contract let LLVM vectorise the dot products; no nnan/ninf assumptions
    @numba.njit(parallel=True, fastmath={"reassoc", "contract"}, cache=cache, nogil=True)
    def decode(q, k, v, starts, end, scale, out):  # pragma: no cover - compiled
        batch, heads, dim = q.shape
        kv_heads = k.shape[1]
        rep = heads // kv_heads
        dv = v.shape[3]
        # one job per (row, KV head): its rep query heads share each column read
        for job in numba.prange(batch * kv_heads):
            b = job // kv_heads
            g = job % kv_heads
            start = starts[b]
            n = end - start
            qs = np.empty((rep, dim), dtype=np.float32)
            for r in range(rep):
                for d in range(dim):
                    qs[r, d] = q[b, g * rep + r, d] * scale
            scores = np.empty((rep, n), dtype=np.float32)
            for c in range(n):
                kc = k[b, g, start + c]
                for r in range(rep):
                    s = np.float32(0.0)
                    for d in range(dim):
                        s += qs[r, d] * kc[d]
                    scores[r, c] = s
            for r in range(rep):
                best = scores[r].max()
                total = np.float32(0.0)
                for c in range(n):
                    e = np.exp(scores[r, c] - best)
                    scores[r, c] = e
                    total += e
                for c in range(n):
                    scores[r, c] /= total
            acc = np.zeros((rep, dv), dtype=np.float32)
            for c in range(n):
                vc = v[b, g, start + c]
                for r in range(rep):
                    p = scores[r, c]
                    for d in range(dv):
                        acc[r, d] += p * vc[d]
            for r in range(rep):
                for d in range(dv):
                    out[b, g * rep + r, d] = acc[r, d]

    return decode


def _whole(t: torch.Tensor) -> torch.Tensor:
    """``t``, or when it is the first W columns of a C-contiguous ``[B, H, capacity, D]``
    buffer (an AppendLayer's view), that buffer: numba's loops run ~1.7x faster over contiguous
    arrays. Only columns the caller names are read either way."""
    if t.is_contiguous():
        return t
    b, h, _, d = t.shape
    stride = t.stride()
    if stride[3] != 1 or stride[2] != d or stride[1] % d or stride[0] != h * stride[1]:
        return t
    capacity = stride[1] // d
    if t.storage_offset() + b * h * capacity * d > t.untyped_storage().nbytes() // t.element_size():
        return t
    return t.as_strided((b, h, capacity, d), (h * capacity * d, capacity * d, d, 1))


def ragged_decode(query, key, value, starts, end: int, scale: float) -> torch.Tensor:
    """See the module. Raises RuntimeError without numba, ValueError for shapes, dtypes,
    devices or columns it does not take."""
    global _kernel
    if numba is None:
        raise RuntimeError("ragged_decode needs numba: pip install numba")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.device.type != "cpu" or t.dtype != torch.float32:
            raise ValueError(f"ragged_decode: {name} must be float32 on the CPU, got {t.dtype} on {t.device}")
    if query.dim() != 3 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"ragged_decode: query [B, Hq, D], key and value [B, Hkv, W, D]; got {list(query.shape)}, "
            f"{list(key.shape)}, {list(value.shape)}"
        )
    batch, heads, dim = query.shape
    if (
        key.shape[0] != batch
        or value.shape[:3] != key.shape[:3]
        or key.shape[3] != dim
        or heads % key.shape[1]
    ):
        raise ValueError(
            f"ragged_decode: query {list(query.shape)} does not fit key {list(key.shape)} / value "
            f"{list(value.shape)} (same rows, Hq a multiple of Hkv, the same head size for q and k)"
        )
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    if starts.shape != (batch,):
        raise ValueError(f"ragged_decode: {starts.shape[0] if starts.ndim else 0} starts for {batch} rows")
    if not 0 < end <= key.shape[2] or (batch and (starts.min() < 0 or starts.max() >= end)):
        raise ValueError(
            f"ragged_decode: columns starts[b]:{end} must be non-empty within the KV's {key.shape[2]}"
        )
    out = torch.empty((batch, heads, value.shape[3]), dtype=torch.float32)
    with _lock:
        if _kernel is None:
            _kernel = _compile()
        # as many threads as torch's intra-op pool (the demo's --threads), at most numba's
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        _kernel(
            query.contiguous().numpy(),
            _whole(key).numpy(),
            _whole(value).numpy(),
            starts,
            int(end),
            np.float32(scale),
            out.numpy(),
        )
    return out
