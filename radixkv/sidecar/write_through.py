"""Write-through to a sidecar, in the background (owned by ``client.SidecarTier``).

Every commit of the tier's store queues its key (``push``); one thread per tier pins the local
blocks, asks the sidecar which blocks it lacks (``alloc``: slots private to this client), copies
them from the local pools into the shared pool and commits them (visible to others only then).
A store with states sends the positions of the snapshots on the pinned path with its ``alloc``
and copies those the sidecar lacks from its state pools (device or host, as each node lives)
into the state slots it is given: the pin keeps them from being evicted or moved meanwhile.
Bounded: at most ``max_queue`` commits wait; more are dropped (counted). Why write-through, not
on eviction: another process can read a prefix as soon as it is computed (a replica's first
request on a document, ranks sharing a prompt); on eviction it would reach the sidecar only once
this process's pool is full, and never from a process that exits.

Counters (the tier's): ``written_commits`` (commits the sidecar holds now), ``written_blocks``,
``written_snapshots``,
``failed_writes`` (not made: refused, never sent, or the sidecar gone before its reply),
``dropped_writes``. A commit sent that waits out its timeout is neither yet: it is *unsettled*
(the tier's ``sidecar_unsettled_writes``) until its reply is read, then counted written (and in
``late_writes``: it landed after its call gave up) or failed (refused, or the connection closed
first: whether the sidecar committed it then is unknown). A commit whose alloc came from an
earlier connection is never sent (``stale_commits``, and failed). A write whose commit fails is
aborted (queued like a release): a sidecar never expires a transaction.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
from collections.abc import Hashable

from radixkv.sidecar.connection import SidecarDown, SidecarTimeout
from radixkv.store.tier import copy_blocks
from radixkv.tree.node import PackedTokens

logger = logging.getLogger(__name__)

EXIT_FLUSH_S = 5.0


class WriteThrough:
    """The queue and background writer of one ``SidecarTier`` (``tier``: its calls, store and
    counters)."""

    def __init__(self, tier, max_queue: int) -> None:
        self.tier = tier
        self.max_queue = max_queue
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def push(self, tokens: PackedTokens, namespace: Hashable) -> None:
        """Queue a committed key (returns at once; dropped when the queue is full)."""
        key = self.tier.namer(namespace)
        if key is None:
            return
        with self._cond:
            if len(self._queue) >= self.max_queue:
                self.tier.counters["dropped_writes"] += 1
                return
            self._queue.append((tokens, namespace, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="radixkv-sidecar-writer", daemon=True)
                self._thread.start()
                # A process that commits and exits (a batch rank, a script) still hands its last
                # prefixes over; bounded, so a hung sidecar cannot hold the exit for long.
                atexit.register(self.flush, EXIT_FLUSH_S)
            self._cond.notify()

    def after_fork(self) -> None:
        """In a forked child (``radixkv.sidecar.forks``): the parent's writer thread does not run
        here and its queued commits are the parent's to write: an empty queue, a fresh lock (the
        thread may have held the old one); the next push starts this process's thread."""
        self._queue = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._thread = None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is done or dropped; False on timeout."""
        self.tier.check_fork()  # also at exit (atexit): never wait on a parent thread's lock
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def drain(self, timeout: float) -> tuple[int, int]:
        """Flush for at most ``timeout`` seconds, then drop what still waits: for a process about
        to exit without running its ``atexit`` hooks (the demo's ``os._exit``). Returns (commits
        written to the sidecar meanwhile, commits lost: dropped here, failed, or still being
        written at the timeout, unsettled commits included: not known to land). A dead sidecar
        fails every write at once (connection refused); a hung one costs at most ``timeout``."""
        counters = self.tier.counters
        before = counters["written_commits"], counters["failed_writes"]
        done = self.flush(timeout)
        with self._cond:
            lost = len(self._queue) + (0 if done else int(self._busy))
            counters["dropped_writes"] += len(self._queue)
            self._queue.clear()
        # read without the tier's lock (a call blocked on a hung sidecar holds it past the bound):
        # a late reply settled between these reads may be counted in neither or both
        written = counters["written_commits"] - before[0]
        unsettled = self.tier.stats()["sidecar_unsettled_writes"]
        return written, lost + counters["failed_writes"] - before[1] + unsettled

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                item = self._queue.popleft()
                self._busy = True
            try:
                self._write(*item)
            except Exception as e:  # never let a bug here stop later writes; reads are unaffected
                self.tier.counters["failed_writes"] += 1
                logger.warning("radixkv: sidecar write failed: %s", e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, tokens: PackedTokens, namespace: Hashable, key: tuple[bytes, bytes]) -> None:
        tier, store, counters = self.tier, self.tier.store, self.tier.counters
        with store.acquire(tokens, namespace, count=False, remote=False) as lease:
            if lease.num_tokens == 0:
                return  # evicted (or flushed) since the commit
            held = tokens.head(lease.num_tokens)
            header = {"op": "alloc", "ident": key[0].hex(), "ns": key[1].decode()}
            snaps = store.path_snapshots(lease) if store.states is not None else []
            if snaps:
                header["snaps"] = [pos for pos, _, _ in snaps]
            try:
                answer, view, generation = tier.call(header, bytes(held))
            except (SidecarDown, ValueError):
                counters["failed_writes"] += 1
                return
            slots, start, txn = answer["slots"], answer["start"], answer["txn"]
            given = answer.get("snaps") or [-1] * len(snaps)
            wanted = [(snap, dst) for snap, dst in zip(snaps, given) if dst >= 0]
            if not txn:  # the sidecar holds it all already, or its pool is pinned full
                has_all = start * tier.layout["block_size"] >= held.num_tokens
                counters["written_commits" if has_all else "failed_writes"] += 1
                return
            try:
                ids = list(lease.block_ids)
                first_host = len(ids) - lease.num_host_blocks
                span = range(start, start + len(slots))
                dev = [(ids[j], s) for j, s in zip(span, slots) if j < first_host]
                host = [(ids[j], s) for j, s in zip(span, slots) if j >= first_host]
                if dev:
                    copy_blocks(store.pool, [a for a, _ in dev], view, [b for _, b in dev])
                if host:
                    copy_blocks(store.host_pool, [a for a, _ in host], view, [b for _, b in host])
                for (_pos, tier_index, slot), dst in wanted:
                    local = store.host_states if tier_index else store.states
                    local.copy_to(slot, view.states, dst)
            except BaseException:
                tier.tell({"op": "abort", "txn": txn}, generation)
                raise

        def landed(answer: dict | None) -> None:  # the reply after the commit's call gave up
            if answer is not None and "error" not in answer:
                counters["late_writes"] += 1
                counters["written_blocks"] += len(slots)
                counters["written_snapshots"] += answer.get("snapshots", 0)
                counters["written_commits"] += 1
            else:
                counters["failed_writes"] += 1

        try:
            done, _, _ = tier.call({"op": "commit", "txn": txn}, generation=generation, on_late=landed)
            counters["written_blocks"] += len(slots)
            counters["written_snapshots"] += done.get("snapshots", 0)
            counters["written_commits"] += 1
        except (SidecarDown, ValueError) as e:
            if not (isinstance(e, SidecarTimeout) and e.owed and e.op == "commit"):  # landed() counts
                counters["failed_writes"] += 1
            # A commit never sent (a reply still owed, or the connection held past the timeout)
            # would leave the transaction open, its slots and pinned node held for the life of
            # the connection. Abort it (queued, never waits; dropped with an older connection);
            # after a commit that was sent and lands late the abort is a no-op (the sidecar's
            # transaction ids are never reused).
            tier.tell({"op": "abort", "txn": txn}, generation)
