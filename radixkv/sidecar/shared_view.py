"""The client's view of a sidecar's shared memory: a ``BlockPool`` over the mapped pool, and a
``StatePool`` over its snapshot slots for a layout with states.

The sidecar lays a pool out as ``radixkv.sidecar.layout`` says (no torch there); a client sends
its layout (``radixkv.persist.manifest.layout_of``, the JSON a cache file's manifest holds) in
its hello, maps the pool's file descriptor once and views it here, layer by layer exactly as a
local pool, so the same copy kernels move its blocks; its snapshot slots are viewed as a state
pool's tensors (``[num_slots, *shape]`` each, strided by the slot), so ``StatePool.read`` and
``copy_to`` move them.
"""

from __future__ import annotations

import dataclasses

import torch

from radixkv.persist.manifest import layout_of
from radixkv.sidecar.layout import KVLayout, PoolGeometry
from radixkv.store.pool import BlockPool
from radixkv.store.state_pool import StatePool


class SharedBlockPool(BlockPool):
    """A ``BlockPool`` over a sidecar's memory; ``states``: its snapshot slots (None without states)."""

    states: StatePool | None = None


def shared_pool_view(
    pool: BlockPool, buf, num_blocks: int, *, states: StatePool | None = None, num_slots: int = 0
) -> SharedBlockPool:
    """A ``BlockPool`` over the sidecar's memory ``buf`` laid out as ``radixkv.sidecar.layout``
    says for the layout of the local ``pool`` (and ``states``, the local state pool: the hello's
    layout); with ``states``, its ``states`` view ``num_slots`` snapshot slots shaped as those.
    O(layers + state tensors) views, no copy; ValueError if ``buf`` is too small for them."""
    layout = layout_of(pool, states)
    geometry = PoolGeometry(KVLayout.from_json(layout), num_blocks, num_slots if states is not None else 0)
    if len(buf) < geometry.total_bytes:
        raise ValueError(f"the sidecar's pool maps {len(buf)} bytes, its layout needs {geometry.total_bytes}")
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=geometry.total_bytes)
    specs = [dataclasses.replace(s, device=torch.device("cpu")) for s in pool.layers]
    tensors = []
    for (offset, per_block), spec, which in zip(
        geometry.regions(), [s for s in specs for _ in (0, 1)], [0, 1] * len(specs)
    ):
        dim = spec.k_head_dim if which == 0 else spec.v_head_dim
        region = flat[offset : offset + per_block * num_blocks].view(spec.dtype)
        tensors.append(region.view(num_blocks, pool.block_size, spec.num_kv_heads, dim))
    view = SharedBlockPool(specs, num_blocks, pool.block_size, storage=(tensors[0::2], tensors[1::2]))
    if states is not None:
        view.states = _state_view(flat, geometry, states)
    return view


def _state_view(flat: torch.Tensor, geometry: PoolGeometry, states: StatePool) -> StatePool:
    """``states``' specs over the snapshot slots of ``flat``: tensor j of slot s at
    ``state_offset + s * slot_stride + state_offsets()[j]``."""
    layout, n = geometry.layout, geometry.num_slots
    stride = layout.slot_stride
    specs = [dataclasses.replace(s, device=torch.device("cpu")) for s in states.specs]
    region = flat[geometry.state_offset : geometry.state_offset + stride * n].view(n, stride)
    tensors = []
    for spec, offset, nbytes in zip(specs, layout.state_offsets(), layout.state_bytes(), strict=True):
        part = region[:, offset : offset + nbytes].view(spec.dtype)  # [n, elements], strided by the slot
        tensors.append(part.view(n, *spec.shape))
    return StatePool(specs, n, storage=tensors)
