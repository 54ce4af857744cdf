"""Argument checks shared by every implementation of the paged gather / scatter ops.

Two levels:

- :func:`check_layout` looks only at metadata (shapes, dtypes, devices, strides), so the fake
  (meta) implementation runs it too and ``torch.compile`` reports bad shapes at trace time.
- :func:`check_block_ids` reads the ids that the call will use. On CPU ids it costs one
  ``aminmax`` over ``B * ceil(num_tokens / block_size)`` values (plus a ``unique`` for
  scatter). Ids on a CUDA device are first copied to the host, which waits for the device:
  callers that care pass CPU ids (allowed for CUDA tensors too) and get no sync at all.

Every failure raises ``ValueError`` whose message starts with the op name and names the
argument at fault.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ID_DTYPES = (torch.int32, torch.int64)
_SMALL = 256  # ids checked in Python below this many (aminmax + unique cost ~40 us of dispatch)


def check_layout(
    op: str,
    k_pools: Sequence[torch.Tensor],
    v_pools: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_tokens: int,
    k_cache: Sequence[torch.Tensor],
    v_cache: Sequence[torch.Tensor],
    cache_names: tuple[str, str],
    cache_written: bool,
) -> None:
    """Checks that each pool ``[N, bs, H, D]`` and its cache ``[B, H, num_tokens, D]`` agree.

    Shared by every layer: ``N`` and ``bs`` (block ids index all of them) and the device.
    Per layer and per K/V: ``H``, ``D`` and the dtype (fp16/bf16/fp32/fp64; a cache has its
    pool's dtype). ``block_ids`` is ``[B, nb]`` int32/int64 on the pools' device or on the
    CPU, and ``0 <= num_tokens <= nb * bs``. Pools are contiguous; caches may have any
    strides, but a cache that is written (gather's outputs) must not be an expanded or
    otherwise self-overlapping view. O(number of layers), no data is read.
    """
    kc, vc = cache_names
    n = len(k_pools)
    if not len(v_pools) == len(k_cache) == len(v_cache) == n:
        raise ValueError(
            f"{op}: layer counts differ: k_pools={n}, v_pools={len(v_pools)}, "
            f"{kc}={len(k_cache)}, {vc}={len(v_cache)}"
        )
    if block_ids.dim() != 2:
        raise ValueError(
            f"{op}: block_ids must be a 2-D [batch, num_blocks] tensor, got {tuple(block_ids.shape)}"
        )
    if block_ids.dtype not in ID_DTYPES:
        raise ValueError(f"{op}: block_ids must be int32 or int64, got {block_ids.dtype}")
    if num_tokens < 0:
        raise ValueError(f"{op}: num_tokens must be >= 0, got {num_tokens}")
    if n == 0:
        return
    first = k_pools[0]
    if first.dim() != 4:
        raise ValueError(
            f"{op}: k_pools[0] must be [num_blocks, block_size, kv_heads, head_dim], got shape {tuple(first.shape)}"
        )
    num_blocks, block_size = first.shape[0], first.shape[1]
    device = first.device
    if block_ids.device != device and block_ids.device.type != "cpu":
        raise ValueError(
            f"{op}: block_ids is on {block_ids.device} but k_pools[0] is on {device} "
            "(ids must be on the pools' device or on the CPU)"
        )
    batch, cols = block_ids.shape
    if num_tokens > cols * block_size:
        raise ValueError(
            f"{op}: num_tokens={num_tokens} exceeds what block_ids holds "
            f"({cols} blocks x block_size {block_size} = {cols * block_size})"
        )
    kind = "written" if cache_written else "read"
    for pname, pools, cname, caches in (("k_pools", k_pools, kc, k_cache), ("v_pools", v_pools, vc, v_cache)):
        for i, (pool, cache) in enumerate(zip(pools, caches)):
            # Hot path (every layer, every call): cheap comparisons first, messages on failure.
            ps = pool.shape
            if len(ps) != 4 or ps[0] != num_blocks or ps[1] != block_size:
                raise ValueError(
                    f"{op}: {pname}[{i}] has shape {tuple(ps)}, expected [{num_blocks}, {block_size}, "
                    "kv_heads, head_dim] (num_blocks and block_size as in k_pools[0])"
                )
            if pool.dtype not in DTYPES:
                raise ValueError(
                    f"{op}: {pname}[{i}] dtype must be float16, bfloat16, float32 or float64, got {pool.dtype}"
                )
            if pool.device != device:
                raise ValueError(f"{op}: {pname}[{i}] is on {pool.device} but k_pools[0] is on {device}")
            if not pool.is_contiguous():
                raise ValueError(f"{op}: {pname}[{i}] must be contiguous")
            shape = (batch, ps[2], num_tokens, ps[3])
            if cache.shape != shape:
                raise ValueError(
                    f"{op}: {cname}[{i}] has shape {tuple(cache.shape)}, expected {shape} "
                    f"[batch, kv_heads, seq, head_dim] from {pname}[{i}] and block_ids"
                )
            if cache.dtype != pool.dtype:
                raise ValueError(f"{op}: {cname}[{i}] is {cache.dtype} but {pname}[{i}] is {pool.dtype}")
            if cache.device != device:
                raise ValueError(f"{op}: {cname}[{i}] is on {cache.device} but k_pools[0] is on {device}")
            if kind == "written" and not cache.is_contiguous():
                overlap = _self_overlap(cache.shape, cache.stride())
                if overlap:
                    raise ValueError(
                        f"{op}: {cname}[{i}] is {overlap} (strides {tuple(cache.stride())}); "
                        "outputs need distinct elements"
                    )


def _self_overlap(shape: Sequence[int], stride: Sequence[int]) -> str | None:
    """Why a view's elements may share memory (None when they cannot). O(dims log dims).

    Two tokens written to one address race on the GPU (the last writer wins at random), so a
    written view must be one-to-one. Sufficient test: with dims of size > 1 sorted by stride,
    each stride exceeds the farthest offset the smaller-stride dims reach. Any slice, permute
    or transpose of a plain tensor passes; an expanded (zero-stride) or ``as_strided`` view
    whose rows overlap does not.
    """
    dims = sorted((st, sz) for st, sz in zip(stride, shape) if sz > 1)
    reach = 0  # farthest element offset reachable through the dims seen so far
    for st, sz in dims:
        if st <= reach:
            return "an expanded view (zero stride)" if st == 0 else "a self-overlapping view"
        reach += (sz - 1) * st
    return None


def check_block_ids(
    op: str, block_ids: torch.Tensor, num_tokens: int, block_size: int, num_blocks: int, unique: bool
) -> None:
    """Checks the ids the call reads: ``block_ids[:, :ceil(num_tokens / block_size)]``.

    Each must lie in ``[0, num_blocks)``; with ``unique`` (scatter) no block may appear twice,
    since two tokens would race for one slot. Columns past the ones used are not read, so
    they may hold padding such as -1. Ids on a CUDA device cost one device->host copy (a sync).
    """
    if num_tokens == 0 or block_ids.shape[0] == 0:
        return
    used = block_ids[:, : -(-num_tokens // block_size)]
    if used.device.type != "cpu":
        used = used.cpu()
    if used.numel() <= _SMALL:  # a commit's few new blocks: Python over a list beats two ops
        flat = used.flatten().tolist()
        lo, hi = min(flat), max(flat)
        repeats = unique and len(set(flat)) != len(flat)
    else:
        lo, hi = (int(x) for x in torch.aminmax(used))
        repeats = None
    if lo < 0 or hi >= num_blocks:
        bad = ((used < 0) | (used >= num_blocks)).nonzero()[0].tolist()
        raise ValueError(
            f"{op}: block id {int(used[bad[0], bad[1]])} at block_ids[{bad[0]}, {bad[1]}] "
            f"is out of range [0, {num_blocks})"
        )
    if repeats is None and unique:
        repeats = torch.unique(used).numel() != used.numel()
    if unique and repeats:
        raise ValueError(f"{op}: block_ids repeats a block among the blocks written; each must be distinct")
