"""BlockPool: preallocated paged K/V storage for every layer, a free list and reference counts.

Storage per layer: ``k[l]`` is ``[num_blocks, block_size, num_kv_heads, k_head_dim]`` and
``v[l]`` is ``[num_blocks, block_size, num_kv_heads, v_head_dim]``, in the layer's dtype and
on the layer's own device (layers of one model may sit on different devices). One block id
addresses the same slot in every layer. Not thread-safe: ``KVStore`` serialises access.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

import cuda_ext


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
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LayerSpec.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * (self.k_head_dim + self.v_head_dim) * elem


class BlockPool:
    """Fixed-size pool of KV blocks; footprint is exactly ``num_blocks * block_size * bytes_per_token``."""

    def __init__(self, layers: Sequence[LayerSpec], num_blocks: int, block_size: int) -> None:
        if not layers:
            raise ValueError("BlockPool needs at least one LayerSpec")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two (1, 2, 4, ... ), got {block_size!r}")
        self.layers = tuple(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # torch.empty: pages are committed by the OS only when first written.
        self.k = [
            torch.empty(num_blocks, block_size, s.num_kv_heads, s.k_head_dim, dtype=s.dtype, device=s.device)
            for s in self.layers
        ]
        self.v = [
            torch.empty(num_blocks, block_size, s.num_kv_heads, s.v_head_dim, dtype=s.dtype, device=s.device)
            for s in self.layers
        ]
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
    ) -> BlockPool:
        """Size the pool by a token count or a byte budget (exactly one), rounded down to whole blocks."""
        if (tokens is None) == (bytes is None):
            raise ValueError("give exactly one of tokens= or bytes= for the pool budget")
        per_block = block_size * sum(s.bytes_per_token for s in layers)
        num_blocks = tokens // block_size if tokens is not None else bytes // per_block
        if num_blocks <= 0:
            raise ValueError(
                f"budget too small for one block: tokens={tokens}, bytes={bytes}, "
                f"one block of {block_size} tokens takes {per_block} bytes"
            )
        return cls(layers, num_blocks, block_size)

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
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
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
        for i in ids:
            if self._refs[i] <= 0:
                raise RuntimeError(f"incref of free block {i}")
            self._refs[i] += 1

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference from each block; a block at zero returns to the free list. O(len(ids))."""
        for i in ids:
            if self._refs[i] <= 0:
                raise RuntimeError(f"double free of block {i}")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)

    def check_invariants(self) -> None:
        free = self._free
        assert len(set(free)) == len(free), "free list holds a block twice"
        for i in free:
            assert self._refs[i] == 0, f"free block {i} has refcount {self._refs[i]}"
        used = sum(1 for r in self._refs if r > 0)
        assert used + len(free) == self.num_blocks, "blocks lost: neither free nor referenced"

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
