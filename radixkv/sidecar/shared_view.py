"""The client's view of a sidecar's shared memory: a ``BlockPool`` over the mapped pool.

The sidecar lays a pool out as ``radixkv.sidecar.layout`` says (no torch there); a client sends
its layout (``layout_json``) in its hello, maps the pool's file descriptor once and views it
here, layer by layer exactly as a local pool, so the same copy kernels move its blocks.
"""

from __future__ import annotations

import dataclasses

import torch

from radixkv.sidecar.layout import KVLayout, PoolGeometry
from radixkv.store.pool import BlockPool


def layout_json(pool: BlockPool) -> dict:
    """The KV layout of ``pool`` as a hello sends it (block size; per layer heads, dims, dtype)."""
    return {
        "block_size": pool.block_size,
        "layers": [
            {
                "num_kv_heads": s.num_kv_heads,
                "k_head_dim": s.k_head_dim,
                "v_head_dim": s.v_head_dim,
                "dtype": str(s.dtype).removeprefix("torch."),
            }
            for s in pool.layers
        ],
    }


def shared_pool_view(pool: BlockPool, buf, num_blocks: int) -> BlockPool:
    """A ``BlockPool`` over the sidecar's memory ``buf`` laid out as ``radixkv.sidecar.layout`` says."""
    geometry = PoolGeometry(KVLayout.from_json(layout_json(pool)), num_blocks)
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
