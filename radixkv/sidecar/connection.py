"""One client connection to a sidecar: framed requests under deadlines, never cut mid-frame.

Owned by ``client.SidecarTier``, which runs one call at a time on it (not thread-safe itself).

Timeouts, as a Redis client has them (redis-py's ``socket_connect_timeout`` and
``socket_timeout``): the connect timeout bounds ``connect()`` and the ``hello`` reply; each
call's ``deadline`` bounds sending its request and reading its reply.

A call that runs out of time does not close the connection. Closing would drop every pin, claim
and open write this process holds in the sidecar, for a sidecar that may only be slow: blocks a
read of this process is still copying could then be evicted and rewritten for another client.
The reply is *owed* instead. Replies come back in request order and are length-framed, so none
is ever taken for another: the ``FrameBuffer`` keeps a half-read reply, the bytes of a request
the socket did not take in time wait in ``_out`` and go out first, and each owed reply is read
and settled (a lease it granted released, a write it opened aborted) before a later call reads
its own. While a reply is owed and has not arrived, later calls fail at once
(``SidecarTimeout``) instead of waiting again: a stopped sidecar costs one call its timeout, not
every call. Requests that get no reply (``release``, ``abort``) are queued even then, so pins
are let go once the sidecar reads again. The connection closes only when the sidecar closes it
or breaks the format (``SidecarDown`` then, and the sidecar frees what this client held).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import time
from collections.abc import Callable

from radixkv.sidecar.protocol import FrameBuffer, ProtocolError, encode

logger = logging.getLogger(__name__)

MAX_FDS = 4  # per receive; only the hello reply carries one
OnLate = Callable[[dict | None], None]  # a late reply's header; None: the connection closed first


class SidecarDown(ConnectionError):
    """No sidecar answers now (the caller serves from its own pools)."""


class SidecarTimeout(SidecarDown):
    """The sidecar did not answer in time; the connection stays open and the reply is owed.

    ``waited``: True when this call waited out its deadline, False when it was skipped at once
    because an earlier call's reply is still owed. ``op``: the request's op. ``owed``: this
    request went out (or will, whole) and its reply is owed (its ``on_late`` is told)."""

    def __init__(self, message: str, op: str, waited: bool, owed: bool = False) -> None:
        super().__init__(message)
        self.op, self.waited, self.owed = op, waited, owed


class Connection:
    """An open socket to the sidecar on ``path`` (``connect()`` bounded by ``connect_timeout_s``;
    raises ``OSError`` when nothing listens there). ``counters["late_replies"]`` counts replies
    read after their call had given up (the caller's Counter, or a new one)."""

    def __init__(
        self, path: str, connect_timeout_s: float, counters: collections.Counter | None = None
    ) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(connect_timeout_s)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self._in = FrameBuffer()
        self._out = bytearray()  # request bytes the socket has not taken yet (go out first)
        # (op, on_late) of the replies due, in order
        self._owed: collections.deque[tuple[str, OnLate | None]] = collections.deque()
        self._fds: list[int] = []
        self.hello: tuple[dict, list[int]] | None = None  # (reply, fds) once it came
        self.counters = collections.Counter() if counters is None else counters

    @property
    def owed(self) -> int:
        return len(self._owed)

    @property
    def pending(self) -> bool:
        """A reply still owed or request bytes not sent yet (``catch_up`` has work to do)."""
        return bool(self._owed or self._out)

    def call(
        self,
        header: dict,
        body: bytes = b"",
        *,
        deadline: float,
        reply: bool = True,
        limit: str = "",
        on_late: OnLate | None = None,
    ) -> dict:
        """Send one request and return its reply header by ``deadline`` (``time.monotonic()``);
        ``{}`` for a request with no reply (queued; sent as far as the socket takes it now).
        ``on_late``: after a timeout, called (by whichever call or ``catch_up`` reads it) with
        the late reply's header, or with None when the connection closes first (``close``).

        Raises ``SidecarTimeout`` (the reply is owed; nothing else changes; its message names
        the socket and ``limit``, the timeout as the caller set it) when the deadline passes, or
        at once when an earlier call's reply is still owed; ``OSError``, ``ConnectionError`` or
        ``ProtocolError`` when the connection broke (close it then). A reply with ``"error"``
        is returned as it came.
        """
        op = header.get("op", "?")
        self.catch_up()
        if reply and self._owed:
            msg = f"the sidecar on {self.path} still owes the reply to an earlier {self._owed[0][0]!r}"
            raise SidecarTimeout(f"{msg}; {op!r} goes without it", op, waited=False)
        self._out += encode(header, body)
        if not reply:
            self._flush(deadline)
            return {}
        # on_late only once this call gives up: a connection that breaks during the call answers
        # it with an error (the caller counts that), not with a late None as well
        self._owed.append((op, None))
        self._flush(deadline)
        while True:
            got = self._next_reply(deadline)
            if got is None:
                self._owed[-1] = (op, on_late)  # the last owed reply is this call's (calls are serial)
                msg = f"the sidecar on {self.path} did not answer {op!r} within {limit or 'its deadline'}"
                raise SidecarTimeout(msg, op, waited=True, owed=True)
            if not self._owed:
                return got[1]  # the last one owed: this call's
            self._settle(*got)

    def hello_reply(self) -> tuple[dict, list[int]]:
        """The hello reply and the fds it carried (the caller's to close), once it came (taken
        once: the caller maps the pool then); raises ``SidecarTimeout`` while it is owed."""
        self.catch_up()
        if self.hello is None:
            msg = f"the sidecar on {self.path} has not answered this client's hello yet"
            raise SidecarTimeout(msg, "hello", waited=False)
        hello, self.hello = self.hello, None
        return hello

    def catch_up(self) -> None:
        """Without waiting: send queued bytes, read and settle the owed replies that arrived."""
        now = time.monotonic()
        self._flush(now)
        # With nothing owed this still reads once: a frame then is one nobody asked for (raises)
        # and an end of stream a sidecar gone, both found before a request is sent.
        while (got := self._next_reply(now)) is not None:
            self.counters["late_replies"] += 1
            self._settle(*got)
            if not self._owed:
                break
        self._flush(now)  # releases and aborts the settling queued

    def close(self) -> None:
        """Close the socket and every fd received and not handed out (a hello reply nobody
        took carries the pool's); each reply still owed is told ``on_late(None)``."""
        owed, self._owed = self._owed, collections.deque()
        self.abandon()
        for _op, on_late in owed:
            if on_late is not None:
                on_late(None)

    def abandon(self) -> None:
        """Close this process's descriptors (the socket, fds received) and forget what is owed
        or queued, sending and settling nothing: in a forked child, whose copy of the socket is
        its parent's connection (closing a copy leaves the parent's open and tells the sidecar
        nothing)."""
        fds, self._fds = self._fds + (self.hello[1] if self.hello else []), []
        self.hello = None
        self._owed.clear()
        self._out.clear()
        for fd in fds:
            os.close(fd)
        self.sock.close()

    # -- internals --------------------------------------------------------------------------
    def _settle(self, op: str, answer: dict, on_late: OnLate | None) -> None:
        """Undo what an abandoned call's late reply granted (sent with the next bytes out), then
        tell its ``on_late``."""
        if op == "match" and answer.get("lease"):
            self._out += encode({"op": "release", "lease": answer["lease"]})
        elif op == "alloc" and answer.get("txn"):
            self._out += encode({"op": "abort", "txn": answer["txn"]})
        # hello: kept in self.hello; commit and stats: nothing to undo.
        if on_late is not None:
            on_late(answer)

    def _flush(self, deadline: float) -> bool:
        """Send queued bytes until ``deadline`` (a past one: what the socket takes at once)."""
        while self._out:
            self.sock.settimeout(max(0.0, deadline - time.monotonic()))  # 0: non-blocking
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, TimeoutError):
                return False
            del self._out[:sent]
        return True

    def _next_reply(self, deadline: float) -> tuple[str, dict, OnLate | None] | None:
        """(op, reply header, on_late) of the first owed reply, or None when it is not complete
        by ``deadline`` (a past one: what has arrived already)."""
        while True:
            for header, _body in self._in.frames():
                if not self._owed:
                    raise ProtocolError(f"a reply nobody asked for: {sorted(header)}")
                op, on_late = self._owed.popleft()
                if op == "hello":
                    self.hello, self._fds = (header, self._fds), []
                return op, header, on_late
            self._flush(deadline)  # a request still partly queued cannot be answered yet
            self.sock.settimeout(max(0.0, deadline - time.monotonic()))
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 16, MAX_FDS)
            except (BlockingIOError, TimeoutError):
                return None
            self._fds += fds
            if not data:
                raise ConnectionError(f"the sidecar on {self.path} closed the connection")
            self._in.feed(data)
