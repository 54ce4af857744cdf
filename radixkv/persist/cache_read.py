"""Reading a cache file's KV straight into the blocks a restore chose, checking every byte.

A restore decides first where each block of the file goes (radixkv.persist.restore: free blocks of
the device or host pool, held privately; a staging buffer for blocks that need room made
first; or nowhere, for blocks dropped or cached already). ``read_kv`` then reads each KV
tensor once, in file order, from a reader thread (radixkv.persist.file_io) while this thread hashes:
runs of blocks bound for consecutive blocks of a CPU tensor are read in place, with no copy;
blocks for a GPU pool pass through a small bounce buffer; blocks going nowhere through a
scratch buffer. Every byte, kept or not, goes through its tensor's checksum, and ``read_kv``
raises CorruptCacheFile unless all of them match. The blocks it writes hold no cached data
until then (the tree does not reference them): a refused file changes nothing a store holds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import torch

from radixkv.persist.cache_file import CacheFileHead
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


def read_kv(head: CacheFileHead, runs: Sequence[Run], dests: Sequence) -> None:
    """Read every KV tensor of ``head``'s file into ``dests`` along ``runs`` and check it.

    ``dests[d]`` has ``k`` and ``v``: per layer ``[blocks, bs, H, D]`` tensors of the file's
    layout (a BlockPool, or staging tensors), on any device. ``runs`` cover the file's blocks in
    order. Raises CorruptCacheFile when a checksum differs or the file ends early (the blocks
    written so far hold garbage: the caller frees them).
    """
    pieces: list[tuple[int, int, memoryview | None]] = []
    targets: list[tuple[int, torch.Tensor | None]] = []  # per piece: tensor index, device target
    largest = CHUNK
    for index, t in enumerate(head.kv):
        _, layer, kind = t.name.split(".")
        block_bytes = math.prod(t.shape[1:]) * torch.empty((), dtype=t.dtype).element_size()
        largest = max(largest, block_bytes)
        cap = max(1, CHUNK // block_bytes)
        for run in runs:
            for at in range(0, run.count, cap):
                n = min(cap, run.count - at)
                offset, nbytes = t.offset + (run.row + at) * block_bytes, n * block_bytes
                if run.dest is None:
                    pieces.append((offset, nbytes, None))
                    targets.append((index, None))
                    continue
                first = run.start + at
                into = getattr(dests[run.dest], kind)[int(layer)][first : first + n]
                if _in_place(into):
                    pieces.append(
                        (offset, nbytes, memoryview(into.view(-1).view(torch.uint8).numpy()).cast("B"))
                    )
                    targets.append((index, None))
                else:
                    pieces.append((offset, nbytes, None))
                    targets.append((index, into))
    hashers = [new_hasher(head.algorithm) for _ in head.kv]
    times = head.times

    def consume(i: int, data: memoryview, buffer: torch.Tensor | None) -> None:
        index, into = targets[i]
        started = time.perf_counter()
        hashers[index].update(data)
        hashed = time.perf_counter()
        times.hash += hashed - started
        if into is not None:  # a GPU pool: the checked bytes go on from the bounce buffer
            into.copy_(buffer[: len(data)].view(into.dtype).view(into.shape))
            times.copy += time.perf_counter() - hashed

    try:
        read_overlapped(head.file, pieces, consume, times, largest)
    except EOFError:
        raise CorruptCacheFile(
            f"cache file {head.path} ended inside a tensor (truncated while read?)"
        ) from None
    for t, hasher in zip(head.kv, hashers):
        if hasher.hexdigest() != t.checksum:
            raise CorruptCacheFile(
                f"cache file tensor {t.name} does not match its checksum (the file was altered)"
            )
