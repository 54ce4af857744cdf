"""Running the app: werkzeug's threaded WSGI server, in the foreground or in a thread.

Each HTTP request gets its own thread; generation itself is serialized by the engine's
single worker (see demo.engine), so many clients can stream at once and queue fairly.
"""

from __future__ import annotations

import selectors
import socket
import threading
from collections.abc import Callable
from contextlib import contextmanager

from werkzeug.serving import make_server


def client_alive(environ) -> Callable[[], bool] | None:
    """A check that the HTTP client is still connected, or None where the server gives no socket.

    werkzeug's server puts the connection in the environ. A closed peer makes the socket
    readable with nothing to read (EOF). Data waiting (a pipelined request) means alive; so
    does any failure of the check itself: a check must never cancel a live request.
    """
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
    """A live server on host:port (port 0 = a free one) in a daemon thread.

    >>> with ServerThread(app) as srv: requests.get(srv.url + "/health")   # doctest: +SKIP
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self._server = make_server(host, port, app, threaded=True)
        self.host, self.port = host, self._server.server_port
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="radixkv-http", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def serving(app, host: str = "127.0.0.1", port: int = 0):
    """`with serving(app) as url:` a base URL such as http://127.0.0.1:43121."""
    with ServerThread(app, host, port) as server:
        yield server.url


def serve_forever(app, host: str, port: int, announce=None) -> None:
    """Foreground server until Ctrl-C; `announce(url)` is called once the port is bound."""
    server = make_server(host, port, app, threaded=True)
    if announce is not None:
        announce(f"http://{host}:{server.server_port}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
