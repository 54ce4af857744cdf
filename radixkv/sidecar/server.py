"""The sidecar's loop: accept clients on a Unix socket and answer their messages.

One thread runs every message (a match, an alloc, a commit are tree operations of microseconds;
the L2 tier's reads are bounded by its timeout), holding ``Sidecar.lock`` so the metrics thread
sees consistent numbers. A client's socket closing frees what it held (``Sidecar.drop_client``).

The socket file is created with mode 0600 (``mode``): only the owner's processes may attach, and
any process that can attach reads every block (docs/sidecar.md, Security).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import signal
import socket
import stat
import threading

from radixkv.sidecar.protocol import FrameBuffer, ProtocolError, encode, send
from radixkv.sidecar.state import Sidecar

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0  # a client that does not read its replies for this long is dropped


def _namespace(header: dict) -> tuple[bytes, bytes]:
    ident, ns = header.get("ident"), header.get("ns")
    if not isinstance(ident, str) or not isinstance(ns, str):
        raise ValueError("ident and ns must be strings")
    try:
        digest = bytes.fromhex(ident)
    except ValueError:
        raise ValueError("ident must be hex") from None
    return digest, ns.encode()


def _tokens(body: bytes) -> bytes:
    if len(body) % 8:
        raise ValueError(f"token body of {len(body)} bytes is not packed int64")
    return body


class Server:
    """Serves ``state`` on ``path`` until ``stop()`` (from another thread or a signal)."""

    def __init__(self, state: Sidecar, path: str, *, mode: int = 0o600) -> None:
        self.state = state
        self.path = path
        self.mode = mode
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[int, tuple[socket.socket, FrameBuffer]] = {}

    def _listen(self) -> socket.socket:
        # One sidecar per path, decided by a lock held for the server's life (released by the
        # kernel when the process dies), not by probing the socket: between another sidecar's
        # bind() and listen() a probe is refused, and the path of a live sidecar was unlinked.
        self._lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.mode)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise RuntimeError(
                f"a sidecar is already serving {self.path} (it holds {self.path}.lock)"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # a stale socket of a sidecar that died: we hold the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~self.mode)  # the file is born with the mode: no window of 0755
        try:
            sock.bind(self.path)
            os.chmod(self.path, self.mode)
            sock.listen(128)
        except BaseException:
            sock.close()
            os.close(self._lock_fd)
            raise
        finally:
            os.umask(old)
        return sock

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def serve(self) -> None:
        listener = self._listen()
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        logger.info("radixkv sidecar serving %s (mode %o)", self.path, self.mode)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(timeout=1.0):
                    if key.data == "wake":
                        continue
                    if key.data is None:
                        self._accept(listener, sel)
                    else:
                        self._readable(key.data, sel)
        finally:
            for cid in list(self._conns):
                self._drop(cid, sel)
            sel.close()
            listener.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._lock_fd)  # the lock goes with it; the .lock file stays (harmless)

    def _accept(self, listener: socket.socket, sel) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.settimeout(SEND_TIMEOUT_S)
        cid = conn.fileno()
        self._conns[cid] = (conn, FrameBuffer())
        with self.state.lock:
            self.state.add_client(cid)
        sel.register(conn, selectors.EVENT_READ, cid)

    def _drop(self, cid: int, sel) -> None:
        conn, _ = self._conns.pop(cid)
        with contextlib.suppress(Exception):
            sel.unregister(conn)
        conn.close()
        with self.state.lock:
            self.state.drop_client(cid)

    def _readable(self, cid: int, sel) -> None:
        conn, buffer = self._conns[cid]
        try:
            data = conn.recv(1 << 20)
            if not data:
                raise ConnectionError("closed")
            buffer.feed(data)
            for header, body in buffer.frames():
                self._handle(cid, conn, header, body)
        except (OSError, ConnectionError, ProtocolError) as e:
            if not isinstance(e, ConnectionError):
                logger.info("client %d dropped: %s", cid, e)
            self._drop(cid, sel)

    def _handle(self, cid: int, conn: socket.socket, header: dict, body: bytes) -> None:
        op, state = header.get("op"), self.state
        fds = None
        try:
            with state.lock:
                if op == "hello":
                    pool = state.hello(cid, header.get("layout"))
                    reply = {"num_blocks": pool.num_blocks, "pool_bytes": pool.geometry.total_bytes}
                    fds = [pool.fd]
                elif op == "match":
                    claim = header.get("claim", 0.0)
                    if type(claim) not in (int, float) or not 0 <= claim <= 3600:
                        raise ValueError(f"claim must be seconds in [0, 3600], got {claim!r}")
                    reply = state.match(
                        cid, _namespace(header), _tokens(body), header.get("have", 0), float(claim)
                    )
                elif op == "release":
                    state.release(cid, int(header.get("lease", 0)))
                    return
                elif op == "alloc":
                    reply = state.alloc(cid, _namespace(header), _tokens(body))
                elif op == "commit":
                    reply = {"inserted": state.commit(cid, int(header.get("txn", 0)))}
                elif op == "abort":
                    state.abort(cid, int(header.get("txn", 0)))
                    return
                elif op == "stats":
                    reply = {"stats": state.stats()}
                else:
                    raise ValueError(
                        f"unknown op {op!r}; ops: hello, match, release, alloc, commit, abort, stats"
                    )
        except (ValueError, TypeError) as e:
            if op in ("release", "abort"):
                logger.info("client %d: %s refused: %s", cid, op, e)
                return
            reply = {"error": f"{op}: {e}"}
        if fds:
            send(conn, reply, fds=fds)
        else:
            conn.sendall(encode(reply))


def install_signal_handlers(server: Server) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
