"""Reading a cache file's KV (and snapshots) straight into the blocks (state slots) a restore
chose, checking every byte.

A restore decides first where each block of the file goes (radixkv.persist.restore: free blocks of
the device or host pool, held privately; a staging buffer for blocks that need room made
first; or nowhere, for blocks dropped or cached already). ``read_kv`` then reads each KV
tensor once, in file order, from two reader threads (radixkv.persist.file_io) while this thread hashes:
runs of blocks bound for consecutive blocks of a CPU tensor are read in place, with no copy;
blocks for a GPU pool pass through a small bounce buffer; blocks going nowhere through a
scratch buffer. Every byte, kept or not, goes through its tensor's checksum, and ``read_kv``
raises CorruptCacheFile unless all of them match. The blocks it writes hold no cached data
until then (the tree does not reference them): a refused file changes nothing a store holds.
``read_states`` does the same for the ``state.{j}`` tensors, a snapshot a row, into state
pool slots the restore holds privately (``read_rows`` is the loop both use).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import torch

from radixkv.persist.cache_file import CacheFileHead, FileTensor
from radixkv.persist.checksum import new_hasher
from radixkv.persist.file_io import read_overlapped
from radixkv.persist.manifest import CorruptCacheFile

CHUNK = 8 << 20  # bytes per read: large enough that the per-read Python cost vanishes


@dataclasses.dataclass(frozen=True)
class Run:
    """File blocks ``[row, row + count)`` go to blocks ``[start, start + count)`` of destination
    ``dest`` (an index into ``read_kv``'s ``dests``), or nowhere when ``dest`` is None."""

    row: int
    count: int
    dest: int | None
    start: int = 0


def runs_of(targets: Sequence[tuple[int | None, int]]) -> list[Run]:
    """Runs from one ``(dest, block)`` per file block: consecutive blocks of one destination
    merge (blocks going nowhere always do). O(len(targets))."""
    out: list[Run] = []
    for row, (dest, block) in enumerate(targets):
        last = out[-1] if out else None
        if last is not None and last.dest == dest and (dest is None or last.start + last.count == block):
            out[-1] = dataclasses.replace(last, count=last.count + 1)
        else:
            out.append(Run(row, 1, dest, block if dest is not None else 0))
    return out


def _in_place(into: torch.Tensor) -> bool:
    """Whether the file's bytes can be read straight into ``into`` (CPU memory), not bounced."""
    return into.device.type == "cpu"


@dataclasses.dataclass(frozen=True)
class _Window:
    """File blocks ``[row, row + count)`` read at once: in place into one run of one destination
    (``in_place``), or into a buffer and copied on, per destination, as ``(dest, rows in the
    window, blocks)`` (blocks going nowhere are only hashed)."""

    row: int
    count: int
    in_place: Run | None
    copies: tuple[tuple[int, torch.Tensor, torch.Tensor], ...] = ()


def _windows(runs: Sequence[Run], cap: int, in_place: Sequence[bool]) -> list[_Window]:
    """Cut ``runs`` into windows of at most ``cap`` blocks: a run of at least ``cap // 4`` blocks
    into a destination that can be read into (``in_place[dest]``) gets windows of its own, read
    in place; shorter runs (a fragmented free list) and blocks going nowhere share windows, read
    into a buffer and copied on with one indexed copy per destination. O(blocks)."""
    out: list[_Window] = []
    pending: list[tuple[int, Run]] = []  # (first row of the part, part) of a shared window
    filled = 0

    def flush() -> None:
        nonlocal pending, filled
        if not pending:
            return
        row = pending[0][0]
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for first, part in pending:
            if part.dest is not None:
                rows, blocks = groups.setdefault(part.dest, ([], []))
                rows.extend(range(first - row, first - row + part.count))
                blocks.extend(range(part.start, part.start + part.count))
        copies = tuple((d, torch.tensor(r), torch.tensor(b)) for d, (r, b) in groups.items())
        out.append(_Window(row, filled, None, copies))
        pending, filled = [], 0

    for run in runs:
        if run.dest is not None and in_place[run.dest] and run.count >= max(1, cap // 4):
            flush()
            for at in range(0, run.count, cap):
                n = min(cap, run.count - at)
                out.append(_Window(run.row + at, n, Run(run.row + at, n, run.dest, run.start + at)))
            continue
        at = 0
        while at < run.count:
            n = min(run.count - at, cap - filled)
            start = run.start + at if run.dest is not None else 0
            pending.append((run.row + at, Run(run.row + at, n, run.dest, start)))
            filled += n
            at += n
            if filled == cap:
                flush()
    flush()
    return out


def read_kv(head: CacheFileHead, runs: Sequence[Run], dests: Sequence) -> None:
    """Read every KV tensor of ``head``'s file into ``dests`` along ``runs`` and check it.

    ``dests[d]`` has ``k`` and ``v``: per layer ``[blocks, bs, H, D]`` tensors of the file's
    layout (a BlockPool, or staging tensors), on any device (None where no run goes). ``runs``
    cover the file's blocks in order. Raises CorruptCacheFile when a checksum differs or the
    file ends early (the blocks written so far hold garbage: the caller frees them).
    """

    def into(index: int, dest: int) -> torch.Tensor:
        _, layer, kind = head.kv[index].name.split(".")
        return getattr(dests[dest], kind)[int(layer)]

    in_place = [d is not None and bool(d.k) and _in_place(d.k[0]) for d in dests]
    read_rows(head, head.kv, runs, into, in_place)


def read_states(head: CacheFileHead, runs: Sequence[Run], dests: Sequence) -> None:
    """Read every ``state.{j}`` tensor of ``head``'s file into ``dests`` along ``runs`` and check it.

    ``dests[d]``: per state spec j a ``[slots, *spec.shape]`` tensor (a StatePool's ``tensors``,
    or staging tensors), on any device (None where no run goes); ``runs`` cover the file's
    snapshot rows in order. Raises as ``read_kv`` (the slots written so far hold garbage)."""
    in_place = [d is not None and _in_place(d[0]) for d in dests]
    read_rows(head, head.states, runs, lambda j, dest: dests[dest][j], in_place)


def read_rows(
    head: CacheFileHead,
    tensors: Sequence[FileTensor],
    runs: Sequence[Run],
    into: Callable[[int, int], torch.Tensor],
    in_place: Sequence[bool],
) -> None:
    """Read ``tensors`` (all with the same number of rows, in file order) along ``runs`` and
    check each one's checksum: row r goes to row ``start`` of ``into(tensor index, dest)``,
    read straight into it where ``in_place[dest]`` (CPU memory) and the run is long, else
    through a buffer and an indexed copy; rows going nowhere are only hashed."""
    windows: dict[int, list[_Window]] = {}  # by rows per window
    pieces: list[tuple[int, int, memoryview | None]] = []
    plans: list[tuple[int, _Window]] = []  # tensor index, window
    largest = CHUNK
    for index, t in enumerate(tensors):
        row_bytes = math.prod(t.shape[1:]) * torch.empty((), dtype=t.dtype).element_size()
        largest = max(largest, row_bytes)
        cap = max(1, CHUNK // row_bytes)
        if cap not in windows:
            windows[cap] = _windows(runs, cap, in_place)
        for w in windows[cap]:
            view = None
            if w.in_place is not None:
                dest = into(index, w.in_place.dest)[w.in_place.start : w.in_place.start + w.count]
                view = memoryview(dest.view(-1).view(torch.uint8).numpy()).cast("B")
            pieces.append((t.offset + w.row * row_bytes, w.count * row_bytes, view))
            plans.append((index, w))
    hashers = [new_hasher(head.algorithm) for _ in tensors]
    times = head.times

    def consume(i: int, data: memoryview, buffer: torch.Tensor | None) -> None:
        index, w = plans[i]
        started = time.perf_counter()
        hashers[index].update(data)
        hashed = time.perf_counter()
        times.hash += hashed - started
        if w.copies:  # the checked bytes go on from the buffer (a fragmented pool, a GPU pool)
            first = into(index, w.copies[0][0])
            staged = buffer[: len(data)].view(first.dtype).view(w.count, *first.shape[1:])
            for dest, rows, blocks in w.copies:
                target = into(index, dest)
                target.index_copy_(
                    0, blocks.to(target.device), staged.index_select(0, rows).to(target.device)
                )
            times.copy += time.perf_counter() - hashed

    try:
        read_overlapped(head.file, pieces, consume, times, largest)
    except EOFError:
        raise CorruptCacheFile(
            f"cache file {head.path} ended inside a tensor (truncated while read?)"
        ) from None
    for t, hasher in zip(tensors, hashers):
        if hasher.hexdigest() != t.checksum:
            raise CorruptCacheFile(
                f"cache file tensor {t.name} does not match its checksum (the file was altered)"
            )
