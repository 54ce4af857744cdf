"""Who gets a connection: per-address caps, a header timeout, and the oldest idle giving way.

    connections.install(listeners, Policy(per_address=128, trusted, limit=256, header_timeout=15))

waitress accepts connections up to its ``connection_limit`` and then stops listening; a client
that sends nothing is closed only after ``channel_timeout`` of silence, and one that drips a
byte now and then never. A few addresses holding their share each could take every slot. So,
on the event loop's thread (no locking against waitress's own state):

- one address holds at most ``per_address`` connections (trusted proxies: no cap, demo.api.proxies);
  a connection over it is answered at once with a JSON 429 and closed;
- a connection that has not sent a complete request within ``header_timeout`` seconds of its
  opening (or of its last answer: an idle keep-alive) is closed, however it drips;
- when the open connections come within ``room`` of the limit, each new one makes the oldest
  idle connections (no complete request in hand, the earliest last activity first) close, so a
  new address is served at once while others hold their caps.

What waitress refuses itself (an oversized body, a malformed request) is answered in the API's
JSON error shape (``_JsonErrorTask``).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

from waitress.channel import HTTPChannel
from waitress.task import ErrorTask

from demo.api.proxies import TrustedProxies

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Policy:
    per_address: int  # 0: no cap
    trusted: TrustedProxies
    limit: int  # waitress's connection_limit
    header_timeout: float

    @property
    def room(self) -> int:
        """Free connections kept by closing the oldest idle ones."""
        return max(2, self.limit // 16)


def _json_error(status: int, message: str, code: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class _JsonErrorTask(ErrorTask):
    """waitress's own refusals (413, 400, 431, ...) in the API's JSON error shape."""

    def execute(self):
        e = self.request.error
        message = f"request body too large ({e.body})" if e.code == 413 else f"{e.reason}: {e.body}"
        body = _json_error(e.code, message)
        self.status = f"{e.code} {e.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


def _idle(channel) -> bool:
    """No complete request in hand, and no answer still going out (a slow reader's)."""
    return not channel.requests and not channel.total_outbufs_len


class _Open:
    """The open channels (accepted on the loop thread, closed from any) and their count per address."""

    def __init__(self, policy: Policy) -> None:
        self.policy, self._per_address, self.channels, self._lock = policy, {}, set(), threading.Lock()

    def enter(self, address: str) -> bool:
        with self._lock:
            n = self._per_address.get(address, 0)
            cap = self.policy.per_address
            if cap and n >= cap and not self.policy.trusted.trusts(address):
                return False
            self._per_address[address] = n + 1
            return True

    def leave(self, channel) -> None:
        with self._lock:
            self.channels.discard(channel)
            n = self._per_address.pop(channel.address, 1) - 1
            if n > 0:
                self._per_address[channel.address] = n

    def make_room(self, keep) -> None:
        """Close the oldest idle channels (not ``keep``) until ``room`` connections are free."""
        with self._lock:
            over = len(self.channels) - (self.policy.limit - self.policy.room)
            if over <= 0:
                return
            idle = sorted(
                (c for c in self.channels if c is not keep and _idle(c) and not c.will_close),
                key=lambda c: c.last_activity,
            )
        for channel in idle[:over]:
            channel.will_close = True  # the loop closes it at its next pass
        if idle[:over]:
            log.info("%d open connections: closed the %d oldest idle", len(self.channels), len(idle[:over]))

    def expire(self, now: float) -> None:
        """Close the channels without a complete request for ``header_timeout`` seconds."""
        cutoff = now - self.policy.header_timeout
        with self._lock:
            late = [c for c in self.channels if _idle(c) and c.waiting_since < cutoff]
        for channel in late:
            channel.will_close = True


def _channel_class(open_: _Open):
    refusal = _json_error(
        429,
        f"too many open connections from your address (at most {open_.policy.per_address}); "
        "close idle ones and retry",
        "too_many_connections",
    )
    response = (
        b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(refusal)}\r\n\r\n".encode()
        + refusal
    )

    class Channel(HTTPChannel):
        error_task_class = _JsonErrorTask
        address: str | None = None
        waiting_since = 0.0  # time.time() since which it has had no complete request

        def __new__(cls, server, sock, addr, adj, map=None):
            address = addr[0] if isinstance(addr, tuple) else str(addr)
            if open_.enter(address):
                channel = super().__new__(cls)
                channel.address = address
                return channel
            try:  # over the cap: answer now (a fresh socket's buffer takes it whole), close;
                sock.setblocking(False)  # what the client sent already is read first, else the
                try:  # close would reset the connection before it reads the answer
                    sock.recv(65536)
                except BlockingIOError:
                    pass
                sock.send(response)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            sock.close()
            return None  # __init__ is not run: the server keeps no channel

        def __init__(self, server, sock, addr, adj, map=None):
            super().__init__(server, sock, addr, adj, map)
            self.waiting_since = time.time()
            with open_._lock:
                open_.channels.add(self)
            open_.make_room(keep=self)

        def service(self):
            super().service()
            if not self.requests:  # answered: a keep-alive waits for its next request anew
                self.waiting_since = time.time()

        def del_channel(self, map=None):
            if self.address is not None:
                open_.leave(self)
                self.address = None
            super().del_channel(map)

    return Channel


def install(listeners: list, policy: Policy) -> None:
    """Give ``listeners`` (waitress BaseWSGIServers sharing one socket map) the policy's channel
    class and the header timeout in their periodic maintenance."""
    open_ = _Open(policy)
    channel = _channel_class(open_)
    for listener in listeners:
        listener.channel_class = channel
        own = listener.maintenance

        def maintenance(now, own=own):
            own(now)
            open_.expire(now)

        listener.maintenance = maintenance
