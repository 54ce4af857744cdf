"""Decode attention over each row's own columns of a left-padded KV batch, on the CPU (numba).

    out = ragged_decode(query, key, value, starts, end, scale)
    out = ragged_packed(query, key, value, slots, starts, ends, scale)
    out = ragged_pooled(query, key, value, slots, starts, ends, pool_k, pool_v, tables, lengths, scale)

``ragged_decode``: ``query`` ``[B, Hq, D]`` (one token per row), ``key`` / ``value``
``[B, Hkv, W, D]`` / ``[B, Hkv, W, Dv]`` float32 CPU tensors (views of bigger buffers are
fine), ``Hq`` a multiple of ``Hkv`` (grouped-query heads share a KV head); row b attends to
columns ``starts[b]:end`` only (``0 <= starts[b] < end <= W``). Returns ``[B, Hq, Dv]``:
softmax(q k^T * scale) v over those columns, as SDPA with a mask hiding the others computes it
(sums in another order: ~1e-6 apart).

``ragged_packed``: N query tokens of any rows (a decode step's one token per row beside the
prompt tokens of rows joining the batch, hf_patch.running_batch): ``query`` ``[N, Hq, D]``,
token t attends to columns ``starts[t]:ends[t]`` of KV row ``slots[t]``. A token of a prompt
ends at its own column (causal); ``ragged_decode`` is the case ``slots = 0..B-1``, ``ends = end``.

``ragged_pooled``: ``ragged_packed`` where each KV row's first tokens (a cached prefix shared
by many rows) are read from a block pool in place through the row's block table, before its
own columns, in one softmax (the step loop's rows over one cached document hold it once:
hf_patch.running_batch).

Why: an SDPA call reads every row's W columns, padding included; on a CPU a decode step's
attention is bound by those reads, so for a batch of many short rows beside a long one most of
its time is spent reading padding; and a rectangular batch cannot hold one row's many prompt
tokens beside the others' one token. This kernel reads ``sum(ends - starts)`` columns, its
(token, KV head) pairs spread over torch's intra-op thread count (numba's threading layer: OpenMP
here; one call at a time, under a lock, without the GIL). numba compiles it on first use
(~1-3 s; cached on disk where numba finds a writable directory, else per process). Like any OpenMP code, not
for a process that forks and computes in the child (the project never does).
"""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

__all__ = ["available", "ragged_decode", "ragged_packed", "ragged_pooled"]

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
    def attend(
        q, k, v, slots, starts, ends, pk, pv, tables, lengths, scale, out
    ):  # pragma: no cover - compiled
        tokens, heads, dim = q.shape
        kv_heads = k.shape[1]
        rep = heads // kv_heads
        dv = v.shape[3]
        bs = pk.shape[1]
        # one job per (query token, KV head): its rep query heads share each column read
        for job in numba.prange(tokens * kv_heads):
            t = job // kv_heads
            g = job % kv_heads
            b = slots[t]
            start = starts[t]
            own = ends[t] - start
            p = lengths[b]  # the row's prefix tokens in the pool: columns 0..p-1 of its softmax
            n = p + own
            qs = np.empty((rep, dim), dtype=np.float32)
            for r in range(rep):
                for d in range(dim):
                    qs[r, d] = q[t, g * rep + r, d] * scale
            scores = np.empty((rep, n), dtype=np.float32)
            for j in range((p + bs - 1) // bs):  # the pool tokens, a block at a time
                block = tables[b, j]
                for o in range(min(bs, p - j * bs)):
                    kc = pk[block, o, g]
                    for r in range(rep):
                        s = np.float32(0.0)
                        for d in range(dim):
                            s += qs[r, d] * kc[d]
                        scores[r, j * bs + o] = s
            for c in range(own):
                kc = k[b, g, start + c]
                for r in range(rep):
                    s = np.float32(0.0)
                    for d in range(dim):
                        s += qs[r, d] * kc[d]
                    scores[r, p + c] = s
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
            for j in range((p + bs - 1) // bs):
                block = tables[b, j]
                for o in range(min(bs, p - j * bs)):
                    vc = pv[block, o, g]
                    for r in range(rep):
                        w = scores[r, j * bs + o]
                        for d in range(dv):
                            acc[r, d] += w * vc[d]
            for c in range(own):
                vc = v[b, g, start + c]
                for r in range(rep):
                    w = scores[r, p + c]
                    for d in range(dv):
                        acc[r, d] += w * vc[d]
            for r in range(rep):
                for d in range(dv):
                    out[t, g * rep + r, d] = acc[r, d]

    return attend


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
    batch = query.shape[0] if query.dim() == 3 else -1
    if key.dim() == 4 and key.shape[0] != batch:
        raise ValueError(
            f"ragged_decode: query {list(query.shape)} does not fit key {list(key.shape)} (other rows)"
        )
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    if starts.shape != (max(batch, 0),):
        raise ValueError(f"ragged_decode: {starts.shape[0] if starts.ndim else 0} starts for {batch} rows")
    if not 0 < end <= (key.shape[2] if key.dim() == 4 else 0):
        raise ValueError(
            f"ragged_decode: columns starts[b]:{end} must be non-empty within the KV's {list(key.shape)}"
        )
    slots = np.arange(len(starts), dtype=np.int64)
    return ragged_packed(
        query, key, value, slots, starts, np.full(len(starts), int(end), dtype=np.int64), scale
    )


def ragged_packed(query, key, value, slots, starts, ends, scale: float) -> torch.Tensor:
    """See the module. Raises RuntimeError without numba, ValueError for shapes, dtypes,
    devices, slots or columns it does not take."""
    return _run(query, key, value, slots, starts, ends, None, scale)


def ragged_pooled(
    query, key, value, slots, starts, ends, pool_k, pool_v, tables, lengths, scale: float
) -> torch.Tensor:
    """``ragged_packed`` where KV row b's first ``lengths[b]`` tokens lie in a block pool
    (``pool_k`` / ``pool_v`` ``[num_blocks, block_size, Hkv, D]`` / ``[.., Dv]`` float32 CPU,
    read in place) at blocks ``tables[b, :ceil(lengths[b] / block_size)]`` (``tables`` ``[B, M]``
    int64): token t attends to those tokens, then to columns ``starts[t]:ends[t]`` of row
    ``slots[t]``, one softmax over both. A row's pool tokens come before its columns in the
    softmax as its own columns would: the same sums in the same order as ``ragged_packed`` over
    a buffer holding the prefix in its columns. Raises as ``ragged_packed`` does, and for tables
    or lengths that name no pool block."""
    return _run(query, key, value, slots, starts, ends, (pool_k, pool_v, tables, lengths), scale)


def _check_pool(key, value, pool) -> tuple:
    """The pool arguments as the kernel takes them (views, never copies of the pool)."""
    pool_k, pool_v, tables, lengths = pool
    for name, t in (("pool_k", pool_k), ("pool_v", pool_v)):
        if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() != 4:
            raise ValueError(
                f"ragged attention: {name} must be a float32 CPU [blocks, block_size, Hkv, D] tensor"
            )
    if (
        pool_k.shape[:3] != pool_v.shape[:3]
        or pool_k.shape[2:] != (key.shape[1], key.shape[3])
        or pool_v.shape[3] != value.shape[3]
    ):
        raise ValueError(
            f"ragged attention: pool {list(pool_k.shape)} / {list(pool_v.shape)} does not fit key "
            f"{list(key.shape)} / value {list(value.shape)} (the same KV heads and head sizes)"
        )
    tables = np.ascontiguousarray(tables, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    rows = key.shape[0]
    if tables.ndim != 2 or tables.shape[0] != rows or lengths.shape != (rows,):
        raise ValueError(
            f"ragged attention: tables [{rows}, M] and lengths [{rows}] for the KV's {rows} rows"
        )
    bs = pool_k.shape[1]
    if lengths.min(initial=0) < 0 or lengths.max(initial=0) > tables.shape[1] * bs:
        raise ValueError(
            f"ragged attention: lengths must be within the tables' {tables.shape[1]} blocks of {bs}"
        )
    used = tables[np.arange(tables.shape[1]) < (-(-lengths // bs))[:, None]]  # the blocks read
    if used.size and (used.min() < 0 or used.max() >= pool_k.shape[0]):
        raise ValueError(f"ragged attention: a table names blocks outside the pool's {pool_k.shape[0]}")
    return pool_k.numpy(), pool_v.numpy(), tables, lengths


def _run(query, key, value, slots, starts, ends, pool, scale: float) -> torch.Tensor:
    global _kernel
    if numba is None:
        raise RuntimeError("ragged attention needs numba: pip install numba")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.device.type != "cpu" or t.dtype != torch.float32:
            raise ValueError(
                f"ragged attention: {name} must be float32 on the CPU, got {t.dtype} on {t.device}"
            )
    if query.dim() != 3 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"ragged attention: query [N, Hq, D], key and value [B, Hkv, W, D]; got {list(query.shape)}, "
            f"{list(key.shape)}, {list(value.shape)}"
        )
    tokens, heads, dim = query.shape
    if value.shape[:3] != key.shape[:3] or key.shape[3] != dim or heads % key.shape[1]:
        raise ValueError(
            f"ragged attention: query {list(query.shape)} does not fit key {list(key.shape)} / value "
            f"{list(value.shape)} (Hq a multiple of Hkv, the same head size for q and k)"
        )
    slots, starts, ends = (np.ascontiguousarray(a, dtype=np.int64) for a in (slots, starts, ends))
    if not slots.shape == starts.shape == ends.shape == (tokens,):
        raise ValueError(
            f"ragged attention: {len(slots)} slots, {len(starts)} starts and {len(ends)} ends for {tokens} query tokens"
        )
    if tokens and (slots.min() < 0 or slots.max() >= key.shape[0]):
        raise ValueError(f"ragged attention: slots must be rows of the KV's {key.shape[0]}")
    if tokens and (starts.min() < 0 or (ends <= starts).any() or ends.max() > key.shape[2]):
        raise ValueError(
            f"ragged attention: each token's columns starts:ends must be non-empty within the KV's {key.shape[2]}"
        )
    if pool is None:  # no row has pool tokens: an empty pool, every length 0
        rows, kv_heads = key.shape[0], key.shape[1]
        pk = np.empty((1, 1, kv_heads, dim), dtype=np.float32)
        pv = np.empty((1, 1, kv_heads, value.shape[3]), dtype=np.float32)
        tables, lengths = np.zeros((rows, 1), dtype=np.int64), np.zeros(rows, dtype=np.int64)
    else:
        pk, pv, tables, lengths = _check_pool(key, value, pool)
    out = torch.empty((tokens, heads, value.shape[3]), dtype=torch.float32)
    with _lock:
        if _kernel is None:
            _kernel = _compile()
        # as many threads as torch's intra-op pool (the demo's --threads), at most numba's
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        _kernel(
            query.contiguous().numpy(),
            _whole(key).numpy(),
            _whole(value).numpy(),
            slots,
            starts,
            ends,
            pk,
            pv,
            tables,
            lengths,
            np.float32(scale),
            out.numpy(),
        )
    return out
