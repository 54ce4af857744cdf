"""Writing a cache file: pool blocks streamed through a checksum into a file, atomically.

The file is a plain safetensors file (radixkv.persist lists its tensors, radixkv.persist.manifest its
manifest). One pass over the KV: each chunk is hashed (radixkv.persist.checksum) and handed to a
writer thread (radixkv.persist.file_io) while the next one is gathered. Runs of consecutive block
ids in a CPU pool are written straight from the pool, with no copy; other blocks are
gathered ~4 MiB at a time into a few reused buffers, so a save never holds a second copy
of the cache. The header goes first with placeholder checksums of the final length and is
rewritten once the data is written. Then fsync, ``os.replace`` and an fsync of the
directory: ``path`` holds its old content or the whole new file, never a part.

A save can be stopped between chunks (a deadline, a cancel event): ``SaveAborted``, the
temporary file removed, the previous file untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from radixkv.persist.checksum import WRITTEN, new_hasher
from radixkv.persist.file_io import IoTimes, Writer
from radixkv.persist.manifest import dtype_name, to_metadata

ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64"}
CHUNK = 4 << 20  # bytes hashed and written at a time
MIN_RUN_BYTES = 1 << 20  # shorter runs of consecutive blocks are gathered with their neighbours


class SaveAborted(RuntimeError):
    """A save stopped before its file was complete (deadline passed or cancelled); the
    previous file at its path is unchanged and no temporary file is left."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """Saved blocks of one tier, in file order: ``count`` consecutive ids from ``start``
    (``ids`` None), or the scattered ``ids``."""

    tier: int
    start: int
    count: int
    ids: torch.Tensor | None


def pieces_of(ids: Sequence[int], tiers: Sequence[int], min_run: int) -> list[Piece]:
    """Split the saved block list into runs of >= ``min_run`` consecutive ids of one tier
    (written in place) and the blocks between them (gathered). O(len(ids))."""
    out: list[Piece] = []
    loose: list[int] = []
    loose_tier = -1

    def flush() -> None:
        if loose:
            out.append(Piece(loose_tier, loose[0], len(loose), torch.tensor(loose, dtype=torch.int64)))
            loose.clear()

    i, n = 0, len(ids)
    while i < n:
        j = i + 1
        while j < n and ids[j] == ids[j - 1] + 1 and tiers[j] == tiers[i]:
            j += 1
        if j - i >= min_run or tiers[i] != loose_tier:
            flush()
        if j - i >= min_run:
            out.append(Piece(tiers[i], ids[i], j - i, None))
        else:
            loose_tier = tiers[i]
            loose.extend(ids[i:j])
        i = j
    flush()
    return out


class Gathered:
    """One KV tensor of a save: blocks of per-tier pool tensors ``[num_blocks, bs, H, D]``.

    ``storages[t]`` is tier t's tensor (device pool, host pool); ``pieces`` (``pieces_of``)
    say which blocks, in file order. Read while the file is written: the caller keeps the
    blocks from being evicted, demoted or rewritten meanwhile (pins).
    """

    def __init__(self, storages: Sequence[torch.Tensor], pieces: Sequence[Piece], num_blocks: int) -> None:
        self.storages, self.pieces = tuple(storages), pieces
        self.shape = (num_blocks, *storages[0].shape[1:])
        self.dtype = storages[0].dtype
        self.block_bytes = math.prod(self.shape[1:]) * storages[0].element_size()

    def chunks(self, take: Callable[[], torch.Tensor]) -> Iterator[tuple[memoryview, torch.Tensor | None]]:
        """``(bytes, buffer)`` in file order: a run of a CPU pool in place (buffer None), else
        blocks copied into ``take()``'s uint8 buffer (>= one block), which is yielded along."""
        for piece in self.pieces:
            storage = self.storages[piece.tier]
            cap = max(1, CHUNK // self.block_bytes)
            for at in range(0, piece.count, cap):
                n = min(cap, piece.count - at)
                host = _host_memory(storage)
                if piece.ids is None and host:
                    yield _bytes(storage[piece.start + at : piece.start + at + n]), None
                    continue
                buffer = take()
                out = buffer[: n * self.block_bytes].view(self.dtype).view(n, *self.shape[1:])
                if piece.ids is None:  # a run of a GPU pool: one device-to-host copy
                    out.copy_(storage[piece.start + at : piece.start + at + n])
                elif host:
                    torch.index_select(storage, 0, piece.ids[at : at + n], out=out)
                else:
                    out.copy_(storage.index_select(0, piece.ids[at : at + n].to(storage.device)))
                yield _bytes(out), buffer


def _host_memory(storage: torch.Tensor) -> bool:
    """Whether ``storage``'s blocks can be written from where they are (CPU memory)."""
    return storage.device.type == "cpu"


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy()).cast("B")


def nbytes(t: torch.Tensor | Gathered) -> int:
    return math.prod(t.shape) * torch.empty((), dtype=t.dtype).element_size()


def _chunks(t: torch.Tensor | Gathered, take) -> Iterator[tuple[memoryview, torch.Tensor | None]]:
    if isinstance(t, Gathered):
        yield from t.chunks(take)
        return
    view = _bytes(t)
    for at in range(0, len(view), CHUNK):
        yield view[at : at + CHUNK], None


def _header(tensors: dict[str, torch.Tensor | Gathered], manifest: dict) -> bytes:
    """The safetensors header (JSON, space-padded to 8 bytes) for ``tensors`` in order."""
    entries: dict[str, object] = {"__metadata__": to_metadata(manifest)}
    at = 0
    for name, t in tensors.items():
        size = nbytes(t)
        entries[name] = {
            "dtype": ST_DTYPES[dtype_name(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [at, at + size],
        }
        at += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _write_tensors(
    tensors: dict[str, torch.Tensor | Gathered],
    manifest: dict,
    path: str,
    times: IoTimes,
    stop: Callable[[], str | None],
    pace: Callable[[int], None] | None = None,
) -> None:
    """Write ``tensors`` as safetensors to ``path``, filling ``manifest["checksum(s)"]`` on the way.

    Raises SaveAborted as soon as ``stop()`` gives a reason (checked between chunks);
    ``pace(nbytes)`` is called after each chunk (it may sleep: a background save's rate).
    """
    manifest["checksum"] = WRITTEN
    manifest["checksums"] = {name: "0" * 64 for name in tensors}
    header = _header(tensors, manifest)
    f = open(path, "wb")  # closed below: its time counts with the fsync
    try:
        _write_all(f, tensors, manifest, header, times, stop, pace)
    finally:
        closing = time.perf_counter()
        f.close()  # may write the data back here rather than in the fsync
        times.fsync += time.perf_counter() - closing


def _write_all(f, tensors, manifest: dict, header: bytes, times: IoTimes, stop, pace) -> None:
    block_bytes = max((t.block_bytes for t in tensors.values() if isinstance(t, Gathered)), default=0)
    f.write(len(header).to_bytes(8, "little"))
    f.write(header)
    writer = Writer(f, times, buffer_bytes=max(CHUNK, block_bytes))
    try:  # nothing may read the pool blocks after we return: the writer is joined either way
        for name, t in tensors.items():
            digest = new_hasher(WRITTEN)
            pieces = _chunks(t, writer.take)
            while True:
                if (why := stop()) is not None:
                    raise SaveAborted(f"save stopped ({why}) while writing {name}")
                started = time.perf_counter()
                item = next(pieces, None)
                hashed = time.perf_counter()
                times.gather += hashed - started
                if item is None:
                    break
                digest.update(item[0])
                times.hash += time.perf_counter() - hashed
                writer.put(*item)
                if pace is not None:
                    pace(len(item[0]))
            manifest["checksums"][name] = digest.hexdigest()
    except BaseException:
        writer.close(raise_error=False)
        raise
    writer.close()  # raises a write error of the last chunks
    final = _header(tensors, manifest)
    if len(final) != len(header):  # cannot happen: both digests are 64 hex digits
        raise RuntimeError("cache file header changed length")
    f.seek(8)
    f.write(final)


def atomic_save(
    tensors: dict[str, torch.Tensor | Gathered],
    manifest: dict,
    path: str,
    *,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    max_rate: float | None = None,
) -> IoTimes:
    """Write a cache file so ``path`` holds either its old content or the whole new one.

    Temporary file in the same directory (a rename across file systems is not atomic),
    fsync, ``os.replace``, fsync of the directory (so the rename itself survives a power
    loss). The file is created owner-only (0600): it holds users' token ids. ``deadline``
    (``time.monotonic()`` seconds) and ``cancel`` stop the save between chunks and before the
    fsync: SaveAborted. An fsync itself cannot be interrupted. ``max_rate`` (bytes/s): sleep
    between chunks so the KV goes at most that fast (a save in the background of requests:
    its memory traffic spread thin). Returns where the time went.
    """
    times, started = IoTimes(), time.perf_counter()

    def stop() -> str | None:
        if cancel is not None and cancel.is_set():
            return "cancelled"
        if deadline is not None and time.monotonic() >= deadline:
            return "deadline passed"
        return None

    paced = [0]

    def pace(nbytes: int) -> None:
        paced[0] += nbytes
        ahead = paced[0] / max_rate - (time.perf_counter() - started)
        if deadline is not None:  # a pause never runs past the deadline: stop() ends the save then
            ahead = min(ahead, deadline - time.monotonic())
        if ahead > 0:
            cancel.wait(ahead) if cancel is not None else time.sleep(ahead)

    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        _write_tensors(tensors, manifest, tmp, times, stop, pace if max_rate else None)
        if (why := stop()) is not None:
            raise SaveAborted(f"save stopped ({why}) before the fsync")
        synced = time.perf_counter()
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync(directory)
    times.fsync += time.perf_counter() - synced
    times.total = time.perf_counter() - started
    return times


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
