"""Where a block's bytes sit in a sidecar's shared-memory pool (pure Python, no torch).

One pool per KV layout (block size and per-layer heads, head dims, dtype; for a model with
recurrent layers also the shapes and dtypes of its snapshot's state tensors). The pool is one
memory file, layer-major, exactly as ``radixkv.BlockPool`` lays out its tensors so that a client
can view it as one (``BlockPool(..., storage=...)``) and copy with the same kernels:

    for each layer l: K region [num_blocks, block_size, heads, k_head_dim], then V region
                      [num_blocks, block_size, heads, v_head_dim]; each region page-aligned;
    then, with states, the state region [num_slots, slot_stride] (page-aligned): one snapshot
    a slot, state tensor j at byte ``state_offsets()[j]`` of its slot (64-byte aligned).

A block's *payload* (what the L2 tier stores) is the concatenation of its slice of every region,
in that order: all layers' K and V for ``block_size`` tokens. A snapshot's payload is its state
tensors' bytes, one after the other (no padding: ``snapshot_bytes``, what a local ``StatePool``
slot holds).

A layout without layers (a model with no attention KV, such as Mamba) has blocks of zero bytes:
they only number the tree's token runs, and a pool holds ``state_only_blocks`` of them.
"""

from __future__ import annotations

import dataclasses
import json

from radixkv.sidecar.messages import layout_from

PAGE = 4096
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
# The smallest blocks a sidecar pool takes. Per cached block the sidecar keeps its id in the
# tree (~40 bytes; ~0.5 KiB when a node holds one block alone) and per token an 8-byte key: a
# layout below these would spend more on bookkeeping than on KV (4-byte blocks: 16.7 M blocks in
# 64 MiB). Real models' blocks are far above both (a 0.5 B model: ~12 KiB a token).
MIN_BLOCK_BYTES = 1024
MIN_TOKEN_BYTES = 128
# Snapshots: as for blocks, one below this would spend more on bookkeeping (its slot in a node,
# its free-list entry) than on state; one above the most would be an error (Mamba-2's default
# config: 261 MiB).
MIN_SNAPSHOT_BYTES = 1024
MAX_SNAPSHOT_BYTES = 1 << 32
STATE_ALIGN = 64  # bytes: every state tensor of a slot starts at a multiple (any dtype's alignment)
# A layout without KV layers: its blocks hold nothing, so bytes cannot bound them. Their count is
# bounded instead by these (the tree keeps ~40 bytes a block and 8 bytes a token: at most ~11 MiB).
STATE_ONLY_BLOCKS = 1 << 16
STATE_ONLY_TOKENS = 1 << 20


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Block size, per-layer ``(num_kv_heads, k_head_dim, v_head_dim, dtype name)`` and the
    snapshot's state tensors ``(shape, dtype name)`` (none for a model without recurrent layers)."""

    block_size: int
    layers: tuple[tuple[int, int, int, str], ...]
    states: tuple[tuple[tuple[int, ...], str], ...] = ()

    @classmethod
    def from_json(cls, obj: object) -> KVLayout:
        """Parse a client's layout (``hf_patch.identity.kv_layout``'s dict, or the schema's
        ``messages.Layout``); ValueError naming the first bad field, or why its sizes are refused
        (``MIN_BLOCK_BYTES``, ``MIN_TOKEN_BYTES``, ``MIN_SNAPSHOT_BYTES``, ``MAX_SNAPSHOT_BYTES``;
        neither layers nor states)."""
        parsed = layout_from(obj)
        bs = parsed.block_size
        if bs & (bs - 1):
            raise ValueError(f"layout.block_size must be a power of two, got {bs}")
        layout = cls(
            bs,
            tuple((x.num_kv_heads, x.k_head_dim, x.v_head_dim, x.dtype) for x in parsed.layers),
            tuple((tuple(x.shape), x.dtype) for x in parsed.states),
        )
        if not layout.layers and not layout.states:
            raise ValueError("layout: no layers and no states: a pool holds KV layers, snapshots or both")
        per_token = layout.block_bytes // bs
        if layout.layers and (layout.block_bytes < MIN_BLOCK_BYTES or per_token < MIN_TOKEN_BYTES):
            raise ValueError(
                f"layout: a block takes {layout.block_bytes} bytes ({bs} token{'s' * (bs > 1)} of {per_token} "
                f"bytes of K and V); the sidecar takes blocks of at least {MIN_BLOCK_BYTES} bytes and "
                f"{MIN_TOKEN_BYTES} bytes a token (below that its bookkeeping outweighs the KV): "
                "raise the block size, or keep this model's cache in its own process"
            )
        snap = layout.snapshot_bytes
        if layout.states and not MIN_SNAPSHOT_BYTES <= snap <= MAX_SNAPSHOT_BYTES:
            raise ValueError(
                f"layout.states: a snapshot takes {snap} bytes; the sidecar takes snapshots of "
                f"{MIN_SNAPSHOT_BYTES} to {MAX_SNAPSHOT_BYTES} bytes"
            )
        return layout

    def to_json(self) -> dict:
        out = {
            "block_size": self.block_size,
            "layers": [
                {"num_kv_heads": h, "k_head_dim": k, "v_head_dim": v, "dtype": d}
                for h, k, v, d in self.layers
            ],
        }
        if self.states:  # a plain layout's JSON (and key) as before states existed
            out["states"] = [{"shape": list(shape), "dtype": d} for shape, d in self.states]
        return out

    @property
    def key(self) -> str:
        """A canonical string: equal layouts share one pool."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def region_block_bytes(self) -> list[int]:
        """Bytes one block takes in each region, in pool order (K0, V0, K1, V1, ...)."""
        out = []
        for heads, k_dim, v_dim, dtype in self.layers:
            elem = DTYPE_BYTES[dtype]
            out += [self.block_size * heads * k_dim * elem, self.block_size * heads * v_dim * elem]
        return out

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer (0 without layers)."""
        return sum(self.region_block_bytes())

    def state_bytes(self) -> list[int]:
        """Bytes of each state tensor of one snapshot, in order."""
        out = []
        for shape, dtype in self.states:
            n = DTYPE_BYTES[dtype]
            for d in shape:
                n *= d
            out.append(n)
        return out

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one snapshot's payload: its state tensors, one after the other (0 without states)."""
        return sum(self.state_bytes())

    def state_offsets(self) -> list[int]:
        """Where each state tensor starts in a slot (``STATE_ALIGN``-aligned)."""
        out, at = [], 0
        for n in self.state_bytes():
            out.append(at)
            at = _round_up(at + n, STATE_ALIGN)
        return out

    @property
    def slot_stride(self) -> int:
        """Bytes from one slot of the state region to the next (0 without states)."""
        sizes = self.state_bytes()
        return _round_up(self.state_offsets()[-1] + sizes[-1], STATE_ALIGN) if sizes else 0

    def state_only_blocks(self, budget_bytes: int) -> int:
        """The blocks a pool of this layout without layers holds: they take no bytes, so the
        count is bounded instead (``STATE_ONLY_BLOCKS``, ``STATE_ONLY_TOKENS``, and one block per
        ``MIN_BLOCK_BYTES`` of the budget: the bookkeeping of the smallest blocks taken)."""
        return max(
            1, min(STATE_ONLY_BLOCKS, STATE_ONLY_TOKENS // self.block_size, budget_bytes // MIN_BLOCK_BYTES)
        )


@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    """A layout with a block count (and, with states, a snapshot slot count): region offsets in
    the pool file and its size."""

    layout: KVLayout
    num_blocks: int
    num_slots: int = 0

    def regions(self) -> list[tuple[int, int]]:
        """``(offset, bytes per block)`` of each KV region, in pool order."""
        out, offset = [], 0
        for per_block in self.layout.region_block_bytes():
            out.append((offset, per_block))
            offset += _round_up(per_block * self.num_blocks, PAGE)
        return out

    @property
    def state_offset(self) -> int:
        """Where the state region starts: after the KV regions (page-aligned)."""
        return sum(_round_up(n * self.num_blocks, PAGE) for n in self.layout.region_block_bytes())

    @property
    def total_bytes(self) -> int:
        return self.state_offset + _round_up(self.layout.slot_stride * self.num_slots, PAGE)

    def read_block(self, buf, slot: int) -> bytes:
        """Block ``slot``'s payload out of ``buf`` (a writable buffer over the pool)."""
        view = memoryview(buf)
        return b"".join(view[o + slot * n : o + (slot + 1) * n] for o, n in self.regions())

    def write_block(self, buf, slot: int, payload: bytes) -> None:
        """Write one payload into block ``slot``; ValueError if its size is not the block's."""
        if len(payload) != self.layout.block_bytes:
            raise ValueError(f"payload of {len(payload)} bytes, a block takes {self.layout.block_bytes}")
        view, src, at = memoryview(buf), memoryview(payload), 0
        for o, n in self.regions():
            view[o + slot * n : o + (slot + 1) * n] = src[at : at + n]
            at += n

    def _state_parts(self, slot: int) -> list[tuple[int, int]]:
        """``(start, end)`` in the pool file of each state tensor of snapshot ``slot``."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"snapshot slot {slot} is not in [0, {self.num_slots})")
        base = self.state_offset + slot * self.layout.slot_stride
        return [
            (base + o, base + o + n) for o, n in zip(self.layout.state_offsets(), self.layout.state_bytes())
        ]

    def read_snapshot(self, buf, slot: int) -> bytes:
        """Snapshot ``slot``'s payload (its state tensors' bytes, one after the other), a copy."""
        view = memoryview(buf)
        return b"".join(view[a:b] for a, b in self._state_parts(slot))

    def write_snapshot(self, buf, slot: int, payload) -> None:
        """Write one snapshot payload into ``slot``; ValueError if its size is not a snapshot's."""
        src = memoryview(payload).cast("B")
        if src.nbytes != self.layout.snapshot_bytes:
            raise ValueError(
                f"snapshot payload of {src.nbytes} bytes, a snapshot takes {self.layout.snapshot_bytes}"
            )
        view, at = memoryview(buf), 0
        for a, b in self._state_parts(slot):
            view[a:b] = src[at : at + b - a]
            at += b - a
