"""Cache files: a store's prefixes saved to one safetensors file and restored, all or nothing.

``manifest``: the file's JSON manifest, namespace encoding and the refusals
(``CacheFileError``); ``cache_file``: the bytes on disk (atomic write, checksums, checks before
anything is used); ``save_restore``: a store's snapshot written, and a file merged into a store.
"""

from radixkv.persist.manifest import CacheFileError, CacheFileMismatch, CorruptCacheFile, KeyedNamespace
from radixkv.persist.save_restore import RestoreResult, SaveResult, restore_store, save_store

__all__ = [
    "CacheFileError",
    "CacheFileMismatch",
    "CorruptCacheFile",
    "KeyedNamespace",
    "RestoreResult",
    "SaveResult",
    "restore_store",
    "save_store",
]
