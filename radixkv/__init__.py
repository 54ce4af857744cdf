"""radixkv: a block-granular radix tree over a paged KV pool, with pins and LRU eviction.

Subpackages, imports pointing down: ``radixkv.persist`` (cache files) and ``radixkv.store``
(``KVStore``: tree + ``BlockPool`` behind one lock, host tier, task pins) over
``radixkv.tree`` (``RadixTree``, pure Python). See docs/design.md.

Importing it before torch asks for passive OpenMP waits unless ``OMP_WAIT_POLICY`` is set
(``radixkv.wait_policy``: spinning threads are slow on a busy machine).
"""

# ruff: noqa: E402 (imports after quiet_threads)
# Before anything loads torch: its OpenMP runtime reads the wait policy once, when it loads.
from radixkv.wait_policy import quiet_threads

quiet_threads()

from radixkv.persist import (
    CacheFileError,
    CacheFileMismatch,
    CorruptCacheFile,
    KeyedNamespace,
    RestoreResult,
    SaveAborted,
    SaveResult,
)
from radixkv.store import (
    BlockPool,
    KVStore,
    LayerSpec,
    Lease,
    OutOfBlocks,
    StatePool,
    StateSpec,
    Tier,
    host_pool_for,
    host_states_for,
)
from radixkv.tree import MatchResult, PackedTokens, RadixTree, pack_tokens

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
    "StatePool",
    "StateSpec",
    "Tier",
    "host_pool_for",
    "host_states_for",
    "pack_tokens",
]
