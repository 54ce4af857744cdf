"""Where a block's bytes sit in a sidecar's shared-memory pool (pure Python, no torch).

One pool per KV layout (block size and per-layer heads, head dims, dtype). The pool is one
memory file, layer-major, exactly as ``radixkv.BlockPool`` lays out its tensors so that a client
can view it as one (``BlockPool(..., storage=...)``) and copy with the same kernels:

    for each layer l: K region [num_blocks, block_size, heads, k_head_dim], then V region
                      [num_blocks, block_size, heads, v_head_dim]; each region page-aligned.

A block's *payload* (what the L2 tier stores) is the concatenation of its slice of every region,
in that order: all layers' K and V for ``block_size`` tokens.
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


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Block size and per-layer ``(num_kv_heads, k_head_dim, v_head_dim, dtype name)``."""

    block_size: int
    layers: tuple[tuple[int, int, int, str], ...]

    @classmethod
    def from_json(cls, obj: object) -> KVLayout:
        """Parse a client's layout (``hf_patch.identity.kv_layout``'s dict, or the schema's
        ``messages.Layout``); ValueError naming the first bad field, or why its sizes are refused
        (``MIN_BLOCK_BYTES``, ``MIN_TOKEN_BYTES``)."""
        parsed = layout_from(obj)
        bs = parsed.block_size
        if bs & (bs - 1):
            raise ValueError(f"layout.block_size must be a power of two, got {bs}")
        layout = cls(bs, tuple((x.num_kv_heads, x.k_head_dim, x.v_head_dim, x.dtype) for x in parsed.layers))
        per_token = layout.block_bytes // bs
        if layout.block_bytes < MIN_BLOCK_BYTES or per_token < MIN_TOKEN_BYTES:
            raise ValueError(
                f"layout: a block takes {layout.block_bytes} bytes ({bs} token{'s' * (bs > 1)} of {per_token} "
                f"bytes of K and V); the sidecar takes blocks of at least {MIN_BLOCK_BYTES} bytes and "
                f"{MIN_TOKEN_BYTES} bytes a token (below that its bookkeeping outweighs the KV): "
                "raise the block size, or keep this model's cache in its own process"
            )
        return layout

    def to_json(self) -> dict:
        return {
            "block_size": self.block_size,
            "layers": [
                {"num_kv_heads": h, "k_head_dim": k, "v_head_dim": v, "dtype": d}
                for h, k, v, d in self.layers
            ],
        }

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
        return sum(self.region_block_bytes())


@dataclasses.dataclass(frozen=True)
class PoolGeometry:
    """A layout with a block count: region offsets in the pool file and its size."""

    layout: KVLayout
    num_blocks: int

    def regions(self) -> list[tuple[int, int]]:
        """``(offset, bytes per block)`` of each region, in pool order."""
        out, offset = [], 0
        for per_block in self.layout.region_block_bytes():
            out.append((offset, per_block))
            offset += -(-per_block * self.num_blocks // PAGE) * PAGE
        return out

    @property
    def total_bytes(self) -> int:
        offset, per_block = self.regions()[-1]
        return offset + -(-per_block * self.num_blocks // PAGE) * PAGE

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
