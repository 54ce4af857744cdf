"""The checksums of a cache file's tensors: BLAKE3 for files written now, sha256 for format 1.

The manifest names the algorithm (``"checksum"``; a format-1 file has none and used sha256),
and a restore checks every tensor with the one its file names. Why BLAKE3 (measured on the
2-core test machine, AMD EPYC with SHA-NI and AVX-512, 256 MiB in memory; docs/benchmarks.md "The cache
on disk"): one thread of BLAKE3 hashes ~7.7 GB/s, sha256 ~2.1 GB/s (SHA-NI), sha256 over
chunks on both cores ~4.0 GB/s. A restore reads a page-cached file at ~4 GB/s (``cp``): with
sha256 the hash alone takes as long as the copy, with BLAKE3 a quarter of it, on one core,
leaving the other to read. The ``blake3`` package releases the GIL while it hashes.

A checksum here guards against damage (a torn write, a flipped bit, a truncated copy), not
against someone who can rewrite the file: they could rewrite the checksums as well.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Protocol

import blake3
import torch

from radixkv.persist.manifest import CacheFileMismatch, CorruptCacheFile

WRITTEN = "blake3"  # what a save records and uses
FORMAT1 = "sha256"  # what format-1 files used (their manifest names none)
KNOWN = (WRITTEN, FORMAT1)


class Hasher(Protocol):
    def update(self, data, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(name: str) -> Hasher:
    """A fresh hasher for algorithm ``name``; CacheFileMismatch for one this radixkv does not know."""
    if name == "blake3":
        return blake3.blake3()  # one thread: the other core reads or writes meanwhile
    if name == "sha256":
        return hashlib.sha256()
    raise CacheFileMismatch(f"cache file checksums use {name!r}; this radixkv checks {', '.join(KNOWN)}")


def algorithm_of(manifest: Mapping) -> str:
    """The checksum a (version-checked) manifest's tensors were hashed with.

    Format 1 names none: sha256. Raises CorruptCacheFile when a later manifest names none,
    CacheFileMismatch when it names one this radixkv does not know.
    """
    if manifest.get("version") == 1:
        return FORMAT1
    name = manifest.get("checksum")
    if not isinstance(name, str):
        raise CorruptCacheFile(f"cache file manifest names no checksum algorithm ({name!r})")
    new_hasher(name)
    return name


def tensor_digest(t: torch.Tensor, name: str = WRITTEN) -> str:
    """Hex digest of a CPU tensor's bytes in memory order (contiguous copy if needed)."""
    hasher = new_hasher(name)
    hasher.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return hasher.hexdigest()
