"""Opening a cache file: its header, manifest and tree checked before anything uses them.

The file is a plain safetensors file (radixkv.persist lists its tensors, radixkv.persist.manifest its
manifest; radixkv.persist.cache_write writes it). ``open_cache_file`` reads the header and the
manifest, checks them against the store (format version, identity, layout with its state
specs, every tensor's dtype, shape and place), reads the small tree tensors (node table, token
ids, snapshot rows), checks their checksums and the tree's structure, and returns a
``CacheFileHead``. The KV and the snapshots, nearly all of the file, are read and checked by
radixkv.persist.cache_read straight into the blocks and state slots a restore chose for them;
nothing reaches a store's tree before every byte has passed.

Reads go into private memory (no memory map): the bytes checked are the bytes used, even if
someone rewrites the file in place meanwhile (a mapped file cut short under a reader would
also kill the process with SIGBUS).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import time
from collections.abc import Hashable

import torch
from safetensors import SafetensorError, safe_open

from radixkv.persist.cache_write import ST_DTYPES
from radixkv.persist.checksum import algorithm_of, new_hasher
from radixkv.persist.file_io import IoTimes
from radixkv.persist.manifest import (
    CorruptCacheFile,
    check_compatible,
    count_field,
    decode_namespaces,
    expected_tensors,
    from_metadata,
)

_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """Where one KV tensor ``[blocks, bs, H, D]`` or state tensor ``[snapshots, *spec.shape]``
    lies in the file, and its checksum."""

    name: str  # kv.{layer}.k / kv.{layer}.v / state.{j}
    offset: int  # of its first byte in the file
    shape: tuple[int, ...]
    dtype: torch.dtype
    checksum: str


@dataclasses.dataclass(frozen=True)
class CacheFileHead:
    """A cache file whose manifest, node table and token ids are checked; its KV is not read yet.

    Holds the file open (the KV is read from the file checked here, even if the path is
    replaced meanwhile): use it as a context manager, or ``close()`` it.
    """

    file: io.RawIOBase
    path: str
    manifest: dict
    algorithm: str  # of the checksums (radixkv.persist.checksum)
    namespaces: list[Hashable]
    nodes: list[list[int]]  # rows of tree.nodes: (parent, namespace, blocks, recency)
    tokens: bytes  # tree.tokens, packed like the tree's edges
    kv: list[FileTensor]  # in file order
    times: IoTimes  # filled on by the KV read and the restore
    snaps: list[int] | None = None  # per node: its snapshot's row in state.{j}, or -1 (None: no states)
    states: list[FileTensor] = dataclasses.field(default_factory=list)  # state.{j}, by j

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> CacheFileHead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def open_cache_file(path: str | os.PathLike, pool, identity: object = None, states=None) -> CacheFileHead:
    """Check ``path``'s header, manifest and tree against ``pool``'s layout (and the StatePool
    ``states``' specs: None for a store without recurrent state) and ``identity``.

    Reads the header and the tree tensors (a few bytes per block), not the KV nor the
    snapshots. Raises CorruptCacheFile (empty, truncated, altered, not a cache file),
    CacheFileMismatch (another format version, identity, layout, states or an unknown
    checksum), FileNotFoundError.
    """
    path = os.fspath(path)
    f = open(path, "rb", buffering=0)  # unbuffered: readinto() lands in our buffers; the head owns it
    try:
        return _open(f, path, pool, identity, states)
    except BaseException:
        f.close()
        raise


def _open(f, path: str, pool, identity: object, states) -> CacheFileHead:
    times, started = IoTimes(), time.perf_counter()
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        raise CorruptCacheFile(f"cache file {path} is empty")
    header = _read_header(f, size, path)
    manifest = from_metadata(header.pop("__metadata__", None))
    check_compatible(manifest, pool, identity, states)
    algorithm = algorithm_of(manifest)
    counts = manifest.get("counts")
    n, nb = count_field(counts, "nodes"), count_field(counts, "blocks")
    if count_field(counts, "tokens") != nb * pool.block_size:
        raise CorruptCacheFile("cache file manifest: counts.tokens is not blocks * block_size")
    ns = count_field(counts, "snapshots") if states is not None else 0
    expected = expected_tensors(manifest["layout"], {"nodes": n, "blocks": nb, "snapshots": ns})
    if set(header) != set(expected):
        raise CorruptCacheFile(f"cache file holds tensors {sorted(header)}, expected {sorted(expected)}")
    checksums = manifest.get("checksums")
    if not isinstance(checksums, dict):
        raise CorruptCacheFile("cache file manifest has no checksums")
    data_start = f.tell()
    tree, kv, state = {}, [], []
    for name, (shape, dtype_name) in expected.items():
        dtype = getattr(torch, dtype_name)
        begin = _checked_entry(name, header[name], shape, dtype_name, dtype) + data_start
        if name.startswith(("kv.", "state.")):
            (kv if name.startswith("kv.") else state).append(
                FileTensor(name, begin, shape, dtype, checksums.get(name))
            )
            continue
        t = torch.empty(shape, dtype=dtype)
        f.seek(begin)
        view = memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")
        if f.readinto(view) != len(view):  # a few bytes per block: one read
            raise CorruptCacheFile(f"cache file {path} ended inside a tensor (truncated while read?)")
        hasher = new_hasher(algorithm)
        hasher.update(view)
        if hasher.hexdigest() != checksums.get(name):
            raise CorruptCacheFile(
                f"cache file tensor {name} does not match its checksum (the file was altered)"
            )
        tree[name] = t
    namespaces = decode_namespaces(manifest.get("namespaces"))
    nodes = tree["tree.nodes"].tolist()
    _check_structure(nodes, len(namespaces), nb)
    snaps = None
    if states is not None:
        snaps = tree["tree.snaps"].tolist()
        _check_snapshot_rows(snaps, ns)
    times.read += time.perf_counter() - started
    return CacheFileHead(
        f,
        path,
        manifest,
        algorithm,
        list(namespaces),
        nodes,
        tree["tree.tokens"].numpy().tobytes(),
        sorted(kv, key=lambda t: t.offset),
        times,
        snaps,
        sorted(state, key=lambda t: int(t.name.split(".")[1])),
    )


def _checked_entry(name: str, entry: dict, shape: tuple[int, ...], dtype_name: str, dtype) -> int:
    """The tensor's start in the data section; CorruptCacheFile unless its entry is as expected."""
    begin, end = _offsets(entry)
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if (
        entry.get("dtype") != ST_DTYPES.get(dtype_name)
        or entry.get("shape") != list(shape)
        or end - begin != size
    ):
        raise CorruptCacheFile(
            f"cache file tensor {name} is {entry.get('dtype')} {entry.get('shape')} "
            f"({end - begin} bytes), expected {dtype_name} {list(shape)}"
        )
    return begin


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


def _check_snapshot_rows(snaps: list[int], num_snapshots: int) -> None:
    """Raise CorruptCacheFile unless every snapshot row is some node's, once, in node order."""
    rows = [r for r in snaps if r != -1]
    if rows != list(range(num_snapshots)):
        raise CorruptCacheFile(
            f"cache file tree.snaps: the nodes' snapshot rows are not 0..{num_snapshots - 1} in node "
            "order, each once (-1: none)"
        )
