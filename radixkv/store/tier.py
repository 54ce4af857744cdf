"""Tiers of KV memory: the device pool and, behind it, a host pool of the same block layout.

A ``Tier`` is what the store composes per level: a ``BlockPool`` plus the tree's LRU order
of that level's eviction candidates (``RadixTree`` keeps one order per tier, indexed by
``Node.tier``, because pins and matches move nodes in and out of it on every request). The
tree only records which tier a node's blocks live in; every byte moved between tiers goes
through the functions below, so the copies are in one place.

Host memory is page-locked (``pin_memory``) only when some device layer is on CUDA, where it
makes device<->host copies asynchronous DMA; on a CPU-only machine it is plain memory and
the same code runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import cuda_ext
from radixkv.store.pool import BlockPool
from radixkv.tree.node import DEVICE, HOST

__all__ = [
    "DEVICE",
    "HOST",
    "Tier",
    "check_mirror",
    "copy_blocks",
    "gather_into",
    "host_pool_for",
    "read_split_rows",
    "scatter_into",
]


@dataclasses.dataclass(frozen=True)
class Tier:
    """One level of KV memory: ``pool`` holds the blocks of the tree's nodes with ``tier == index``."""

    index: int  # DEVICE or HOST: the value of Node.tier for nodes whose blocks are in ``pool``
    pool: BlockPool

    @property
    def name(self) -> str:
        return "host" if self.index == HOST else "device"


def host_pool_for(
    device_pool: BlockPool,
    *,
    tokens: int | None = None,
    bytes: int | None = None,  # noqa: A002
) -> BlockPool:
    """A CPU pool mirroring ``device_pool``'s layers and block size, sized by tokens or bytes.

    Page-locked when any device layer is on CUDA. Raises ValueError as ``BlockPool.from_budget``.
    """
    layers = [dataclasses.replace(spec, device=torch.device("cpu")) for spec in device_pool.layers]
    pin = any(spec.device.type == "cuda" for spec in device_pool.layers)
    return BlockPool.from_budget(layers, device_pool.block_size, tokens=tokens, bytes=bytes, pin_memory=pin)


def check_mirror(pool: BlockPool, host_pool: BlockPool) -> None:
    """Raise ValueError unless ``host_pool`` has ``pool``'s block size and layer shapes."""
    if host_pool.block_size != pool.block_size:
        raise ValueError(f"host pool block size {host_pool.block_size} != device pool's {pool.block_size}")
    shape = [(s.num_kv_heads, s.k_head_dim, s.v_head_dim, s.dtype) for s in pool.layers]
    if [(s.num_kv_heads, s.k_head_dim, s.v_head_dim, s.dtype) for s in host_pool.layers] != shape:
        raise ValueError("host pool layers differ from the device pool's (heads, head dims or dtype)")


def _id_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` runs where both id lists count up by one together."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for j in range(1, len(src) + 1):
        if j == len(src) or src[j] != src[j - 1] + 1 or dst[j] != dst[j - 1] + 1:
            runs.append((src[start], dst[start], j - start))
            start = j
    return runs


def copy_blocks(src: BlockPool, src_ids: Sequence[int], dst: BlockPool, dst_ids: Sequence[int]) -> int:
    """Copy whole blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` of ``dst`` (every layer).

    The pools share layer shapes and block size (a host mirror of a device pool). One slice
    copy per run of ids consecutive in both lists (pools hand out ascending runs), so a
    demoted node usually moves in one copy per layer. Synchronous: when it returns ``dst``
    holds the data and the source blocks may be reused. Returns the bytes moved.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"copy_blocks: {len(src_ids)} source ids for {len(dst_ids)} destination ids")
    runs = _id_runs(list(src_ids), list(dst_ids))
    if len(runs) * MIN_MEAN_RUN_BLOCKS > len(src_ids):
        _copy_scattered(src, src_ids, dst, dst_ids)
        return len(src_ids) * src.block_size * src.bytes_per_token
    cross = False
    for s_pool, d_pool in zip((*src.k, *src.v), (*dst.k, *dst.v)):
        cross |= s_pool.device != d_pool.device
        for s, d, n in runs:
            d_pool[d : d + n].copy_(s_pool[s : s + n], non_blocking=d_pool.is_pinned())
    if cross and torch.cuda.is_available():
        torch.cuda.synchronize()  # async copies into pinned memory: done before anyone reads
    return len(src_ids) * src.block_size * src.bytes_per_token


# Below this mean run length (blocks) one index_select + index_copy_ per layer beats a Python
# loop of slice copies (benchmarks/bench_numba.py: 64 scattered blocks x 8 layers, 10.2 ms as
# slices, 4.0 ms indexed).
MIN_MEAN_RUN_BLOCKS = 4


def _copy_scattered(src: BlockPool, src_ids: Sequence[int], dst: BlockPool, dst_ids: Sequence[int]) -> None:
    s_idx, d_idx = torch.tensor(list(src_ids)), torch.tensor(list(dst_ids))
    for s_pool, d_pool in zip((*src.k, *src.v), (*dst.k, *dst.v)):
        picked = s_pool.index_select(0, s_idx.to(s_pool.device)).to(d_pool.device)  # synchronous
        d_pool.index_copy_(0, d_idx.to(d_pool.device), picked)


def gather_into(
    pool: BlockPool,
    block_ids: torch.Tensor,
    num_tokens: int,
    k_out: Sequence[torch.Tensor],
    v_out: Sequence[torch.Tensor],
) -> None:
    """``pool.gather`` for outputs that may sit on another device than the pool (host -> GPU).

    block_ids: ``[B, nb]`` int64 on CPU; ``k_out[l]``/``v_out[l]``: ``[B, H, num_tokens, D]``
    views. Outputs on the pool's device take the fused gather; others get the blocks
    picked on the pool's device and copied across in one ``copy_`` per layer.
    """
    same = [i for i, spec in enumerate(pool.layers) if k_out[i].device == spec.device]
    if len(same) == len(pool.layers):
        pool.gather(block_ids, num_tokens, k_out, v_out)
        return
    for i in range(len(pool.layers)):
        if i in same:
            cuda_ext.paged_gather([pool.k[i]], [pool.v[i]], block_ids, num_tokens, [k_out[i]], [v_out[i]])
        else:
            _gather_staged(pool.k[i], block_ids, num_tokens, k_out[i])
            _gather_staged(pool.v[i], block_ids, num_tokens, v_out[i])


def _gather_staged(pool: torch.Tensor, block_ids: torch.Tensor, num_tokens: int, out: torch.Tensor) -> None:
    """out[b, h, t] = pool[ids[b, t // bs], t % bs, h] with ``out`` on any device (one staging copy)."""
    batch, nb = block_ids.shape
    picked = pool[block_ids.to(pool.device)]  # [B, nb, bs, H, D] on the pool's device
    picked = picked.reshape(batch, nb * pool.shape[1], pool.shape[2], pool.shape[3])[:, :num_tokens]
    # ``picked`` is a pageable temporary: a synchronous copy, so nothing can overwrite what is
    # still to be read once the caller's lease is released. (Page-locked memory speeds up the
    # demotions, device -> host; reads staging through pinned buffers is left to a GPU session.)
    out.copy_(picked.transpose(1, 2))


def scatter_into(
    pool: BlockPool, block_ids: torch.Tensor, k_src: Sequence[torch.Tensor], v_src: Sequence[torch.Tensor]
) -> None:
    """``pool.scatter`` for sources that may sit on another device than the pool (GPU -> host)."""
    if all(k.device == spec.device for k, spec in zip(k_src, pool.layers)):
        pool.scatter(block_ids, k_src, v_src)
        return
    pool.scatter(
        block_ids,
        [k.to(spec.device) for k, spec in zip(k_src, pool.layers)],
        [v.to(spec.device) for v, spec in zip(v_src, pool.layers)],
    )


def read_split_rows(
    device_pool: BlockPool,
    host_pool: BlockPool | None,
    rows: Sequence[tuple[Sequence[int], int]],
    num_tokens: int,
    k_out: Sequence[torch.Tensor],
    v_out: Sequence[torch.Tensor],
) -> int:
    """Copy the first ``num_tokens`` tokens of rows whose blocks end on the host; returns host tokens.

    ``rows[i]``: (block ids, how many of the last ones are host ids) for output row i of
    ``k_out[l]``/``v_out[l]`` ``[len(rows), H, num_tokens, D]``. Per row, the device part comes
    from ``device_pool`` and the rest straight from ``host_pool`` into the same buffers: one
    copy of each byte, no device blocks needed (no promotion, see docs/design.md).
    """
    bs = device_pool.block_size
    host_tokens = 0
    for i, (ids, num_host) in enumerate(rows):
        ids = list(ids)
        on_device = min(num_tokens, (len(ids) - num_host) * bs)  # whole blocks
        if on_device:
            device_pool.gather(
                torch.tensor([ids[: -(-on_device // bs)]], dtype=torch.int64),
                on_device,
                [k[i : i + 1, :, :on_device] for k in k_out],
                [v[i : i + 1, :, :on_device] for v in v_out],
            )
        rest = num_tokens - on_device
        if rest:
            first = on_device // bs
            gather_into(
                host_pool,
                torch.tensor([ids[first : first + -(-rest // bs)]], dtype=torch.int64),
                rest,
                [k[i : i + 1, :, on_device:num_tokens] for k in k_out],
                [v[i : i + 1, :, on_device:num_tokens] for v in v_out],
            )
            host_tokens += rest
    return host_tokens
