"""A sidecar as a tier behind a ``KVStore``'s own pools (the client side of ``radixkv.sidecar``).

    tier = SidecarTier("/run/radixkv.sock", pool, namer)     # pool: the store's device pool
    store = KVStore(pool, host_pool, remote=tier)

- Reads: a prompt whose local match is shorter than its whole blocks asks the sidecar for the
  rest (``lookup``: one round trip); the sidecar pins what it holds until the lease is released,
  and ``KVStore.read`` copies those blocks straight from the shared-memory pool into the caller's
  buffers (one copy, as a host-tier hit). Nothing is promoted into the local pool: the commit after
  generate() caches the whole sequence locally from the caller's buffers anyway.
- Writes (write-through): every commit queues its key (``push``); a background thread pins the
  local blocks, asks the sidecar which blocks it lacks (``alloc``), copies them from the local
  pools into the shared pool and commits them. Bounded: at most ``max_queue`` commits wait; more
  are dropped (counted). Why write-through, not on eviction: another process can read a prefix
  as soon as it is computed (a replica's first request on a document, ranks sharing a prompt);
  on eviction it would reach the sidecar only once this process's pool is full.
- Prefixes in flight (``wait_s`` > 0, ``RADIXKV_SIDECAR_WAIT_S``): a request's lookup claims what
  it misses; a lookup that finds another process's claim over its prefix polls for that
  process's commit instead of computing the prefix again (``lookup``).
- Faults: a sidecar that is gone (killed, not started yet) turns every call into "no hit" and
  "not written"; one warning is logged, and a connect is retried with backoff (0.1 s doubling to
  ``max_retry_s``) on the next calls: a new sidecar on the socket is used again without a restart.
  Blocks a lease pinned stay mapped, so a read in flight when the sidecar dies still reads the
  bytes it pinned (no process writes them any more).

``namer(store namespace) -> (identity digest, namespace key) | None`` maps the store's keys to
the sidecar's (hf_patch: the model's identity and the encoded namespace); None keeps a key local.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Callable, Hashable

import torch

from radixkv.sidecar.layout import KVLayout, PoolGeometry
from radixkv.sidecar.protocol import FrameBuffer, ProtocolError, recv, send
from radixkv.store.pool import BlockPool
from radixkv.store.tier import copy_blocks
from radixkv.tree.node import PackedTokens

logger = logging.getLogger(__name__)

EXIT_FLUSH_S = 5.0
POLL_S = 0.01  # between polls for a prefix another process is computing
Namer = Callable[[Hashable], "tuple[bytes, bytes] | None"]


class SidecarDown(ConnectionError):
    """No sidecar answers now (the caller serves from its own pools)."""


@dataclasses.dataclass
class RemoteHit:
    """Blocks the sidecar pinned for one lease: tokens ``[start, num_tokens)`` of the prompt."""

    start: int  # tokens the client held itself (the slots begin there)
    num_tokens: int  # the sidecar's whole match, from token 0
    slots: list[int]
    pool: BlockPool  # a view over the shared memory these slots index
    lease: int
    generation: int


def layout_json(pool: BlockPool) -> dict:
    return {
        "block_size": pool.block_size,
        "layers": [
            {
                "num_kv_heads": s.num_kv_heads,
                "k_head_dim": s.k_head_dim,
                "v_head_dim": s.v_head_dim,
                "dtype": str(s.dtype).removeprefix("torch."),
            }
            for s in pool.layers
        ],
    }


def shared_pool_view(pool: BlockPool, buf, num_blocks: int) -> BlockPool:
    """A ``BlockPool`` over the sidecar's memory ``buf`` laid out as ``radixkv.sidecar.layout`` says."""
    geometry = PoolGeometry(KVLayout.from_json(layout_json(pool)), num_blocks)
    flat = torch.frombuffer(buf, dtype=torch.uint8, count=geometry.total_bytes)
    specs = [dataclasses.replace(s, device=torch.device("cpu")) for s in pool.layers]
    tensors = []
    for (offset, per_block), spec, which in zip(
        geometry.regions(), [s for s in specs for _ in (0, 1)], [0, 1] * len(specs)
    ):
        dim = spec.k_head_dim if which == 0 else spec.v_head_dim
        region = flat[offset : offset + per_block * num_blocks].view(spec.dtype)
        tensors.append(region.view(num_blocks, pool.block_size, spec.num_kv_heads, dim))
    return BlockPool(specs, num_blocks, pool.block_size, storage=(tensors[0::2], tensors[1::2]))


class SidecarTier:
    """The client end of one sidecar socket, for one store (see the module docstring)."""

    def __init__(
        self,
        path: str,
        pool: BlockPool,
        namer: Namer,
        *,
        timeout_s: float = 2.0,
        max_retry_s: float = 2.0,
        max_queue: int = 256,
        wait_s: float = 0.0,
    ) -> None:
        self.path = path
        self.namer = namer
        self.layout = layout_json(pool)
        self.local_pool = pool
        self.timeout_s = timeout_s
        self.max_retry_s = max_retry_s
        self.max_queue = max_queue
        self.wait_s = wait_s
        self._store = None
        self._lock = threading.Lock()  # one request/reply at a time on the socket
        self._sock: socket.socket | None = None
        self._buffer = FrameBuffer()
        self._view: BlockPool | None = None
        self._generation = 0
        self._retry_at = 0.0
        self._retry_s = 0.1
        self._warned = False
        self._closed = False
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._busy = False
        self._writer: threading.Thread | None = None
        self.counters = collections.Counter()

    def bind(self, store) -> None:
        """Called by ``KVStore.__init__``: the store whose commits are written through."""
        if self._store is not None and self._store is not store:
            raise ValueError("a SidecarTier serves one KVStore")
        self._store = store

    # -- connection -------------------------------------------------------------------------
    def _connect_locked(self) -> None:
        now = time.monotonic()
        if self._closed:
            raise SidecarDown("closed")
        if now < self._retry_at:
            raise SidecarDown("retry later")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.path)
            buffer = FrameBuffer()
            send(sock, {"op": "hello", "layout": self.layout})
            reply, _, fds = recv(sock, buffer, with_fds=True)
            if "error" in reply:
                raise ValueError(reply["error"])
            if len(fds) != 1:
                raise ConnectionError(f"the hello reply carried {len(fds)} file descriptors, expected 1")
            try:
                buf = mmap.mmap(fds[0], reply["pool_bytes"])
            finally:
                os.close(fds[0])
            view = shared_pool_view(self.local_pool, buf, reply["num_blocks"])
        except (OSError, ConnectionError, ValueError, KeyError) as e:
            sock.close()
            self._retry_at = now + self._retry_s
            self._retry_s = min(self.max_retry_s, self._retry_s * 2)
            if not self._warned:
                self._warned = True
                logger.warning(
                    "radixkv: no sidecar on %s (%s); serving from this process's pool", self.path, e
                )
            raise SidecarDown(str(e)) from None
        self._sock, self._buffer, self._view = sock, buffer, view
        self._generation += 1
        self._retry_s = 0.1
        self.counters["connects"] += 1
        if self._warned:
            logger.warning("radixkv: sidecar on %s attached again", self.path)
        self._warned = False

    def _lost_locked(self, error: Exception) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._retry_at = time.monotonic() + self._retry_s
        self.counters["disconnects"] += 1
        if not self._warned:
            self._warned = True
            logger.warning(
                "radixkv: sidecar on %s gone (%s); serving from this process's pool, reconnecting",
                self.path,
                error,
            )

    def _call(self, header: dict, body: bytes = b"", *, reply: bool = True) -> tuple[dict, BlockPool, int]:
        with self._lock:
            if self._sock is None:
                self._connect_locked()
            try:
                send(self._sock, header, body)
                answer = recv(self._sock, self._buffer)[0] if reply else {}
            except (OSError, ConnectionError, ProtocolError) as e:  # a broken stream: start again
                self._lost_locked(e)
                raise SidecarDown(str(e)) from None
            if "error" in answer:
                self.counters["refused"] += 1
                logger.debug("radixkv: the sidecar refused %s: %s", header.get("op"), answer["error"])
                raise ValueError(answer["error"])
            return answer, self._view, self._generation

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
                answer, view, generation = self._call(header, body)
            except (SidecarDown, ValueError):
                return hit
            if answer.get("lease"):
                if hit is not None:
                    self.release(hit)
                hit = RemoteHit(
                    have, answer["num_tokens"], answer["slots"], view, answer["lease"], generation
                )
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
        with self._lock:
            if self._sock is None or hit.generation != self._generation:
                return  # that sidecar is gone, and its pins with it
            try:
                send(self._sock, {"op": "release", "lease": hit.lease})
            except OSError as e:
                self._lost_locked(e)

    # -- writes -----------------------------------------------------------------------------
    def push(self, tokens: PackedTokens, namespace: Hashable) -> None:
        """Queue a committed key for write-through (returns at once; dropped when the queue is full)."""
        key = self.namer(namespace)
        if key is None:
            return
        with self._cond:
            if len(self._queue) >= self.max_queue:
                self.counters["dropped_writes"] += 1
                return
            self._queue.append((tokens, namespace, key))
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name="radixkv-sidecar-writer", daemon=True
                )
                self._writer.start()
                # A process that commits and exits (a batch rank, a script) still hands its last
                # prefixes over; bounded, so a hung sidecar cannot hold the exit for long.
                atexit.register(self.flush, EXIT_FLUSH_S)
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued write is done or dropped; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def drain(self, timeout: float) -> tuple[int, int]:
        """Flush for at most ``timeout`` seconds, then drop what still waits: for a process about
        to exit without running its ``atexit`` hooks (the demo's ``os._exit``). Returns (commits
        written to the sidecar meanwhile, commits lost: dropped here, failed, or still being
        written at the timeout). A dead sidecar fails every write at once (connection refused);
        a hung one costs at most ``timeout``."""
        before = self.counters["written_commits"], self.counters["failed_writes"]
        done = self.flush(timeout)
        with self._cond:
            lost = len(self._queue) + (0 if done else int(self._busy))
            self.counters["dropped_writes"] += len(self._queue)
            self._queue.clear()
        written = self.counters["written_commits"] - before[0]
        return written, lost + self.counters["failed_writes"] - before[1]

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                item = self._queue.popleft()
                self._busy = True
            try:
                self._write(*item)
            except Exception as e:  # never let a bug here stop later writes; reads are unaffected
                self.counters["failed_writes"] += 1
                logger.warning("radixkv: sidecar write failed: %s", e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, tokens: PackedTokens, namespace: Hashable, key: tuple[bytes, bytes]) -> None:
        store = self._store
        with store.acquire(tokens, namespace, count=False, remote=False) as lease:
            if lease.num_tokens == 0:
                return  # evicted (or flushed) since the commit
            held = tokens.head(lease.num_tokens)
            try:
                answer, view, _ = self._call(
                    {"op": "alloc", "ident": key[0].hex(), "ns": key[1].decode()}, bytes(held)
                )
            except (SidecarDown, ValueError):
                self.counters["failed_writes"] += 1
                return
            slots, start, txn = answer["slots"], answer["start"], answer["txn"]
            if not slots:  # the sidecar holds it all already, or its pool is pinned full
                has_all = start * self.layout["block_size"] >= held.num_tokens
                self.counters["written_commits" if has_all else "failed_writes"] += 1
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
            except BaseException:
                self._send_quiet({"op": "abort", "txn": txn})
                raise
        try:
            self._call({"op": "commit", "txn": txn})
            self.counters["written_blocks"] += len(slots)
            self.counters["written_commits"] += 1
        except (SidecarDown, ValueError):
            self.counters["failed_writes"] += 1

    def _send_quiet(self, header: dict) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    send(self._sock, header)
                except OSError as e:
                    self._lost_locked(e)

    # -- observation ------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {f"sidecar_{k}": v for k, v in self.counters.items()}
            out["sidecar_connected"] = int(self._sock is not None)
        with self._cond:
            out["sidecar_queued_writes"] = len(self._queue)
        return out

    def close(self) -> None:
        """Detach for good: later calls are misses, later commits stay local."""
        with self._lock:
            self._closed = True
            if self._sock is not None:
                self._sock.close()
                self._sock = None
