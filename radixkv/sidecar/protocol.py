"""The sidecar's wire format: small framed messages over a Unix stream socket.

A frame is ``u32 header length, u32 body length`` (little endian), a JSON header (an object
with ``"op"``), then the body (raw bytes: packed int64 token ids). Block bytes never cross the
socket: they sit in the shared-memory pool whose file descriptor the ``hello`` reply carries
(SCM_RIGHTS).

Client -> sidecar (every op but ``release`` and ``abort`` gets one reply, in order):

    hello   {layout}                       -> {num_blocks, pool_bytes} + the pool's fd
    match   {ident, ns, have, claim} body=tokens
                                           -> {lease, num_tokens, slots, wait}  (slots of the blocks
                                              past ``have`` tokens, pinned until release; lease 0:
                                              none; ``claim`` s > 0: "I compute the rest", and
                                              ``wait``: tokens another client is computing now)
    release {lease}                        (no reply)
    alloc   {ident, ns} body=tokens        -> {txn, start, slots}  (``start`` blocks cached; slots to
                                              write for blocks start.., private to this client)
    commit  {txn}                          -> {inserted}  (the blocks become visible)
    abort   {txn}                          (no reply)
    stats   {}                             -> {stats}

Replies with ``"error"`` name what was refused. ``ident`` is hex (a model identity digest), ``ns``
a string (the encoded namespace); both go into the tree's root key.
"""

from __future__ import annotations

import json
import socket
import struct

HEADER = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 20
MAX_BODY_BYTES = 64 << 20  # 8M tokens


class ProtocolError(ValueError):
    """A frame that breaks the format (sizes, JSON): the connection is closed."""


def encode(header: dict, body: bytes = b"") -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode()
    return HEADER.pack(len(head), len(body)) + head + body


def send(sock: socket.socket, header: dict, body: bytes = b"", fds: list[int] | None = None) -> None:
    data = encode(header, body)
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


class FrameBuffer:
    """Bytes received so far on one connection; ``frames()`` yields each complete frame once."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def frames(self):
        while len(self._buf) >= HEADER.size:
            head_len, body_len = HEADER.unpack_from(self._buf)
            if head_len > MAX_HEADER_BYTES or body_len > MAX_BODY_BYTES:
                raise ProtocolError(f"frame of {head_len} + {body_len} bytes is over the limits")
            end = HEADER.size + head_len + body_len
            if len(self._buf) < end:
                return
            head = bytes(self._buf[HEADER.size : HEADER.size + head_len])
            body = bytes(self._buf[HEADER.size + head_len : end])
            del self._buf[:end]
            try:
                header = json.loads(head)
            except ValueError as e:
                raise ProtocolError(f"header is not JSON: {e}") from None
            if not isinstance(header, dict):
                raise ProtocolError("header must be a JSON object")
            yield header, body


def recv(
    sock: socket.socket, buffer: FrameBuffer, *, with_fds: bool = False
) -> tuple[dict, bytes, list[int]]:
    """Block until one frame is complete (the client side); ``with_fds``: collect passed fds."""
    fds: list[int] = []
    while True:
        for header, body in buffer.frames():
            return header, body, fds
        if with_fds:
            data, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
            fds += got
        else:
            data = sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the sidecar closed the connection")
        buffer.feed(data)
