"""Per-layer tensors that are slices of one buffer, seen as one tensor: one copy for all layers.

A paged copy moves the same token range of every layer and K/V. When the per-layer tensors
are evenly spaced slices of one allocation (``radixkv.BlockPool`` and ``hf_patch``'s cache
layers allocate them so: ``[layers, 2 (K, V), ...]``; the sidecar's shared memory is laid
out the same way), one strided view ``[n, *shape]`` over all of them lets the CPU path issue
one ``copy_`` per run of blocks instead of one per layer and K/V. On a machine whose cores
other processes want, every operation big enough to be split over torch's threads waits for
all of them to be scheduled, so fewer, larger operations wait less (docs/performance.md).

An operation on fewer than ``GRAIN_SIZE`` elements runs on the calling thread alone and waits
for no one. Merging such small per-layer copies into one above that size would add a wait
(without this: the contention benchmark's commits 1.5-35x slower with spinning threads), so
:func:`chunks` splits a group into the fewest slices that each stay below it, or keeps it
whole when one layer alone is above it (its per-layer copies were split over the threads).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# at::internal::GRAIN_SIZE (ATen/Parallel.h): elements below which torch's element-wise CPU
# kernels (copy_, fill_) do not split an operation over threads.
GRAIN_SIZE = 32768


def chunks(count: int, per_item: int) -> list[slice]:
    """Slices of ``range(count)`` items of ``per_item`` elements each: all of them when one item
    reaches ``GRAIN_SIZE``, else the fewest slices of fewer than ``GRAIN_SIZE`` elements."""
    if per_item >= GRAIN_SIZE or count * per_item < GRAIN_SIZE:
        return [slice(0, count)]
    step = max(1, (GRAIN_SIZE - 1) // max(per_item, 1))
    return [slice(i, min(i + step, count)) for i in range(0, count, step)]


def interleave(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``[k[0], v[0], k[1], v[1], ...]``: the order of a ``[layers, 2, ...]`` allocation."""
    return [t for pair in zip(k, v) for t in pair]


def stacked(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A view ``[len(tensors), *shape]`` whose slice ``i`` is ``tensors[i]``, or None.

    Exists when every tensor has the first one's shape, strides, dtype and device, all share
    one storage, and their offsets grow by one constant positive step that keeps them apart
    (no element of one is an element of another). O(len(tensors)), no data is read.
    """
    if not tensors:
        return None
    first = tensors[0]
    if len(tensors) == 1:
        return first.unsqueeze(0)
    shape, stride, offset = first.shape, first.stride(), first.storage_offset()
    step = tensors[1].storage_offset() - offset
    # The farthest element one tensor reaches from its offset: the next must start beyond it.
    extent = sum((size - 1) * st for size, st in zip(shape, stride)) if first.numel() else 0
    if step <= extent or any(st < 0 for st in stride):
        return None
    ptr = first.untyped_storage().data_ptr()
    for i, t in enumerate(tensors):
        if (
            t.storage_offset() != offset + i * step
            or t.shape != shape
            or t.stride() != stride
            or t.dtype != first.dtype
            or t.device != first.device
            or t.untyped_storage().data_ptr() != ptr
        ):
            return None
    return first.as_strided((len(tensors), *shape), (step, *stride), offset)


def layer_groups(
    pools_k: Sequence[torch.Tensor],
    pools_v: Sequence[torch.Tensor],
    caches_k: Sequence[torch.Tensor],
    caches_v: Sequence[torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(pools [n, N, bs, H, D], caches [n, B, H, T, D])`` pairs covering every layer and K/V.

    One pair for all of them when both sides stack in ``[layers, 2]`` order; else one for the
    K's and one for the V's when those stack; else one pair per layer and K/V (``n == 1``).
    """
    pools, caches = interleave(pools_k, pools_v), interleave(caches_k, caches_v)
    p, c = stacked(pools), stacked(caches)
    if p is not None and c is not None:
        return [(p, c)]
    groups = []
    for ps, cs in ((pools_k, caches_k), (pools_v, caches_v)):
        p, c = stacked(ps), stacked(cs)
        if p is not None and c is not None:
            groups.append((p, c))
        else:
            groups.extend((pool.unsqueeze(0), cache.unsqueeze(0)) for pool, cache in zip(ps, cs))
    return groups
