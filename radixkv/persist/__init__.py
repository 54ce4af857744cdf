"""Cache files: a store's prefixes saved to one safetensors file and restored, all or nothing.

``manifest``: the file's JSON manifest, namespace encoding and the refusals
(``CacheFileError``); ``checksum``: the tensors' checksums (BLAKE3; sha256 in format 1);
``file_io``: a writer thread behind a save, two reader threads ahead of a restore;
``cache_write``: the atomic write; ``cache_file``: opening a file, its header, manifest and
tree checked; ``cache_read``: its KV (and recurrent-state snapshots) read straight into the
blocks (state slots) chosen for them, checked; ``save``: a store's tree written (the result
records, and ``Locked``: what a save or restore may use of a store under its lock);
``restore_plan``: where a file's nodes go; ``restore_states``: where its snapshots go;
``restore``: a file merged into a store.
"""

from radixkv.persist.cache_write import SaveAborted
from radixkv.persist.manifest import CacheFileError, CacheFileMismatch, CorruptCacheFile, KeyedNamespace
from radixkv.persist.restore import restore_store
from radixkv.persist.save import Locked, RestoreResult, SaveResult, save_store

__all__ = [
    "CacheFileError",
    "CacheFileMismatch",
    "CorruptCacheFile",
    "KeyedNamespace",
    "Locked",
    "RestoreResult",
    "SaveAborted",
    "SaveResult",
    "restore_store",
    "save_store",
]
