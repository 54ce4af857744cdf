"""The client's view of a sidecar's shared memory: a ``BlockPool`` over the mapped pool.

The sidecar lays a pool out as ``radixkv.sidecar.layout`` says (no torch there); a client sends
its layout (``radixkv.persist.manifest.layout_of``, the JSON a cache file's manifest holds) in
its hello, maps the pool's file descriptor once and views it here, layer by layer exactly as a
local pool, so the same copy kernels move its blocks.
"""

from __future__ import annotations

import dataclasses

import torch

from radixkv.persist.manifest import layout_of
from radixkv.sidecar.layout import KVLayout, PoolGeometry
from radixkv.store.pool import BlockPool


def shared_pool_view(pool: BlockPool, buf, num_blocks: int) -> BlockPool:
    """A ``BlockPool`` over the sidecar's memory ``buf`` laid out as ``radixkv.sidecar.layout`` says."""
    geometry = PoolGeometry(KVLayout.from_json(layout_of(pool)), num_blocks)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=geometry.total_bytes)
    specs = [dataclasses.replace(s, device=torch.device("cpu")) for s in pool.layers]
    tensors = []
    for (offset, per_block), spec, which in zip(
        geometry.regions(), [s for s in specs for _ in (0, 1)], [0, 1] * len(specs)
    ):
        dim = spec.k_head_dim if which == 0 else spec.v_head_dim
        region = flat[offset : offset + per_block * num_blocks].view(spec.dtype)
        tensors.append(region.view(num_blocks, pool.block_size, spec.num_kv_heads, dim))
    return BlockPool(specs, num_blocks, pool.block_size, storage=(tensors[0::2], tensors[1::2]))
