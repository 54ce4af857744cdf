"""BlockPool: preallocated paged K/V storage for every layer, a free list and reference counts.

Storage per layer: ``k[l]`` is ``[num_blocks, block_size, num_kv_heads, k_head_dim]`` and
``v[l]`` is ``[num_blocks, block_size, num_kv_heads, v_head_dim]``, in the layer's dtype and
on the layer's own device (layers of one model may sit on different devices). When every
layer's K and V share shape and dtype on the CPU they are slices ``[l, 0]`` / ``[l, 1]`` of
one ``[layers, 2, ...]`` tensor, each still contiguous: the copies then move all layers at once. One block id
addresses the same slot in every layer. Not thread-safe: ``KVStore`` serialises access.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import torch

import cuda_ext
from cuda_ext.validate import DTYPES  # what the copy ops move: a pool of anything else stays empty
from radixkv.tree.node import check_block_size


def _is_count(value: object) -> bool:
    """An int but not a bool (``True`` blocks is a bug, not a size)."""
    return isinstance(value, int) and not isinstance(value, bool)


class OutOfBlocks(RuntimeError):
    """``allocate(n)`` found fewer than ``n`` free blocks: evict and retry, or skip caching."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"block pool exhausted: {needed} blocks needed, {free} free")
        self.needed = needed
        self.free = free


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """Shape of one attention layer's KV: what one cached token costs in that layer."""

    num_kv_heads: int
    k_head_dim: int
    v_head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "k_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not _is_count(value) or value <= 0:
                raise ValueError(f"LayerSpec.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(
                f"LayerSpec.dtype must be one of {', '.join(map(str, DTYPES))}, got {self.dtype!r}"
            )
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * (self.k_head_dim + self.v_head_dim) * elem


def _uniform(layers: Sequence[LayerSpec]) -> bool:
    """Every layer's K and V have one shape and dtype, on the CPU (then one allocation holds
    them: the CPU copies move all layers at once; on CUDA one kernel launch does already)."""
    if not layers:
        return False
    first = layers[0]
    return first.device.type == "cpu" and all(
        (s.num_kv_heads, s.k_head_dim, s.v_head_dim, s.dtype, s.device)
        == (first.num_kv_heads, first.k_head_dim, first.k_head_dim, first.dtype, first.device)
        for s in layers
    )


class BlockPool:
    """Fixed-size pool of KV blocks; footprint is exactly ``num_blocks * block_size * bytes_per_token``."""

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        num_blocks: int,
        block_size: int,
        *,
        pin_memory: bool = False,
        storage: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    ) -> None:
        """``pin_memory``: page-locked CPU storage (a host tier behind a CUDA pool).
        ``storage``: ``(k, v)`` per-layer tensors to use instead of new ones (a view over memory
        another process owns: radixkv.sidecar), each ``[num_blocks, block_size, heads, dim]``."""
        # No layers: a model whose every layer keeps recurrent state (Mamba): blocks hold no
        # bytes and only number the tree's token runs; the snapshots are in a StatePool.
        if not _is_count(num_blocks) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        check_block_size(block_size)
        self.layers = tuple(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size

        # torch.empty: pages are committed by the OS only when first written.
        def empty(s: LayerSpec, head_dim: int) -> torch.Tensor:
            shape = (num_blocks, block_size, s.num_kv_heads, head_dim)
            return torch.empty(shape, dtype=s.dtype, device=s.device, pin_memory=pin_memory)

        if storage is None and _uniform(self.layers):
            # One allocation [layers, 2, ...]: K and V of every layer are evenly spaced slices,
            # which the copy ops move with one operation per run of blocks (cuda_ext.stacking).
            s = self.layers[0]
            shape = (len(self.layers), 2, num_blocks, block_size, s.num_kv_heads, s.k_head_dim)
            both = torch.empty(shape, dtype=s.dtype, device=s.device, pin_memory=pin_memory)
            self.k = [both[i, 0] for i in range(len(self.layers))]
            self.v = [both[i, 1] for i in range(len(self.layers))]
        elif storage is None:
            self.k = [empty(s, s.k_head_dim) for s in self.layers]
            self.v = [empty(s, s.v_head_dim) for s in self.layers]
        else:
            self.k, self.v = list(storage[0]), list(storage[1])
            for i, (s, k, v) in enumerate(zip(self.layers, self.k, self.v, strict=True)):
                for t, dim in ((k, s.k_head_dim), (v, s.v_head_dim)):
                    if t.shape != (num_blocks, block_size, s.num_kv_heads, dim) or t.dtype != s.dtype:
                        raise ValueError(
                            f"storage of layer {i} has shape {tuple(t.shape)} {t.dtype}, not {s}"
                        )
        # Layers grouped by device: one fused gather/scatter launch per device.
        groups: dict[torch.device, list[int]] = {}
        for i, s in enumerate(self.layers):
            groups.setdefault(s.device, []).append(i)
        self.device_groups = groups
        # Free list as a stack: recently freed (cache-warm) blocks are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks

    @classmethod
    def from_budget(
        cls,
        layers: Sequence[LayerSpec],
        block_size: int = 16,
        *,
        tokens: int | None = None,
        bytes: int | None = None,  # noqa: A002 - mirrors the user-facing word
        pin_memory: bool = False,
    ) -> BlockPool:
        """Size the pool by a token count or a byte budget (exactly one), rounded down to whole blocks."""
        if (tokens is None) == (bytes is None):
            raise ValueError("give exactly one of tokens= or bytes= for the pool budget")
        budget = tokens if tokens is not None else bytes
        if not _is_count(budget) or budget < 0:
            raise ValueError(f"the pool budget must be an int >= 0, got tokens={tokens!r}, bytes={bytes!r}")
        check_block_size(block_size)
        if not layers and tokens is None:
            raise ValueError("a pool without layers (no attention KV) is sized in tokens=, not bytes=")
        per_block = block_size * sum(s.bytes_per_token for s in layers)
        num_blocks = tokens // block_size if tokens is not None else bytes // per_block
        if num_blocks <= 0:
            raise ValueError(
                f"budget too small for one block: tokens={tokens}, bytes={bytes}, "
                f"one block of {block_size} tokens takes {per_block} bytes"
            )
        return cls(layers, num_blocks, block_size, pin_memory=pin_memory)

    # -- accounting -----------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.layers)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each). O(n). Raises OutOfBlocks, taking nothing, if short."""
        if not _is_count(n) or n < 0:
            raise ValueError(f"allocate needs an int >= 0 blocks, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        # The stack's top, reversed: blocks freed together come back as ascending runs of
        # consecutive ids, which the copy kernels move as one contiguous slice.
        ids = self._free[len(self._free) - n :]
        ids.reverse()
        del self._free[len(self._free) - n :]
        for i in ids:
            self._refs[i] = 1
        return ids

    def incref(self, ids: Sequence[int]) -> None:
        """Add one reference to each (allocated) block. O(len(ids)); all or nothing."""
        for i in self._checked(ids, "incref of", 0):
            self._refs[i] += 1

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference from each block; a block at zero returns to the free list. O(len(ids)).

        All or nothing: raises (changing nothing) on an id outside ``[0, num_blocks)`` or a
        block freed more often than it is referenced.
        """
        for i in self._checked(ids, "double free of", 1):
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def _checked(self, ids: Sequence[int], what: str, per_use: int) -> Sequence[int]:
        """``ids`` after checking each is in range and has more than ``(uses - 1) * per_use`` refs."""
        # A negative id would index the refcount list from its end and put -1 on the free list.
        for i in ids:
            if not _is_count(i) or not 0 <= i < self.num_blocks:
                raise ValueError(f"block id {i!r} is not an int in [0, {self.num_blocks})")
        for i, uses in Counter(ids).items():
            if self._refs[i] < max(1, uses * per_use):
                raise RuntimeError(f"{what} block {i} (refcount {self._refs[i]}, {uses} in this call)")
        return ids

    def check_invariants(self) -> None:
        """Recount the free list and refcounts; raise AssertionError on the first mismatch. O(num_blocks)."""
        free = self._free
        if len(set(free)) != len(free):
            raise AssertionError("free list holds a block twice")
        for i in free:
            if not (_is_count(i) and 0 <= i < self.num_blocks and self._refs[i] == 0):
                raise AssertionError(f"free list entry {i!r} is out of range or referenced")
        if any(r < 0 for r in self._refs) or len(self._refs) != self.num_blocks:
            raise AssertionError("negative refcount or refcount list of the wrong length")
        used = sum(1 for r in self._refs if r > 0)
        if used + len(free) != self.num_blocks:
            raise AssertionError("blocks lost: neither free nor referenced")

    def used_blocks(self) -> set[int]:
        return {i for i, r in enumerate(self._refs) if r > 0}

    # -- copies ---------------------------------------------------------------------------
    def gather(
        self,
        block_ids: torch.Tensor,
        num_tokens: int,
        k_out: Sequence[torch.Tensor],
        v_out: Sequence[torch.Tensor],
    ) -> None:
        """Copy the first ``num_tokens`` tokens of rows of blocks into per-layer views.

        block_ids: ``[B, nb]`` int64 on CPU; ``k_out[l]``/``v_out[l]``: ``[B, H, num_tokens, D]``
        on layer ``l``'s device, any strides. One fused op per device.
        """
        for idx in self.device_groups.values():
            cuda_ext.paged_gather(
                [self.k[i] for i in idx],
                [self.v[i] for i in idx],
                block_ids,  # CPU ids: the op range-checks them on the host, no device sync
                num_tokens,
                [k_out[i] for i in idx],
                [v_out[i] for i in idx],
            )

    def scatter(
        self,
        block_ids: torch.Tensor,
        k_src: Sequence[torch.Tensor],
        v_src: Sequence[torch.Tensor],
    ) -> None:
        """Write ``[B, H, S, D]`` sources (any strides) into blocks ``block_ids`` ``[B, nb]``, S <= nb*bs."""
        for idx in self.device_groups.values():
            cuda_ext.paged_scatter(
                [k_src[i] for i in idx],
                [v_src[i] for i in idx],
                block_ids,
                [self.k[i] for i in idx],
                [self.v[i] for i in idx],
            )
