"""StatePool: fixed-size slots for recurrent-state snapshots, one slot per snapshot.

A linear-attention, Mamba or conv layer keeps a fixed-size state that summarises the whole
prefix (transformers' ``LinearAttentionLayer``: conv and recurrent states). It cannot be sliced
out of token blocks, so the store keeps *snapshots*: the states of every such layer of the
model, for one row, at the end of a tree node (``Node.snap``). A slot holds one snapshot:
``tensors[j][slot]`` is state tensor ``j`` (``StateSpec`` j, without the batch dim).

One snapshot often outweighs many tokens of KV (Qwen3.5-0.8B: ~19 MB against ~12 KB a
token), so the pool is sized in bytes, apart from the block pool: snapshots never take blocks,
and evicting snapshots never evicts KV (docs/design.md, "Recurrent state").

Not thread-safe: ``KVStore`` serialises access. The free list is an int64 stack in a tensor,
so its bookkeeping stays 8 bytes a slot whatever the count.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch


class OutOfSlots(RuntimeError):
    """``allocate(n)`` found fewer than ``n`` free slots."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"state pool exhausted: {needed} slots needed, {free} free")
        self.needed = needed
        self.free = free


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One state tensor of one row: ``shape`` without the batch dim, its dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not all(type(d) is int and d > 0 for d in shape):
            raise ValueError(f"StateSpec.shape must be positive ints, got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):  # any: snapshots move by plain copies (ids too)
            raise ValueError(f"StateSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "device", torch.device(self.device))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def snapshot_bytes(specs: Sequence[StateSpec]) -> int:
    """Bytes of one snapshot (one row's states of every recurrent layer)."""
    return sum(s.nbytes for s in specs)


class StatePool:
    """``num_slots`` snapshots of ``specs``; footprint ``num_slots * snapshot_bytes(specs)``.

    ``pin_memory``: page-locked CPU storage (a host tier behind a CUDA pool). ``storage``:
    tensors to use instead of new ones (a view of memory another process owns), each
    ``[num_slots, *spec.shape]``.
    """

    def __init__(
        self,
        specs: Sequence[StateSpec],
        num_slots: int,
        *,
        pin_memory: bool = False,
        storage: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if not specs:
            raise ValueError("StatePool needs at least one StateSpec")
        if type(num_slots) is not int or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.specs = tuple(specs)
        self.num_slots = num_slots
        if storage is None:
            self.tensors = [
                torch.empty((num_slots, *s.shape), dtype=s.dtype, device=s.device, pin_memory=pin_memory)
                for s in self.specs
            ]
        else:
            self.tensors = list(storage)
            for j, (s, t) in enumerate(zip(self.specs, self.tensors, strict=True)):
                if tuple(t.shape) != (num_slots, *s.shape) or t.dtype != s.dtype:
                    raise ValueError(
                        f"storage {j} has shape {tuple(t.shape)} {t.dtype}, not {num_slots} x {s}"
                    )
        # A stack of free slots, lowest on top: recently freed slots are reused first.
        self._free = torch.arange(num_slots - 1, -1, -1, dtype=torch.int64)
        self._num_free = num_slots
        self._used = torch.zeros(num_slots, dtype=torch.bool)

    @classmethod
    def from_budget(cls, specs: Sequence[StateSpec], nbytes: int, *, pin_memory: bool = False) -> StatePool:
        """As many slots as ``nbytes`` holds (at least one is required). Raises ValueError."""
        per = snapshot_bytes(specs)
        if type(nbytes) is not int or nbytes < per:
            raise ValueError(f"a state budget of {nbytes!r} bytes holds no snapshot of {per} bytes")
        return cls(specs, nbytes // per, pin_memory=pin_memory)

    # -- accounting -------------------------------------------------------------------------
    @property
    def slot_bytes(self) -> int:
        return snapshot_bytes(self.specs)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free slots. O(n). Raises OutOfSlots, taking nothing, when short."""
        if type(n) is not int or n < 0:
            raise ValueError(f"allocate needs an int >= 0 slots, got {n!r}")
        if n > self._num_free:
            raise OutOfSlots(n, self._num_free)
        top = self._num_free
        ids = self._free[top - n : top].flip(0).tolist()
        self._num_free -= n
        self._used[ids] = True
        return ids

    def free(self, ids: Sequence[int]) -> None:
        """Return slots to the free list. All or nothing: raises on an id out of range, not in
        use, or given twice."""
        ids = list(ids)
        for i in ids:
            if type(i) is not int or not 0 <= i < self.num_slots:
                raise ValueError(f"slot id {i!r} is not an int in [0, {self.num_slots})")
        if len(set(ids)) != len(ids) or not all(self._used[i] for i in ids):
            raise RuntimeError(f"double free of a state slot among {ids}")
        if not ids:
            return
        self._used[ids] = False
        n = len(ids)
        self._free[self._num_free : self._num_free + n] = torch.tensor(ids[::-1], dtype=torch.int64)
        self._num_free += n

    def used_slots(self) -> set[int]:
        return set(torch.nonzero(self._used).flatten().tolist())

    def check_invariants(self) -> None:
        """Recount the free stack against the used flags; AssertionError on a mismatch. O(slots)."""
        free = self._free[: self._num_free].tolist()
        if len(set(free)) != len(free):
            raise AssertionError("state free list holds a slot twice")
        if any(self._used[i] for i in free):
            raise AssertionError("a free state slot is marked used")
        if int(self._used.sum()) + len(free) != self.num_slots:
            raise AssertionError("state slots lost: neither free nor used")

    # -- copies -------------------------------------------------------------------------------
    def write(self, slot: int, states: Sequence[torch.Tensor]) -> None:
        """Copy one row's ``states`` (``states[j]``: ``spec j``'s shape, any device) into ``slot``."""
        self._check_states("write", states)
        for t, src in zip(self.tensors, states):
            t[slot].copy_(src, non_blocking=t.is_pinned())
        if any(t.is_pinned() for t in self.tensors) and torch.cuda.is_available():
            torch.cuda.synchronize()

    def read(self, slot: int, out: Sequence[torch.Tensor]) -> None:
        """Copy ``slot`` into one row's ``out`` tensors (``out[j]``: spec j's shape, any device)."""
        self._check_states("read", out)
        for t, dst in zip(self.tensors, out):
            dst.copy_(t[slot])

    def copy_to(self, slot: int, dst: StatePool, dst_slot: int) -> int:
        """Copy ``slot`` into ``dst_slot`` of a pool of the same specs (a tier move); returns bytes."""
        for s, d in zip(self.tensors, dst.tensors, strict=True):
            d[dst_slot].copy_(s[slot], non_blocking=d.is_pinned())
        if any(d.is_pinned() for d in dst.tensors) and torch.cuda.is_available():
            torch.cuda.synchronize()
        return self.slot_bytes

    def _check_states(self, op: str, states: Sequence[torch.Tensor]) -> None:
        if len(states) != len(self.specs):
            raise ValueError(f"state {op}: {len(self.specs)} state tensors expected, got {len(states)}")
        for j, (s, t) in enumerate(zip(self.specs, states)):
            if tuple(t.shape) != s.shape:
                raise ValueError(f"state {op}: tensor {j} has shape {tuple(t.shape)}, expected {s.shape}")


def host_states_for(device: StatePool, nbytes: int) -> StatePool:
    """A CPU pool of ``device``'s specs sized by ``nbytes``; page-locked when ``device`` is on CUDA."""
    specs = [dataclasses.replace(s, device=torch.device("cpu")) for s in device.specs]
    pin = any(s.device.type == "cuda" for s in device.specs)
    return StatePool.from_budget(specs, nbytes, pin_memory=pin)


def check_state_mirror(device: StatePool, host: StatePool) -> None:
    """Raise ValueError unless ``host`` holds snapshots of ``device``'s shapes and dtypes."""
    if [(s.shape, s.dtype) for s in device.specs] != [(s.shape, s.dtype) for s in host.specs]:
        raise ValueError("host state pool specs differ from the device state pool's")
