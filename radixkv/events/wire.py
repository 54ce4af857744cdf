"""vLLM's KV event schema (``vllm/distributed/kv_events.py``), as msgspec structs.

A batch is ``KVEventBatch(ts, events, data_parallel_rank)``, msgpack-encoded as an array. Each
event is a tagged struct: ``BlockStored(block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name)``, ``BlockRemoved(block_hashes, medium)`` and
``AllBlocksCleared()``. Two event layouts are on the wire in vLLM's history, and routers read
both: ``"array"`` (the default: ``[tag, field, ...]`` in declaration order, nil when unset,
what vLLM and SGLang published first and llm-d's and Dynamo's decoders were written for) and
``"map"`` (``{"type": tag, field: value, ...}``, vLLM's later releases); the batch is an array
in both. Block hashes are unsigned 64-bit ints (vLLM's int form of an ``ExternalBlockHash``).
"""

from __future__ import annotations

import msgspec

MEDIUM_GPU = "GPU"  # vLLM's names; a tier of radixkv is named for what it is, not its device
MEDIUM_CPU = "CPU"
LAYOUTS = ("array", "map")


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def _as_map(event: KVCacheEvent) -> dict:
    return {"type": type(event).__name__, **msgspec.structs.asdict(event)}


class BatchEncoder:
    """``encode(events, ts, rank) -> bytes``: one msgpack ``KVEventBatch`` in ``layout``.

    Raises ValueError naming the layouts for another one. Not thread safe (one per thread).
    """

    def __init__(self, layout: str = "array") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"event layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, events: list[KVCacheEvent], ts: float, rank: int | None = 0) -> bytes:
        if self.layout == "map":
            events = [_as_map(e) for e in events]
        return self._encoder.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=rank))
