"""One cache file on disk: the atomic write, and a read that checks every byte before use.

The file is a plain safetensors file (see radixkv.persist for its tensors, radixkv.persist.manifest
for its manifest): any safetensors reader opens it. Both directions stream the KV through
sha256 in 4 MiB chunks, so checksums cost no extra pass over memory: the writer hashes each
chunk as it writes it (the header, written first, is rewritten with the checksums at the
end); the reader reads each tensor into private memory (no memory map) and hashes it as it
arrives, so the bytes checked are the bytes used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Hashable, Iterator, Sequence

import torch
from safetensors import SafetensorError, safe_open

from radixkv.persist.manifest import (
    CorruptCacheFile,
    check_compatible,
    count_field,
    decode_namespaces,
    dtype_name,
    expected_tensors,
    from_metadata,
    to_metadata,
)

_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64"}
_MAX_HEADER = 100 << 20  # safetensors' own limit
_CHUNK = 4 << 20


class Gathered:
    """Blocks ``ids`` of per-tier pool tensors ``[num_blocks, bs, H, D]``, read at write time.

    ``storages[t]`` is tier t's tensor (device pool, host pool); block i is
    ``storages[tiers[i]][ids[i]]``. ``chunks()`` copies ~4 MiB of blocks at a time into one
    small CPU buffer (kept in the CPU cache for the hash and the write that follow), so a save
    never holds a second copy of the cache. The caller keeps the blocks from being evicted,
    demoted or rewritten meanwhile (pins).
    """

    def __init__(self, storages: Sequence[torch.Tensor], ids: list[int], tiers: list[int]) -> None:
        self.storages, self.ids, self.tiers = tuple(storages), ids, tiers
        self.shape = (len(ids), *storages[0].shape[1:])
        self.dtype = storages[0].dtype

    def chunks(self) -> Iterator[memoryview]:
        per_block = max(1, nbytes(self) // max(1, len(self.ids)))
        n = max(1, _CHUNK // per_block)
        buf = torch.empty((min(n, len(self.ids)), *self.shape[1:]), dtype=self.dtype)
        ids = torch.tensor(self.ids, dtype=torch.int64)
        tiers = torch.tensor(self.tiers, dtype=torch.int64)
        for start in range(0, len(self.ids), n):
            part, where = ids[start : start + n], tiers[start : start + n]
            out = buf[: len(part)]
            for tier, storage in enumerate(self.storages):
                rows = (where == tier).nonzero().flatten()
                if len(rows) == len(part):  # one tier: straight into the buffer
                    self._select(storage, part, out)
                elif len(rows):
                    out[rows] = storage.index_select(0, part[rows].to(storage.device)).cpu()
            yield memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")

    @staticmethod
    def _select(storage: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
        if storage.device.type == "cpu":
            torch.index_select(storage, 0, ids, out=out)
        else:
            out.copy_(storage.index_select(0, ids.to(storage.device)))


def nbytes(t: torch.Tensor | Gathered) -> int:
    return math.prod(t.shape) * torch.empty((), dtype=t.dtype).element_size()


def _chunks(t: torch.Tensor | Gathered) -> Iterator[memoryview]:
    if isinstance(t, Gathered):
        yield from t.chunks()
        return
    view = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()).cast("B")
    for at in range(0, len(view), _CHUNK):
        yield view[at : at + _CHUNK]


def _header(tensors: dict[str, torch.Tensor | Gathered], manifest: dict) -> bytes:
    """The safetensors header (JSON, space-padded to 8 bytes) for ``tensors`` in order."""
    entries: dict[str, object] = {"__metadata__": to_metadata(manifest)}
    at = 0
    for name, t in tensors.items():
        size = nbytes(t)
        entries[name] = {
            "dtype": _ST_DTYPES[dtype_name(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [at, at + size],
        }
        at += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _write_tensors(tensors: dict[str, torch.Tensor | Gathered], manifest: dict, path: str) -> None:
    """Write ``tensors`` as safetensors, filling ``manifest["checksums"]`` on the way.

    One pass over the KV: each chunk is hashed and written while it is in the CPU cache
    (``safetensors.torch.save_file`` would need the checksums, hence a hashing pass, first).
    The header is written with placeholder checksums of the same length, then rewritten.
    """
    manifest["checksums"] = {name: "0" * 64 for name in tensors}
    header = _header(tensors, manifest)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name, t in tensors.items():
            digest = hashlib.sha256()
            for chunk in _chunks(t):
                digest.update(chunk)
                f.write(chunk)
            manifest["checksums"][name] = digest.hexdigest()
        final = _header(tensors, manifest)
        if len(final) != len(header):  # cannot happen: hex digests have one length
            raise RuntimeError("cache file header changed length")
        f.seek(8)
        f.write(final)


def atomic_save(tensors: dict[str, torch.Tensor | Gathered], manifest: dict, path: str) -> None:
    """Write a cache file so ``path`` holds either its old content or the whole new one.

    Temporary file in the same directory (a rename across file systems is not atomic),
    fsync, ``os.replace``, fsync of the directory (so the rename itself survives a power
    loss). The file is created owner-only (0600): it holds users' token ids.
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        _write_tensors(tensors, manifest, tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- read and check -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CacheFile:
    """A checked cache file in memory (CPU tensors); ``restore_store`` inserts it."""

    manifest: dict
    namespaces: list[Hashable]
    nodes: list[list[int]]  # rows of tree.nodes
    tokens: bytes  # tree.tokens, packed like the tree's edges
    k: list[torch.Tensor]
    v: list[torch.Tensor]


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest alone (one header read, no data); CorruptCacheFile if it is not intact."""
    if os.path.getsize(path) == 0:
        raise CorruptCacheFile(f"cache file {os.fspath(path)} is empty")
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            return from_metadata(f.metadata())
    except SafetensorError as e:
        raise CorruptCacheFile(
            f"cache file {os.fspath(path)} is not a readable safetensors file: {e}"
        ) from None


def read_cache_file(path: str | os.PathLike, pool, identity: object = None) -> CacheFile:
    """Read and check all of ``path`` against ``pool``'s layout and ``identity``. Changes nothing.

    The tensors are read (not memory-mapped) into private memory and hashed there: the bytes
    checked are the bytes inserted, even if someone rewrites the file in place meanwhile (a
    mapped file cut short under a reader would also kill the process with SIGBUS).

    Raises CorruptCacheFile (empty, truncated, altered, not a cache file), CacheFileMismatch
    (another format version, identity or layout), FileNotFoundError.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CorruptCacheFile(f"cache file {path} is empty")
        header = _read_header(f, size, path)
        manifest = from_metadata(header.pop("__metadata__", None))
        check_compatible(manifest, pool, identity)
        counts = manifest.get("counts")
        n, nb = count_field(counts, "nodes"), count_field(counts, "blocks")
        if count_field(counts, "tokens") != nb * pool.block_size:
            raise CorruptCacheFile("cache file manifest: counts.tokens is not blocks * block_size")
        expected = expected_tensors(manifest["layout"], {"nodes": n, "blocks": nb})
        if set(header) != set(expected):
            raise CorruptCacheFile(f"cache file holds tensors {sorted(header)}, expected {sorted(expected)}")
        checksums = manifest.get("checksums")
        if not isinstance(checksums, dict):
            raise CorruptCacheFile("cache file manifest has no checksums")
        data_start = f.tell()
        tensors = {}
        for name, (shape, dtype) in expected.items():
            entry = header[name]
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            buf = t.view(-1).view(torch.uint8).numpy()
            begin, end = _offsets(entry)
            if (
                entry.get("dtype") != _ST_DTYPES.get(dtype)
                or entry.get("shape") != list(shape)
                or end - begin != buf.nbytes
            ):
                raise CorruptCacheFile(
                    f"cache file tensor {name} is {entry.get('dtype')} {entry.get('shape')} "
                    f"({end - begin} bytes), expected {dtype} {list(shape)}"
                )
            f.seek(data_start + begin)
            if _read_hashing(f, buf) != checksums.get(name):
                raise CorruptCacheFile(
                    f"cache file tensor {name} does not match its checksum (the file was altered)"
                )
            tensors[name] = t
    namespaces = decode_namespaces(manifest.get("namespaces"))
    nodes = tensors["tree.nodes"].tolist()
    _check_structure(nodes, len(namespaces), nb)
    layers = range(len(pool.layers))
    return CacheFile(
        manifest,
        list(namespaces),
        nodes,
        tensors["tree.tokens"].numpy().tobytes(),
        [tensors[f"kv.{i}.k"] for i in layers],
        [tensors[f"kv.{i}.v"] for i in layers],
    )


def _read_hashing(f, buf) -> str:
    """Fill ``buf`` from ``f``, hashing each chunk while it is still in the CPU cache; its sha256."""
    digest, view, done = hashlib.sha256(), memoryview(buf).cast("B"), 0
    while done < len(view):
        got = f.readinto(view[done : done + _CHUNK])
        if not got:
            raise CorruptCacheFile(f"cache file {f.name} ended inside a tensor (truncated while read?)")
        digest.update(view[done : done + got])
        done += got
    return digest.hexdigest()


def _read_header(f, size: int, path: str) -> dict:
    """The safetensors header (8-byte little-endian length, JSON), checked against the file size."""
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < length <= min(_MAX_HEADER, size - 8):
        raise CorruptCacheFile(
            f"cache file {path} is truncated or not a safetensors file (bad header length)"
        )
    try:
        header = json.loads(f.read(length))
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise CorruptCacheFile(f"cache file {path} is not a safetensors file (unreadable header)")
    ends = [_offsets(v)[1] for k, v in header.items() if k != "__metadata__"]
    if 8 + length + max(ends, default=0) != size:
        raise CorruptCacheFile(
            f"cache file {path} is truncated or extended: {size} bytes, its safetensors header "
            f"describes {8 + length + max(ends, default=0)}"
        )
    return header


def _offsets(entry: dict) -> tuple[int, int]:
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(x) is int for x in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CorruptCacheFile(f"cache file: invalid safetensors data offsets {offsets!r}")
    return offsets[0], offsets[1]


def _check_structure(nodes: list[list[int]], num_namespaces: int, num_blocks: int) -> None:
    """Raise CorruptCacheFile unless the node table describes a forest the tree can take."""
    total = 0
    for i, (parent, ns, blocks, last) in enumerate(nodes):
        if not 0 <= ns < num_namespaces or blocks < 1:
            raise CorruptCacheFile(
                f"cache file node {i}: namespace {ns} or block count {blocks} out of range"
            )
        if parent != -1:
            if not 0 <= parent < i:
                raise CorruptCacheFile(f"cache file node {i}: parent {parent} is not an earlier node")
            if nodes[parent][1] != ns or nodes[parent][3] < last:
                raise CorruptCacheFile(f"cache file node {i}: namespace or recency differs from its parent's")
        total += blocks
    if total != num_blocks:
        raise CorruptCacheFile(f"cache file nodes hold {total} blocks, the manifest says {num_blocks}")


# -- restore --------------------------------------------------------------------------------
