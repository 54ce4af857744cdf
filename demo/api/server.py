"""Running the app under waitress, a production WSGI server, in the foreground or in a thread.

Why waitress (measured in benchmarks/bench_wsgi.py, figures in docs/design.md): it runs in
this process (one model, one engine: no fork, no pre-loading), an event loop reads requests
and only a complete request (headers and body) is handed to a worker thread, so half-open or
slow clients cost a socket, not a thread; it tells a running request that its client hung up
(`waitress.client_disconnected`); SSE chunks go out as they are yielded.

Limits (`Limits`): worker threads and open connections are bounded; a connection idle for
`idle_timeout` seconds (a client that stopped sending headers or body, or an idle keep-alive)
is closed, and so is one that has not sent a complete request within `header_timeout`
seconds however it drips; headers and bodies have size caps. A streaming or waiting request
holds a worker thread for its whole life, so the thread count follows the engine's queue and
batch sizes. Who gets a connection (demo.api.connections): one client address holds at most
`per_address` of them (default half; trusted proxies: no cap), and near the limit the oldest
idle connections give way to new ones, so several addresses holding their caps cannot lock a
new one out. What waitress itself refuses is answered in the API's JSON error shape.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from waitress import wasyncore
from waitress.server import BaseWSGIServer, create_server

from demo.api import connections
from demo.api.proxies import TrustedProxies

log = logging.getLogger(__name__)
NO_PROXIES = TrustedProxies()
STOP_WAIT = 0.5  # seconds worker threads get to finish once their requests are cut (shutdown)


@dataclass(frozen=True)
class Limits:
    threads: int = 48  # requests being answered at once (each stream holds one)
    connections: int = 256  # open sockets; beyond it, new ones wait in the listen backlog
    idle_timeout: int = 30  # seconds without a byte from an idle connection before closing it
    header_timeout: int = 30  # seconds a connection may take to send a complete request (body too)
    max_header_bytes: int = 64 << 10
    max_body_bytes: int = 4 << 20  # the app refuses its own, smaller limit with a JSON 413
    per_address: int | None = None  # open connections of one client address; None: half of
    # `connections`, 0: no cap
    trusted: TrustedProxies = NO_PROXIES  # gateways: not capped per address, their
    # X-Forwarded-For reaches the app (waitress strips it from every other peer)

    def __post_init__(self) -> None:
        if self.per_address is not None and self.per_address < 0:
            raise ValueError(f"connections per address must be >= 0, got {self.per_address}")

    @property
    def address_cap(self) -> int:
        """Connections one address may hold (0: no cap)."""
        return max(1, self.connections // 2) if self.per_address is None else self.per_address

    @classmethod
    def for_engine(
        cls,
        max_queue: int,
        max_batch: int,
        per_address: int | None = None,
        app_body_bytes: int = 0,
        trusted: TrustedProxies = NO_PROXIES,
    ) -> Limits:
        """Enough threads for every queued and running request plus a few for /metrics etc.;
        bodies up to the app's own limit (larger with images) reach the app, which answers 413."""
        threads = max_queue + max_batch + 8
        body = max(cls.max_body_bytes, app_body_bytes + 1)
        return cls(
            threads=threads,
            connections=max(256, 4 * threads),
            per_address=per_address,
            max_body_bytes=body,
            trusted=trusted,
        )


def _server(app, host: str, port: int, limits: Limits, sock: socket.socket | None = None):
    server = _create_server(app, host, port, limits, sock)
    listeners = [server] if isinstance(server, BaseWSGIServer) else list(server.map.values())
    connections.install(  # one count and one idle order over every listener
        [listener for listener in listeners if isinstance(listener, BaseWSGIServer)],
        connections.Policy(limits.address_cap, limits.trusted, limits.connections, limits.header_timeout),
    )
    return server


def _create_server(app, host: str, port: int, limits: Limits, sock: socket.socket | None = None):
    # ``sock``: a bound socket (front ends share one port: demo.core.front_end); else host:port
    where = {"sockets": [sock]} if sock is not None else {"host": host, "port": port}
    return create_server(
        app,
        **where,
        threads=limits.threads,
        connection_limit=limits.connections,
        channel_timeout=limits.idle_timeout,
        cleanup_interval=max(1, min(10, limits.idle_timeout, limits.header_timeout // 2)),
        max_request_header_size=limits.max_header_bytes,
        max_request_body_size=limits.max_body_bytes,
        # >= 1: the loop keeps reading a connection whose request is running, so a hang-up
        # is seen at once and reported through environ["waitress.client_disconnected"].
        channel_request_lookahead=1,
        asyncore_use_poll=True,  # poll, not select: no FD_SETSIZE (1024) limit on sockets
        ident="radixkv",
        # The app reads X-Forwarded-For of trusted proxies only (demo.api.proxies): without
        # any, waitress strips the proxy headers of every request.
        clear_untrusted_proxy_headers=not limits.trusted,
    )


def client_alive(environ) -> Callable[[], bool] | None:
    """A check that the HTTP client is still connected, or None where the server gives none.

    waitress gives `waitress.client_disconnected`; werkzeug's development server (tests only)
    puts the socket in the environ: a closed peer makes it readable with nothing to read.
    Data waiting (a pipelined request) means alive; so does any failure of the check itself:
    a check must never cancel a live request.
    """
    gone = environ.get("waitress.client_disconnected")
    if callable(gone):
        return lambda: not gone()
    sock = environ.get("werkzeug.socket")
    if not isinstance(sock, socket.socket):
        return None

    def alive() -> bool:
        try:
            with selectors.DefaultSelector() as sel:  # epoll/kqueue: no FD_SETSIZE limit
                sel.register(sock, selectors.EVENT_READ)
                if not sel.select(timeout=0):
                    return True
            return sock.recv(1, socket.MSG_PEEK) != b""
        except (ConnectionError, TimeoutError):
            return False
        except (OSError, ValueError):
            return True

    return alive


class ServerThread:
    """A live waitress server on host:port (port 0 = a free one) in a daemon thread.

    >>> with ServerThread(app) as srv: requests.get(srv.url + "/health")   # doctest: +SKIP
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None):
        self._server = _server(app, host, port, limits or Limits())
        self.host, self.port = host, self._server.effective_port
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._run, name="radixkv-http", daemon=True)

    def _run(self) -> None:
        try:
            self._server.run()
        except (OSError, ValueError):  # sockets closed under the loop by stop()
            pass

    def start(self) -> ServerThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.close()  # the listening socket only: open keep-alive connections would
        wasyncore.close_all(self._server._map, ignore_all=True)  # keep the loop up to idle_timeout
        self._server.task_dispatcher.shutdown(timeout=5)
        self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def serving(app, host: str = "127.0.0.1", port: int = 0, limits: Limits | None = None):
    """`with serving(app) as url:` a base URL such as http://127.0.0.1:43121."""
    with ServerThread(app, host, port, limits) as server:
        yield server.url


def serve_forever(
    app,
    host: str,
    port: int,
    announce=None,
    limits: Limits | None = None,
    stopping: Callable[[], None] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """Foreground server until Ctrl-C (or SIGTERM raised as KeyboardInterrupt); `announce(url)`
    is called once the port is bound. Then: the listeners are closed (nothing more is taken),
    `stopping()` cuts the requests in flight (demo.engine.engine.Engine.shutdown), worker
    threads get `STOP_WAIT` seconds to finish their answers, and every connection is closed:
    what time is left of a shutdown budget is the caller's (the cache save), not theirs.
    ``sock``: a socket bound already (then host and port only name it)."""
    server = _server(app, host, port, limits or Limits(), sock)
    if announce is not None:
        announce(f"http://{host}:{server.effective_port}")
    single = isinstance(server, BaseWSGIServer)
    sockets = server._map if single else server.map
    try:  # the loop of server.run(), whose own KeyboardInterrupt handling waits 5 s for threads
        server.asyncore.loop(
            timeout=server.adj.asyncore_loop_timeout, map=sockets, use_poll=server.adj.asyncore_use_poll
        )
    except KeyboardInterrupt:
        pass
    finally:
        for listener in [server] if single else list(sockets.values()):
            if isinstance(listener, BaseWSGIServer):
                wasyncore.dispatcher.close(listener)  # the listening socket only, not the trigger
        try:
            if stopping is not None:
                stopping()
        finally:
            server.task_dispatcher.shutdown(timeout=STOP_WAIT)
            wasyncore.close_all(sockets, ignore_all=True)
