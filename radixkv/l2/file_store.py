"""The shared tier in a directory (``file:DIR``), e.g. on a filesystem several machines mount.

One file per key under two fan-out levels (``DIR/ab/cd/<key in hex>``, ``abcd`` from a hash of
the key; 65,536 subdirectories at most), holding the same header and checksum as a Redis value
(value_format.py). A write goes to a temporary name in the same subdirectory
(``.NAME.PID.RANDOM.tmp``) and is renamed over the final name: a reader sees the old file, the new file or none, never part of one, on any POSIX
filesystem where rename is atomic (local, NFS, CephFS, Lustre). A writer killed mid-write
leaves a ``.tmp`` file nobody reads (docs/l2.md says how to sweep them).

Nothing here evicts: DIR grows until the operator prunes it (docs/l2.md). ``timeout_s`` is not
enforced: a hung network filesystem blocks the calling thread (the kernel decides; mount with
``soft,timeo=`` to bound it). A missing DIR (unmounted) is an outage, as Redis down is; DIR is
never created by a write (that would fill the mount point's local disk instead).

Every path below DIR is walked with ``dir_fd`` and ``O_NOFOLLOW``: a symlink planted in DIR
(for a fan-out directory or a block) is refused, never followed out of DIR, and a FIFO is never
blocked on. Thread safe: every file operation is independent; the counters are in health.py.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from collections.abc import Sequence

import blake3

from radixkv.l2.health import Health
from radixkv.l2.inputs import checked_items, checked_keys, identities, identity_digest
from radixkv.l2.url import L2Url
from radixkv.l2.value_format import HEADER_BYTES, LENGTH, NOT_A_FILE, Parts, check, pack_header, parts_nbytes

logger = logging.getLogger(__name__)

_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
_IOV_MAX = 512  # buffers per writev (Linux allows 1024)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """os.writev until every byte of ``parts`` is written (a write may be partial)."""
    while parts:
        n = os.writev(fd, parts[:_IOV_MAX])
        while parts and n >= parts[0].nbytes:
            n -= parts[0].nbytes
            parts = parts[1:]
        if parts and n:
            parts = [parts[0][n:], *parts[1:]]


class FileStore:
    """L2Store on a directory (see l2_store.L2Store for the contract)."""

    def __init__(
        self,
        url: L2Url,
        *,
        timeout_s: float,
        identity: bytes | None = None,
        fsync: bool = False,
        file_mode: int = 0o600,
        max_value_bytes: int = 512 * 1024 * 1024,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        **unknown,
    ):
        if unknown:
            raise ValueError(
                f"L2 option(s) {sorted(unknown)} unknown for file: (allowed: identity, fsync, file_mode, "
                "max_value_bytes, backoff_s, backoff_max_s)"
            )
        root = os.path.abspath(url.path)
        if not os.path.isdir(root):
            raise ValueError(
                f"L2 {url.redacted()}: directory {root!r} does not exist (create or mount it first)"
            )
        if not isinstance(file_mode, int) or not 0 <= file_mode <= 0o777:
            raise ValueError(f"L2 file_mode must be a permission number like 0o600, got {file_mode!r}")
        if not isinstance(max_value_bytes, int) or max_value_bytes < 1:
            raise ValueError(f"L2 max_value_bytes must be a positive int, got {max_value_bytes!r}")
        self._max_value_bytes = max_value_bytes
        self.url = url
        self.name = f"file:{root}"
        self.root = root
        self._identity = identity_digest(identity)
        self._fsync = bool(fsync)
        self._mode = file_mode
        self.health = Health(self.name, backoff_s, backoff_max_s)

    @staticmethod
    def _parts(key: bytes) -> tuple[str, str, str]:
        """The two fan-out directories (from BLAKE3 of the key: even for keys that share a
        prefix, such as one model's block keys) and the file name (the key in hex, or its
        digest for a key over 64 bytes)."""
        digest = blake3.blake3(key).hexdigest()
        return digest[:2], digest[2:4], key.hex() if len(key) <= 64 else digest

    def path_of(self, key: bytes) -> str:
        """The file that holds ``key``'s value."""
        return os.path.join(self.root, *self._parts(key))

    def _open_dirs(self, key: bytes, create: bool) -> list[int]:
        """Descriptors of DIR and the key's two fan-out directories, each opened without
        following a symlink (a planted link cannot send reads or writes outside DIR); the
        caller closes them. FileNotFoundError when one is missing and ``create`` is False."""
        fds = [os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
        try:
            for name in self._parts(key)[:2]:
                if create:
                    try:
                        os.mkdir(name, dir_fd=fds[-1])
                    except FileExistsError:
                        pass
                fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def _read(self, key: bytes) -> tuple[bytearray | None, str | None]:
        """``(file bytes, None)``, ``(None, None)`` for no file, or ``(None, reason)`` for a path
        that is no plain file (a symlink, FIFO, device, directory, or a fan-out directory that
        is a link: opened without following or blocking) or one larger than ``max_value_bytes``
        (not read)."""
        try:
            dirs = self._open_dirs(key, create=False)
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return None, NOT_A_FILE
            raise
        try:
            fd = os.open(self._parts(key)[2], _READ_FLAGS, dir_fd=dirs[-1])
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink where a block should be
                return None, NOT_A_FILE
            raise
        finally:
            for d in dirs:
                os.close(d)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, NOT_A_FILE
            if st.st_size > self._max_value_bytes:
                return None, LENGTH
            buf = bytearray(st.st_size)
            view, got = memoryview(buf), 0
            while got < st.st_size:
                n = os.readv(fd, [view[got:]])
                if n == 0:  # shrunk under us (rename replaces, never truncates): damaged
                    return None, LENGTH
                got += n
            return buf, None
        finally:
            os.close(fd)

    def get_many(self, keys: Sequence[bytes], *, identity: bytes | None = None) -> list[memoryview | None]:
        """One payload view per key (None: no file, refused, or DIR gone); never raises for I/O."""
        keys = checked_keys(keys, "get_many")
        fixed = self._identity if identity is None else identity_digest(identity)
        want = identities(keys, fixed, "get_many")
        out: list[memoryview | None] = [None] * len(keys)
        self.health.add(reads=len(keys))
        if not keys:
            return out
        if not self.health.may_try():
            self.health.add(skipped=len(keys))
            return out
        if not os.path.isdir(self.root):
            self.health.failed("get", FileNotFoundError(errno.ENOENT, "L2 directory is gone", self.root))
            self.health.add(errors=len(keys))
            return out
        self.health.succeeded()
        hits = nbytes = errors = 0
        for i, key in enumerate(keys):
            try:
                value, reason = self._read(key)
            except OSError as exc:
                errors += 1
                logger.debug("L2 %s read %s: %s", self.name, key[:8].hex(), exc)
                continue
            if reason is not None:
                self.health.refused(reason, key)
                continue
            if value is None:
                continue
            payload, reason = check(value, want[i], key)
            if payload is None:
                self.health.refused(reason, key)
                continue
            out[i] = payload
            hits += 1
            nbytes += payload.nbytes
        self.health.add(hits=hits, errors=errors, bytes_read=nbytes)
        return out

    def _write(self, key: bytes, header: bytes, payload: Parts) -> None:
        dirs = self._open_dirs(key, create=True)  # never creates DIR itself: see the module docstring
        folder = dirs[-1]
        name = self._parts(key)[2]
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, _WRITE_FLAGS, self._mode, dir_fd=folder)
            try:
                try:
                    _write_all(fd, [memoryview(header), *payload])
                    if self._fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=folder)
                except OSError:
                    pass
                raise
        finally:
            for d in dirs:
                os.close(d)

    def put_many(self, items: Sequence[tuple[bytes, object]], *, identity: bytes | None = None) -> int:
        """Write each ``(key, payload)`` (header + payload by writev, no concatenation); the number
        written. A full or read-only filesystem is counted and logged once; DIR gone is an outage."""
        items = checked_items(items)
        fixed = self._identity if identity is None else identity_digest(identity)
        idents = identities([k for k, _ in items], fixed, "put_many")
        if not items:
            return 0
        if not self.health.may_try():
            self.health.add(skipped=len(items))
            return 0
        stored = nbytes = 0
        for i, (key, payload) in enumerate(items):
            if HEADER_BYTES + parts_nbytes(payload) > self._max_value_bytes:
                self.health.write_rejected(1, f"value over max_value_bytes={self._max_value_bytes}")
                continue
            try:
                self._write(key, pack_header(idents[i], key, payload), payload)
            except OSError as exc:
                if exc.errno in _FULL:
                    self.health.write_rejected(1, f"{type(exc).__name__}: {exc}")
                    continue
                if not os.path.isdir(self.root):
                    self.health.failed("put", exc)
                    self.health.add(errors=len(items) - i)
                    break
                self.health.write_rejected(1, f"{type(exc).__name__}: {exc}")
                continue
            stored += 1
            nbytes += HEADER_BYTES + parts_nbytes(payload)
        if stored == len(items):
            self.health.writes_accepted()
        if stored:
            self.health.succeeded()
            self.health.add(writes=stored, bytes_written=nbytes)
        return stored

    def stats(self) -> dict[str, int]:
        """The counters of health.COUNTERS, as RedisStore.stats()."""
        return self.health.stats()

    def close(self) -> None:
        """Nothing to release (no file stays open between calls)."""
