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

from radixkv.sidecar import messages as m
from radixkv.sidecar.protocol import FrameBuffer, ProtocolError, encode, send
from radixkv.sidecar.state import Sidecar

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 5.0  # a client that does not read its replies for this long is dropped


class ServeError(RuntimeError):
    """Why the sidecar cannot serve on its path (taken by another sidecar or by a file, or not
    creatable), in one line naming the path and what to do."""


class Server:
    """Serves ``state`` on ``path`` until ``stop()`` (from another thread or a signal)."""

    def __init__(self, state: Sidecar, path: str, *, mode: int = 0o600) -> None:
        self.state = state
        self.path = path
        self.mode = mode
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[int, tuple[socket.socket, FrameBuffer]] = {}
        self._listener: socket.socket | None = None

    def listen(self) -> socket.socket:
        """Take the path and listen on it (``serve`` does, if not done yet); ``ServeError`` with
        one line for the user when the path is taken or cannot be made."""
        # One sidecar per path, decided by a lock held for the server's life (released by the
        # kernel when the process dies), not by probing the socket: between another sidecar's
        # bind() and listen() a probe is refused, and the path of a live sidecar was unlinked.
        path, lock = self.path, self.path + ".lock"
        try:
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.mode)
        except OSError as e:
            raise ServeError(
                f"cannot create {lock} ({e.strerror or e}): give the sidecar a --socket in a directory "
                "that exists and that this user may write"
            ) from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ServeError(
                f"a sidecar is already serving {path} (it holds {lock}): stop it first, or give this one "
                "another --socket"
            ) from None
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISSOCK(mode):
            os.close(self._lock_fd)
            kind = (
                "a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode) else "a file"
            )
            raise ServeError(
                f"{path} is not a socket ({kind}): remove it, or give the sidecar another --socket"
            )
        if mode is not None:
            os.unlink(path)  # a stale socket of a sidecar that died: we hold the lock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~self.mode)  # the file is born with the mode: no window of 0755
        try:
            sock.bind(path)
            os.chmod(path, self.mode)
            sock.listen(128)
        except OSError as e:
            sock.close()
            os.close(self._lock_fd)
            raise ServeError(
                f"cannot create the socket {path} ({e.strerror or e}): give the sidecar another --socket"
            ) from None
        except BaseException:
            sock.close()
            os.close(self._lock_fd)
            raise
        finally:
            os.umask(old)
        self._listener = sock
        return sock

    def close(self) -> None:
        """Give the path up (``serve`` does when it ends): the socket file goes, the lock with it."""
        if self._listener is None:
            return
        self._listener.close()
        self._listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._lock_fd)  # the lock goes with it; the .lock file stays (harmless)

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def serve(self) -> None:
        listener = self._listener or self.listen()
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
            self.close()

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
        except Exception:  # a bug on one client's request: that client goes, the others are served
            logger.exception("client %d dropped: its request raised", cid)
            self._drop(cid, sel)

    def _handle(self, cid: int, conn: socket.socket, header: dict, body: bytes) -> None:
        try:
            request = m.parse_request(header, body)
        except m.BadRequest as e:
            if not e.replies:
                logger.info("client %d: %s", cid, e)
                return
            conn.sendall(encode({"error": str(e)}))
            return
        op, fds = request.op_name, None
        try:
            with self.state.lock:
                reply = self._run(cid, request, body)
        except (ValueError, TypeError) as e:  # refused by the state (no hello yet, no such txn, ...)
            if not request.REPLIES:
                logger.info("client %d: %s refused: %s", cid, op, e)
                return
            reply = {"error": f"{op}: {e}"}
        if reply is None:
            return
        if isinstance(request, m.Hello) and "error" not in reply:
            fds = [reply.pop("fd")]
        if fds:
            send(conn, reply, fds=fds)
        else:
            conn.sendall(encode(reply))

    def _run(self, cid: int, request: m.Request, body: bytes) -> dict | None:
        """Do one request (under the state's lock; ``body``: its tokens, for the ops that take
        them); its reply, None for ops that get none."""
        state = self.state
        match request:
            case m.Hello(layout=layout):
                pool = state.hello(cid, layout)
                return {"num_blocks": pool.num_blocks, "pool_bytes": pool.geometry.total_bytes, "fd": pool.fd}
            case m.Match():
                return state.match(cid, request.namespace, body, request.have, request.claim)
            case m.Release(lease=lease):
                state.release(cid, lease)
            case m.Alloc():
                return state.alloc(cid, request.namespace, body)
            case m.Commit(txn=txn):
                return {"inserted": state.commit(cid, txn)}
            case m.Abort(txn=txn):
                state.abort(cid, txn)
            case m.Stats():
                return {"stats": state.stats()}
            case _:
                raise AssertionError(f"no handler for {request!r}")  # a request type added without one
        return None


def install_signal_handlers(server: Server) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
