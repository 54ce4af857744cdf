"""Disk I/O overlapped with hashing: a writer thread behind a save, reader threads ahead of a restore.

A cache file's bytes go through three steps each way (save: gather from the pool, hash,
write; restore: read, hash, copy into the pool). One thread doing them in turn made a save
about half as fast as ``cp`` + fsync. Here the file I/O runs in its own threads and the
caller's thread gathers and hashes: ``write()``, ``readinto()`` and ``os.preadv`` release the
GIL, and so do torch's copies and the hashers of radixkv.persist.checksum, so the threads use
both cores. A restore reads with two threads (``READERS``), alternate pieces each, straight
into the pool's blocks: into a new store's pool the read is the first touch of its memory,
and its page faults, which bound such a restore on the test VM, are then taken on both cores;
each reader first commits the pages of the piece it reads into with one ``madvise``
(radixkv.persist.populate), not one fault per 4 KiB inside the read.

``IoTimes`` records how long each step was busy (steps of two threads overlap, so they may
sum to more than ``total``; ``read`` adds up both readers): what benchmarks/bench_persist.py
prints as "where the time goes", and what the demo's shutdown save uses to estimate how much
it can write in time.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from radixkv.persist.populate import populate


@dataclasses.dataclass
class IoTimes:
    """Seconds each step of one save or restore was busy; filled in as it runs."""

    gather: float = 0.0  # save: pool blocks copied into write buffers (none for runs written in place)
    hash: float = 0.0  # checksums (save and restore)
    write: float = 0.0  # save: write() into the page cache (writer thread)
    fsync: float = 0.0  # save: fsync of the file and of its directory
    read: float = 0.0  # restore: reads from the file (reader threads, their busy times added)
    copy: float = 0.0  # restore: checked blocks copied into the pools (under the store's lock)
    total: float = 0.0  # wall-clock seconds of the whole save or restore


class Writer:
    """Writes views to a file, in order, from its own thread.

    ``put(view, buffer)`` queues ``view``; ``buffer``, one of the tensors ``take()`` handed out
    (or None for memory the caller keeps stable itself, e.g. pinned pool blocks), comes back
    from ``take()`` once written. Views go to the thread in batches of at least ``batch_bytes``,
    fewer thread hand-offs than one per 1 MiB pool run (a 256 MiB save: 0.273 s against 0.284 s,
    median of 8 interleaved, on the loaded 2-core machine). A write error is raised by the next
    ``put`` or by ``close``; buffers keep coming back after one, so no caller waits forever.
    """

    def __init__(
        self,
        f,
        times: IoTimes,
        num_buffers: int = 4,
        buffer_bytes: int = 4 << 20,
        batch_bytes: int = 16 << 20,
    ) -> None:
        self._f, self._times, self._batch_bytes = f, times, batch_bytes
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(num_buffers):
            self._free.put(torch.empty(buffer_bytes, dtype=torch.uint8))
        self._todo: queue.Queue = queue.Queue(maxsize=2)  # batches: one written, one waiting
        self._batch: list[tuple[memoryview, torch.Tensor | None]] = []
        self._batched = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="radixkv-cache-write", daemon=True)
        self._thread.start()

    def take(self) -> torch.Tensor:
        """A free uint8 buffer (blocks until the writer hands one back)."""
        if self._free.empty():
            self._send()  # the buffers may all be in our own batch
        return self._free.get()

    def put(self, view: memoryview, buffer: torch.Tensor | None = None) -> None:
        if self._error is not None:
            raise self._error
        self._batch.append((view, buffer))
        self._batched += len(view)
        if self._batched >= self._batch_bytes:
            self._send()

    def close(self, *, raise_error: bool = True) -> None:
        """Wait until everything queued is written (or failed); re-raise a write error."""
        if raise_error:
            self._send()
        self._todo.put(None)
        self._thread.join()
        if raise_error and self._error is not None:
            raise self._error

    def _send(self) -> None:
        if self._batch:
            self._todo.put(self._batch)
            self._batch, self._batched = [], 0

    def _run(self) -> None:
        written = advised = 0
        while (batch := self._todo.get()) is not None:
            for view, buffer in batch:
                if self._error is None:
                    started = time.perf_counter()
                    try:
                        self._f.write(view)
                        written += len(view)
                        if written - advised >= WRITE_BEHIND:
                            advised = written
                            _write_behind(self._f, written)
                    except BaseException as e:  # reported to the caller's thread
                        self._error = e
                    self._times.write += time.perf_counter() - started
                if buffer is not None:
                    self._free.put(buffer)


# Every this many bytes the writer asks the kernel to write the file back and drop what is
# written already (posix_fadvise DONTNEED: asynchronous writeback of dirty pages, clean ones
# freed). Without it a 2 GiB save took 3.6-6.7 s against cp + fsync's 1.1-2.1 s on the test
# machine: its new pages came from memory the VM had handed back to the host and its dirty
# pages hit the kernel's throttling; with it 1.3-1.7 s, and the final fsync 0.02 s instead of
# 0.5 s (a shorter tail for a save against a deadline). The saved file is then mostly not in
# the page cache.
WRITE_BEHIND = 64 << 20


def _write_behind(f, written: int) -> None:
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:  # not on macOS / Windows: the kernel writes back as it likes
        f.flush()
        advise(f.fileno(), 0, written, os.POSIX_FADV_DONTNEED)


def read_overlapped(
    f,
    pieces: Sequence[tuple[int, int, memoryview | None]],
    consume: Callable[[int, memoryview, torch.Tensor | None], None],
    times: IoTimes,
    buffer_bytes: int,
    num_buffers: int = 3,
    readers: int | None = None,
) -> None:
    """Read ``pieces`` of ``f`` from reader threads; ``consume`` each in this thread, in order.

    A piece ``(offset, nbytes, view)`` is read into ``view`` (``nbytes`` long) or, when it is
    None, into one of the reader's ``num_buffers`` reused uint8 buffers of ``buffer_bytes``;
    ``consume(index, data, buffer)`` gets the bytes read and that buffer (None for a view),
    which is reused only after ``consume`` returns. Each reader runs ahead by up to its buffers
    in use. Raises EOFError naming the offset when the file ends early (cut short while read),
    whatever a reader or ``consume`` raised, after the readers have stopped.

    ``readers`` (default ``READERS`` where ``os.preadv`` exists, else 1): piece ``i`` is read by
    reader ``i % readers`` with ``os.preadv`` (no shared file position), so the page faults of
    memory touched for the first time are taken on as many cores (see ``READERS``).
    """
    if readers is None:
        readers = READERS if hasattr(os, "preadv") else 1
    readers = max(1, min(readers, len(pieces)))
    fd = f.fileno() if readers > 1 else None
    ready = [queue.Queue() for _ in range(readers)]
    free = [queue.Queue() for _ in range(readers)]  # per reader: no reader waits on another's
    stop = threading.Event()
    busy = [0.0] * readers

    def reader(k: int) -> None:
        try:
            position = None
            for index in range(k, len(pieces), readers):
                offset, nbytes, view = pieces[index]
                buffer = None
                if view is None:
                    if free[k].empty() and len(owned[k]) < num_buffers:  # made when first needed
                        owned[k].append(torch.empty(buffer_bytes, dtype=torch.uint8))
                        free[k].put(owned[k][-1])
                    buffer = free[k].get()
                    if buffer is None:  # stopped: this thread's caller is gone
                        return
                    view = memoryview(buffer.numpy()).cast("B")[:nbytes]
                if fd is None and position != offset:
                    f.seek(offset)
                done = 0
                started = time.perf_counter()
                if buffer is None:  # the pool's own memory: commit its pages in one call
                    populate(view)
                while done < nbytes and not stop.is_set():
                    if fd is None:
                        got = f.readinto(view[done:])
                    else:
                        got = os.preadv(fd, [view[done:]], offset + done)
                    if not got:
                        raise EOFError(f"the file ended at byte {offset + done}, inside a tensor")
                    done += got
                busy[k] += time.perf_counter() - started
                if stop.is_set():
                    return
                position = offset + nbytes
                ready[k].put((index, view, buffer))
        except BaseException as e:
            ready[k].put(e)

    owned: list[list[torch.Tensor]] = [[] for _ in range(readers)]
    threads = [
        threading.Thread(target=reader, args=(k,), name=f"radixkv-cache-read-{k}", daemon=True)
        for k in range(readers)
    ]
    for thread in threads:
        thread.start()
    try:
        for i in range(len(pieces)):
            item = ready[i % readers].get()
            if isinstance(item, BaseException):
                raise item
            index, data, buffer = item
            consume(index, data, buffer)
            if buffer is not None:
                free[i % readers].put(buffer)
    finally:
        stop.set()
        for k in range(readers):
            for _ in range(num_buffers):
                free[k].put(None)  # a reader waiting for a buffer wakes up and stops
        for thread in threads:
            thread.join()
        times.read += sum(busy)


# Reader threads of a restore. A restore into a new store's pool is the first touch of that
# memory: one page fault per 4 KiB, and on the test VM (memory freed a while ago is handed back
# to the host) those faults, not the copy out of the page cache, took most of a 2 GiB restore
# (0.95-4.5 s against 0.35-0.45 s into touched memory). Two readers take them on both cores:
# a 2 GiB restore into a new store, 12 interleaved in one process on the loaded 2-core VM,
# median 1.11 s against 2.37 s with one reader.
READERS = 2
