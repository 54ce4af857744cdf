"""A sidecar as a tier behind a ``KVStore``'s own pools (the client side of ``radixkv.sidecar``).

    tier = SidecarTier("/run/radixkv.sock", pool, namer)     # pool: the store's device pool
    store = KVStore(pool, host_pool, remote=tier)
    # a model with recurrent layers: its snapshots travel too
    tier = SidecarTier(path, pool, namer, states=states)
    store = KVStore(pool, host_pool, remote=tier, states=states, host_states=host_states)

- Reads: a prompt whose local match is shorter than its whole blocks asks the sidecar for the
  rest (``lookup``: one round trip); the sidecar pins what it holds until the lease is released,
  and ``KVStore.read`` copies those blocks straight from the shared-memory pool into the caller's
  buffers (one copy, as a host-tier hit). Nothing is promoted into the local pool: the commit after
  generate() caches the whole sequence locally from the caller's buffers anyway. For a store
  with states the sidecar's match ends at its deepest snapshot, which the lease pins too
  (``RemoteHit.snap``; ``KVStore.read_state`` copies it from the shared slots).
- Writes (write-through, ``write_through.WriteThrough``): every commit queues its key
  (``push``); a background thread copies the blocks (and snapshots) the sidecar lacks into the
  shared pool.
- Prefixes in flight (``wait_s`` > 0, ``RADIXKV_SIDECAR_WAIT_S``): a request's lookup claims what
  it misses; a lookup that finds another process's claim over its prefix polls for that
  process's commit instead of computing the prefix again (``lookup``).
- Faults: a sidecar that is gone (killed, not started yet) turns every call into "no hit" and
  "not written"; one warning is logged, and a connect is retried with backoff (0.1 s doubling to
  ``max_retry_s``) on the next calls: a new sidecar on the socket is used again without a restart.
  Blocks a lease pinned stay mapped, so a read in flight when the sidecar dies still reads the
  bytes it pinned (no process writes them any more).
- Timeouts (``connection``): ``connect_timeout_s`` (``RADIXKV_SIDECAR_CONNECT_TIMEOUT_S``, 5 s)
  bounds attaching, ``timeout_s`` (``RADIXKV_SIDECAR_TIMEOUT_S``, 10 s) each call, waiting for
  another thread's call on the socket included. A call past it is a miss or a write not made,
  with one warning naming the socket and the timeout; the connection, its pins and claims stay
  (a sidecar that is only slow keeps its client), later calls skip the sidecar at once until
  the late reply arrives, and that reply is read and undone, never taken for another call's,
  by a background settler (``_settle_loop``) even when no call follows.
- fork(): a child drops the parent's connection without a word on it and connects again on its
  next call (``forks``, ``_after_fork``).

``namer(store namespace) -> (identity digest, namespace key) | None`` maps the store's keys to
the sidecar's (hf_patch: the model's identity and the encoded namespace); None keeps a key local.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Hashable

from radixkv.persist.manifest import layout_of
from radixkv.sidecar import forks
from radixkv.sidecar.connection import Connection, OnLate, SidecarDown, SidecarTimeout
from radixkv.sidecar.protocol import ProtocolError
from radixkv.sidecar.shared_view import SharedBlockPool, shared_pool_view
from radixkv.sidecar.write_through import WriteThrough
from radixkv.store.pool import BlockPool
from radixkv.store.state_pool import StatePool
from radixkv.tree.node import PackedTokens

logger = logging.getLogger(__name__)

TIMEOUT_S = 10.0  # per call (RADIXKV_SIDECAR_TIMEOUT_S)
CONNECT_TIMEOUT_S = 5.0  # connect + hello (RADIXKV_SIDECAR_CONNECT_TIMEOUT_S)
# store.stats() carries each as sidecar_<name> (docs/sidecar.md), 0 until counted
COUNTERS = ("connects", "disconnects", "timeouts", "skipped_calls", "late_replies", "refused", "waited",
            "wait_timeouts", "written_commits", "written_blocks", "written_snapshots", "failed_writes",
            "dropped_writes", "late_writes", "stale_commits")  # fmt: skip
POLL_S = 0.01  # between polls for a prefix another process is computing
SETTLE_S = 0.05  # between the settler's catch-ups while a reply is owed
MIN_CALL_S = 1.0  # a call's own time on the connection at least, however long it waited for it
Namer = Callable[[Hashable], "tuple[bytes, bytes] | None"]

__all__ = ["RemoteHit", "SidecarDown", "SidecarTier", "SidecarTimeout"]


@dataclasses.dataclass
class RemoteHit:
    """Blocks the sidecar pinned for one lease: tokens ``[start, num_tokens)`` of the prompt
    (and, for a store with states, the snapshot after ``num_tokens``)."""

    start: int  # tokens the client held itself (the slots begin there)
    num_tokens: int  # the sidecar's whole match, from token 0 (with states: to its deepest snapshot)
    slots: list[int]
    pool: SharedBlockPool  # a view over the shared memory these slots index (``pool.states``: its snapshots)
    lease: int
    generation: int
    snap: int = -1  # with states: the snapshot slot (in ``pool.states``) after ``num_tokens``
    kv_tokens: int = 0  # with states: the KV the sidecar matched (the junction, >= num_tokens)


class SidecarTier:
    """The client end of one sidecar socket, for one store (see the module docstring).

    ``timeout_s``: each call's bound (waiting for another thread's call included; a call that
    got the connection late still has ``MIN_CALL_S``, at most ``timeout_s``, on it);
    ``connect_timeout_s``: connecting and the hello reply; both in (0, 3600] seconds.
    ``states``: the store's (device) state pool, for a model with recurrent layers: the hello
    names its snapshot tensors and the sidecar's snapshot slots are mapped beside its blocks.
    """

    def __init__(
        self,
        path: str,
        pool: BlockPool,
        namer: Namer,
        *,
        states: StatePool | None = None,
        timeout_s: float = TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_retry_s: float = 2.0,
        max_queue: int = 256,
        wait_s: float = 0.0,
    ) -> None:
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not (isinstance(value, (int, float)) and 0 < value <= 3600):
                raise ValueError(f"{name} must be seconds in (0, 3600], got {value!r}")
        self.path = path
        self.namer = namer
        self.layout = layout_of(pool, states)
        self.local_pool = pool
        self.local_states = states
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retry_s = max_retry_s
        self.wait_s = wait_s
        self.store = None
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self.writer = WriteThrough(self, max_queue)
        self._lock = threading.Lock()  # one call at a time on the connection
        self._conn: Connection | None = None
        self._view: SharedBlockPool | None = None  # the shared pool, mapped once the hello reply came
        self._generation = 0
        self._retry_at = 0.0
        self._retry_s = 0.1
        self._warned = False  # "gone" said, until attached again
        self._late = False  # "did not answer" said, until the next answer
        self._closed = False
        self._tells: collections.deque = collections.deque()  # (header, generation) to send
        self._settler: threading.Thread | None = None  # set and cleared under _lock
        self._stop = threading.Event()  # close(): the settler ends
        self._unsettled = 0  # calls past their timeout whose on_late is still to come (under _lock)
        self._pid = os.getpid()  # another pid: this is a forked child (_after_fork)
        forks.track(self)

    def bind(self, store) -> None:
        """Called by ``KVStore.__init__``: the store whose commits are written through (its
        state pool, if any, the one this tier was made with)."""
        if self.store is not None and self.store is not store:
            raise ValueError("a SidecarTier serves one KVStore")
        if (store.states is None) != (self.local_states is None) or (
            store.states is not None
            and [(s.shape, s.dtype) for s in store.states.specs]
            != [(s.shape, s.dtype) for s in self.local_states.specs]
        ):
            raise ValueError(
                "a SidecarTier for a store with states= needs SidecarTier(..., states=) of its specs"
            )
        self.store = store

    # -- calls ------------------------------------------------------------------------------
    def call(
        self, header: dict, body: bytes = b"", *, generation: int | None = None, on_late: OnLate | None = None
    ) -> tuple[dict, SharedBlockPool, int]:
        """One request's reply, with the shared pool and the connection generation its slots
        belong to, within ``timeout_s`` all told. Raises ``SidecarDown`` (``SidecarTimeout``: out
        of time, the connection kept) or ``ValueError`` (the sidecar refused it).

        ``generation``: the connection the request belongs to (a commit: its alloc's). When that
        connection is gone it is dropped, never sent on a newer one, whose sidecar holds no such
        transaction or another with its id (``SidecarDown``; counted ``stale_commits``).
        ``on_late``: for a call that timed out with its reply owed, called under the tier's lock
        with that reply once it is read, or None if the connection closes first
        (``Connection.call``); counted in ``stats()``'s ``sidecar_unsettled_writes`` meanwhile.
        """
        self.check_fork()
        op = header["op"]
        deadline = time.monotonic() + self.timeout_s
        limit = f"{self.timeout_s:g} s (timeout_s, RADIXKV_SIDECAR_TIMEOUT_S)"
        if not self._lock.acquire(timeout=self.timeout_s):
            msg = f"the sidecar on {self.path} did not answer {op!r} within {limit}: another call held it"
            raise self._timed_out(SidecarTimeout(msg, op, waited=True), owes=False)
        # A call that waited long for another's (a live call is ~0.1 ms) still gets a time of its
        # own, not a spurious timeout that would make later calls skip the sidecar.
        deadline = max(deadline, time.monotonic() + min(self.timeout_s, MIN_CALL_S))
        try:
            if generation is not None and (self._view is None or generation != self._generation):
                self.counters["stale_commits"] += 1
                raise SidecarDown(
                    f"{op!r} belongs to an earlier connection to the sidecar on {self.path}: not sent"
                )
            self._attached_locked()
            answer = self._conn.call(
                header, body, deadline=deadline, limit=limit, on_late=self._owing(on_late)
            )
            # Taken under the lock: the tells sent after it is let go (by this thread or another)
            # may find the connection broken and drop it (view None) before this call returns.
            view, generation = self._view, self._generation
        except SidecarTimeout as e:
            self._unsettled += int(e.owed and e.op == op and on_late is not None)  # on_late is due
            raise self._timed_out(e) from None
        except SidecarDown:
            raise
        except (OSError, ConnectionError, ProtocolError) as e:  # a broken stream: start again
            self._lost_locked(e)
            raise SidecarDown(str(e)) from None
        finally:
            self._settle_later_locked()
            self._lock.release()
            self._send_tells()
        if self._late:
            self._late = False
            logger.warning("radixkv: the sidecar on %s answers again", self.path)
        if "error" in answer:
            self.counters["refused"] += 1
            logger.debug("radixkv: the sidecar refused %s: %s", op, answer["error"])
            raise ValueError(answer["error"])
        return answer, view, generation

    def _owing(self, on_late: OnLate | None) -> OnLate | None:
        if on_late is None:
            return None

        def settled(answer: dict | None) -> None:  # under _lock: Connection.catch_up/call/close
            self._unsettled -= 1
            on_late(answer)

        return settled

    def tell(self, header: dict, generation: int) -> None:
        """A request with no reply (release, abort) on the connection of ``generation``; dropped
        when that connection is gone (its pins and writes went with it). Never waits: while
        another thread's call holds the connection, that thread sends it when its call ends.
        What the socket cannot take now goes out before the next request."""
        self.check_fork()
        self._tells.append((header, generation))
        self._send_tells()

    def _send_tells(self) -> None:
        # Every holder of the lock calls this after letting it go, so no tell is left behind.
        while self._tells and self._lock.acquire(blocking=False):
            try:
                while self._tells:
                    header, generation = self._tells.popleft()
                    if self._view is None or generation != self._generation:
                        continue
                    try:
                        self._conn.call(header, deadline=time.monotonic(), reply=False)
                    except (OSError, ConnectionError, ProtocolError) as e:
                        self._lost_locked(e)
                self._settle_later_locked()
            finally:
                self._lock.release()

    def _settle_later_locked(self) -> None:
        """Start the settler when the connection has a reply owed or bytes unsent: an idle
        client would otherwise hold what a late reply granted (pins, a transaction) and its
        queued releases until its next call."""
        if self._settler is None and self._conn is not None and self._conn.pending and not self._closed:
            settler = threading.Thread(target=self._settle_loop, name="radixkv-sidecar-settler", daemon=True)
            try:
                settler.start()
            except RuntimeError as e:  # no new threads (interpreter shutdown, a thread limit)
                logger.debug(
                    "radixkv: no settler for the sidecar on %s (%s): the next call settles", self.path, e
                )
                return  # never raises: callers release the lock after this
            self._settler = settler

    def _settle_loop(self) -> None:
        """Every ``SETTLE_S``: catch up (send what is queued, read and undo the late replies
        that came) without waiting on the socket, until nothing is owed or unsent, the
        connection is gone, or ``close()``. Takes the lock for at most ``timeout_s`` a try."""
        while not self._stop.wait(SETTLE_S):
            if not self._lock.acquire(timeout=self.timeout_s):
                continue
            try:
                if self._closed or self._conn is None or not self._conn.pending:
                    self._settler = None
                    return
                try:
                    self._conn.catch_up()
                except (OSError, ConnectionError, ProtocolError) as e:
                    self._lost_locked(e)
            finally:
                self._lock.release()
                self._send_tells()

    def check_fork(self) -> None:
        """A fork the ``forks`` hooks did not see (a C library's fork()) is found by the pid:
        ``_after_fork`` then, before anything here takes a lock. Every entry point calls it."""
        if self._pid != os.getpid():
            self._after_fork()

    def _after_fork(self) -> None:
        """In a forked child (its only thread): drop the parent's connection without a word on
        it (this process's copies of its descriptors closed; its owed replies, queued releases,
        pins, claims and open writes stay the parent's) and take fresh locks and queues (a lock
        may have been copied held by a parent thread, and no thread of the parent runs here).
        The next call connects with its own hello; a lease or alloc from before the fork has an
        older generation, so its releases and commits are never sent on the new connection."""
        conn, self._conn, self._view = self._conn, None, None
        if conn is not None:
            conn.abandon()
        self._lock = threading.Lock()
        self._tells = collections.deque()
        self._settler = None
        self._stop = threading.Event()
        if self._closed:
            self._stop.set()
        self._unsettled = 0
        self._retry_at, self._retry_s = 0.0, 0.1
        self._late = self._warned = False
        self.writer.after_fork()
        self._pid = os.getpid()  # last: a reset that raised is tried again by the pid check

    def _attached_locked(self) -> None:
        """Connect and say hello (within ``connect_timeout_s``) when there is no connection; map
        the shared pool once the hello reply is in (it may come late: taken by a later call)."""
        if self._conn is None:
            now = time.monotonic()
            if self._closed or now < self._retry_at:
                raise SidecarDown("closed" if self._closed else "retry later")
            try:
                self._conn = Connection(self.path, self.connect_timeout_s, self.counters)
            except OSError as e:
                if isinstance(e, TimeoutError):  # listening, but not accepting (its backlog full)
                    e = TimeoutError(f"not accepted within {self.connect_timeout_s:g} s (connect_timeout_s, "
                                     "RADIXKV_SIDECAR_CONNECT_TIMEOUT_S)")  # fmt: skip
                self._lost_locked(e, f"no sidecar on {self.path} ({e}); serving from this process's pool")
                raise SidecarDown(str(e)) from None
            limit = f"{self.connect_timeout_s:g} s (connect_timeout_s, RADIXKV_SIDECAR_CONNECT_TIMEOUT_S)"
            hello = {"op": "hello", "layout": self.layout}
            self._conn.call(hello, deadline=now + self.connect_timeout_s, limit=limit)
        if self._view is not None:
            return
        reply, fds = self._conn.hello_reply()
        try:
            if "error" in reply:
                raise ValueError(reply["error"])
            if len(fds) != 1:
                raise ConnectionError(f"the hello reply carried {len(fds)} file descriptors, expected 1")
            buf = mmap.mmap(fds[0], reply["pool_bytes"])
            num_slots = reply.get("num_slots", 0)
            if self.local_states is not None and not num_slots:
                raise ValueError("the sidecar's pool for this layout holds no snapshot slots")
            self._view = shared_pool_view(
                self.local_pool, buf, reply["num_blocks"], states=self.local_states, num_slots=num_slots
            )
        except (OSError, ConnectionError, ValueError, KeyError) as e:
            self._lost_locked(e, f"the sidecar on {self.path} refused this client: {e}")
            raise SidecarDown(str(e)) from None
        finally:
            for fd in fds:
                os.close(fd)
        self._generation += 1
        self._retry_s = 0.1
        self.counters["connects"] += 1
        if self._warned:
            logger.warning("radixkv: sidecar on %s attached again", self.path)
        self._warned = False

    def _lost_locked(self, error: Exception, message: str = "") -> None:
        """Close the connection (the sidecar frees what it held for us); retry with backoff."""
        if self._conn is not None:
            self._conn.close()
            self.counters["disconnects"] += int(self._view is not None)
        self._conn = self._view = None
        self._retry_at = time.monotonic() + self._retry_s
        self._retry_s = min(self.max_retry_s, self._retry_s * 2)
        if not self._warned:
            self._warned = True
            message = message or f"sidecar on {self.path} gone ({error}); serving from this process's pool"
            logger.warning("radixkv: %s", message)

    def _timed_out(self, error: SidecarTimeout, owes: bool = True) -> SidecarTimeout:
        """Count a call that went without the sidecar; one warning per slow spell. ``owes``:
        False for a call that never got the connection (no reply owed: calls go on; the call
        that held it warned already)."""
        self.counters["timeouts" if error.waited else "skipped_calls"] += 1
        if not owes:
            logger.debug("radixkv: %s", error)
        elif error.waited and not self._late:
            self._late = True
            logger.warning(
                "radixkv: %s; served without it. The connection stays; calls skip the sidecar "
                "until that reply arrives",
                error,
            )
        return error

    # -- reads ------------------------------------------------------------------------------
    def lookup(
        self, tokens: PackedTokens, namespace: Hashable, have: int, *, request: bool = True
    ) -> RemoteHit | None:
        """Pin the sidecar's blocks of ``tokens`` past the ``have`` tokens held locally; None on a miss.

        With ``wait_s`` > 0 and ``request`` (a prompt this process will compute and commit), the
        rest is claimed; when another process claimed it first (it is computing that prefix right
        now), this one polls for its commit for up to ``wait_s`` seconds instead of computing it
        again (ranks meeting one preamble at the same moment).
        """
        key = self.namer(namespace)
        if key is None:
            return None
        header = {"op": "match", "ident": key[0].hex(), "ns": key[1].decode(), "have": have}
        if request and self.wait_s > 0:
            header["claim"] = self.wait_s
        body = bytes(tokens)
        deadline = time.monotonic() + self.wait_s
        hit = None
        polled = False
        while True:
            try:
                answer, view, generation = self.call(header, body)
            except (SidecarDown, ValueError):
                return hit
            if answer.get("lease") and view is not None:
                if hit is not None:
                    self.release(hit)
                hit = RemoteHit(
                    have, answer["num_tokens"], answer["slots"], view, answer["lease"], generation,
                    answer.get("snap", -1), answer.get("kv_tokens", answer["num_tokens"]),
                )  # fmt: skip
                if self.local_states is not None and not 0 <= hit.snap < view.states.num_slots:
                    self.release(hit)  # a sidecar that sent no snapshot for a stateful match: no hit
                    return None
            wait = answer.get("wait", 0)
            done = not wait or (hit is not None and hit.num_tokens >= wait)
            if done or time.monotonic() >= deadline:
                if polled:
                    self.counters["waited" if done else "wait_timeouts"] += 1
                return hit
            # Polling keeps the claim: if the other process's claim goes (expired, its client
            # gone) with nothing cached, this one claims the prefix and computes it.
            polled = True
            time.sleep(POLL_S)

    def release(self, hit: RemoteHit) -> None:
        self.tell({"op": "release", "lease": hit.lease}, hit.generation)

    # -- writes (write_through.WriteThrough) -------------------------------------------------
    def push(self, tokens: PackedTokens, namespace: Hashable) -> None:
        """Queue a committed key for write-through (returns at once; dropped when the queue is full)."""
        self.check_fork()
        self.writer.push(tokens, namespace)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is done or dropped; False on timeout."""
        return self.writer.flush(timeout)

    def drain(self, timeout: float) -> tuple[int, int]:
        """(commits written, commits lost) flushing for at most ``timeout`` s (``WriteThrough.drain``)."""
        return self.writer.drain(timeout)

    # -- observation ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """Counters (taking no lock: a call waiting on a slow sidecar never holds up /metrics)."""
        out = {f"sidecar_{k}": v for k, v in self.counters.copy().items()}
        out["sidecar_connected"] = int(self._view is not None)
        out["sidecar_queued_writes"] = self.writer.queued
        out["sidecar_unsettled_writes"] = self._unsettled
        return out

    def close(self) -> None:
        """Detach for good: later calls are misses, later commits stay local."""
        self.check_fork()
        self._stop.set()
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
            self._conn = self._view = None
