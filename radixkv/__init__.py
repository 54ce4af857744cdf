"""radixkv: a block-granular radix tree over a paged KV pool, with pins and LRU eviction.

Layers: ``RadixTree`` (pure Python) and ``BlockPool`` (torch storage) are combined by
``KVStore`` behind one lock, optionally with a host-memory tier (``radixkv.tier``) and task
pins (``radixkv.task_pins``). See docs/design.md.
"""

from radixkv.cache_write import SaveAborted
from radixkv.manifest import CacheFileError, CacheFileMismatch, CorruptCacheFile, KeyedNamespace
from radixkv.node import PackedTokens, pack_tokens
from radixkv.persist import RestoreResult, SaveResult
from radixkv.pool import BlockPool, LayerSpec, OutOfBlocks
from radixkv.store import KVStore, Lease
from radixkv.tier import Tier, host_pool_for
from radixkv.tree import MatchResult, RadixTree

__all__ = [
    "BlockPool",
    "CacheFileError",
    "CacheFileMismatch",
    "CorruptCacheFile",
    "KVStore",
    "KeyedNamespace",
    "LayerSpec",
    "Lease",
    "MatchResult",
    "OutOfBlocks",
    "PackedTokens",
    "RadixTree",
    "RestoreResult",
    "SaveAborted",
    "SaveResult",
    "Tier",
    "host_pool_for",
    "pack_tokens",
]
