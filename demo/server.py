"""Running the app under waitress, a production WSGI server, in the foreground or in a thread.

Why waitress (measured in benchmarks/bench_wsgi.py, figures in docs/design.md): it runs in
this process (one model, one engine: no fork, no pre-loading), an event loop reads requests
and only a complete request (headers and body) is handed to a worker thread, so half-open or
slow clients cost a socket, not a thread; it tells a running request that its client hung up
(`waitress.client_disconnected`); SSE chunks go out as they are yielded.

Limits (`Limits`): worker threads and open connections are bounded; a connection idle for
`idle_timeout` seconds (a client that stopped sending headers or body, or an idle keep-alive)
is closed; headers and bodies have size caps. A streaming or waiting request holds a worker
thread for its whole life, so the thread count follows the engine's queue and batch sizes.
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
from waitress.server import create_server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    threads: int = 48  # requests being answered at once (each stream holds one)
    connections: int = 256  # open sockets; beyond it, new ones wait in the listen backlog
    idle_timeout: int = 30  # seconds without a byte from an idle connection before closing it
    max_header_bytes: int = 64 << 10
    max_body_bytes: int = 4 << 20  # the app refuses its own, smaller limit with a JSON 413

    @classmethod
    def for_engine(cls, max_queue: int, max_batch: int) -> Limits:
        """Enough threads for every queued and running request plus a few for /metrics etc."""
        threads = max_queue + max_batch + 8
        return cls(threads=threads, connections=max(256, 4 * threads))


def _server(app, host: str, port: int, limits: Limits):
    return create_server(
        app,
        host=host,
        port=port,
        threads=limits.threads,
        connection_limit=limits.connections,
        channel_timeout=limits.idle_timeout,
        cleanup_interval=max(1, min(10, limits.idle_timeout)),
        max_request_header_size=limits.max_header_bytes,
        max_request_body_size=limits.max_body_bytes,
        # >= 1: the loop keeps reading a connection whose request is running, so a hang-up
        # is seen at once and reported through environ["waitress.client_disconnected"].
        channel_request_lookahead=1,
        asyncore_use_poll=True,  # poll, not select: no FD_SETSIZE (1024) limit on sockets
        ident="radixkv",
        clear_untrusted_proxy_headers=True,
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


def serve_forever(app, host: str, port: int, announce=None, limits: Limits | None = None) -> None:
    """Foreground server until Ctrl-C; `announce(url)` is called once the port is bound."""
    server = _server(app, host, port, limits or Limits())
    if announce is not None:
        announce(f"http://{host}:{server.effective_port}")
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
