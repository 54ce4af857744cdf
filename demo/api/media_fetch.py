"""One remote image (or video) download under one deadline, from the name lookup to the last byte.

    raw = fetch(url, host, port, deadline, max_bytes)   # bytes; FetchError / TimeoutError

``--media-fetch-timeout`` is a wall-clock budget for the whole fetch. A socket timeout alone
bounds each read, not their sum: a host that sends its status line and then one header byte
every 0.3 s would hold the request (and its server thread) for as long as it likes. So:

- the name is resolved in a small pool of resolver threads and waited for until the deadline
  (``getaddrinfo`` cannot be interrupted: a hung lookup keeps its pool thread, never the
  request);
- the connection goes to the address resolved here (no second lookup that could answer
  differently), with a socket timeout of the time left;
- a timer shuts the socket down at the deadline, which ends whatever read is under way
  (TLS handshake, status line, headers, body);
- no proxies (from the environment or elsewhere), no redirects (a redirect may point anywhere:
  it is refused as ``HTTP 3xx``), at most ``max_bytes`` of body.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from demo.api.schema import decimal

_CHUNK = 64 << 10
_RESOLVERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="radixkv-resolve")


class FetchError(Exception):
    """The remote host refused or failed (``str(e)`` says how); the caller's problem, a 400."""


class TooLarge(FetchError):
    """The body is (or says it is) longer than ``max_bytes``."""


def _resolve(host: str, port: int, deadline: float) -> list[tuple]:
    future = _RESOLVERS.submit(socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM)
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        future.cancel()
        raise TimeoutError from None
    except socket.gaierror as e:
        raise FetchError(f"cannot resolve {host!r}: {e.strerror or e}") from None


def _connect(addresses: list[tuple], deadline: float) -> socket.socket:
    error: OSError | None = None
    for family, kind, proto, _, address in addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
            return sock
        except OSError as e:
            sock.close()
            if isinstance(e, TimeoutError):
                raise
            error = e
    raise FetchError(f"cannot connect: {error}")


class _Connection(http.client.HTTPConnection):
    """An HTTP(S) connection over a socket connected beforehand (to the address resolved here)."""

    def __init__(self, host: str, port: int, sock: socket.socket, tls: bool, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._ready, self._tls = sock, tls

    def connect(self) -> None:
        sock = self._ready
        if self._tls:
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        self.sock = sock


def fetch(
    url_path: str,
    scheme: str,
    host: str,
    port: int | None,
    deadline: float,
    max_bytes: int,
    accept: str = "image/*",
) -> bytes:
    """GET ``url_path`` (path and query) from ``scheme://host:port``, done by ``deadline``
    (``time.monotonic()``), asking for ``accept`` (a media type). Raises TimeoutError past the
    deadline, TooLarge past ``max_bytes``, FetchError for anything the remote side did wrong
    (status other than 200 included)."""
    tls = scheme == "https"
    port = port or (443 if tls else 80)
    sock = _connect(_resolve(host, port, deadline), deadline)
    expired = threading.Event()

    def cut() -> None:  # ends any read under way, whatever the remote host drips
        expired.set()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), cut)
    timer.daemon = True
    timer.start()
    conn = _Connection(host, port, sock, tls, max(0.001, deadline - time.monotonic()))
    try:
        conn.request("GET", url_path or "/", headers={"User-Agent": "radixkv-demo", "Accept": accept})
        resp = conn.getresponse()
        if resp.status != 200:
            where = resp.getheader("Location")
            raise FetchError(
                f"HTTP {resp.status} {resp.reason}"
                + (f" (redirect to {where} not followed)" if where else "")
            )
        length = decimal((resp.getheader("Content-Length") or "").strip())
        if length is not None and length > max_bytes:  # (a malformed length: read to the limit)
            raise TooLarge
        chunks, size = [], 0
        while chunk := resp.read1(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise TooLarge
            chunks.append(chunk)
        if expired.is_set():  # the cut may read as a clean end of a body without a length
            raise TimeoutError
        return b"".join(chunks)
    except (OSError, http.client.HTTPException, ValueError) as e:
        if expired.is_set() or isinstance(e, TimeoutError):
            raise TimeoutError from None
        if isinstance(e, ssl.SSLError):
            raise FetchError(f"TLS: {e.reason or e}") from None
        raise FetchError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__) from None
    finally:
        timer.cancel()
        conn.close()
        sock.close()
