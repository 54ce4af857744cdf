"""The sidecar's wire format: small framed messages over a Unix stream socket.

A frame is ``u32 header length, u32 body length`` (little endian), a JSON header (an object
with ``"op"``), then the body (raw bytes: packed int64 token ids). Block bytes never cross the
socket: they sit in the shared-memory pool whose file descriptor the ``hello`` reply carries
(SCM_RIGHTS).

Client -> sidecar (every op but ``release`` and ``abort`` gets one reply, in order):

    hello   {layout}                       -> {num_blocks, pool_bytes[, num_slots]} + the pool's fd
    match   {ident, ns, have, claim} body=tokens
                                           -> {lease, num_tokens, slots, wait[, snap, kv_tokens]}
                                              (slots of the blocks past ``have`` tokens, pinned until
                                              release; lease 0: none; ``claim`` s > 0: "I compute the
                                              rest", and ``wait``: tokens another client is computing
                                              now; with states, ``num_tokens`` ends at a snapshot,
                                              ``snap`` its slot, ``kv_tokens`` the KV matched)
    release {lease}                        (no reply)
    alloc   {ident, ns, snaps} body=tokens -> {txn, start, slots[, snaps]}  (``start`` blocks cached;
                                              slots to write for blocks start.., private to this
                                              client; with states, a state slot to write, or -1,
                                              per snapshot position asked for)
    commit  {txn}                          -> {inserted[, snapshots]}  (the blocks and snapshots
                                              become visible)
    abort   {txn}                          (no reply)
    stats   {}                             -> {stats}

``[...]``: only for a layout with ``states`` (a model with recurrent layers), whose pool holds
snapshot slots beside its blocks (``num_slots`` of them: ``radixkv.sidecar.layout``).

Replies with ``"error"`` name what was refused. ``ident`` is hex (a model identity digest), ``ns``
a string (the encoded namespace); both go into the tree's root key. Every op's fields, their
types and ranges: ``radixkv.sidecar.messages`` (the schema, the one place they are checked).

Bounds on a frame, checked before its header is parsed: a header of at most ``MAX_HEADER_BYTES``
nesting at most ``MAX_DEPTH`` arrays and objects, a body of at most ``MAX_BODY_BYTES``. A frame
past them, or whose header is not a JSON object, breaks the format: the sidecar closes that
connection (a client, the sidecar's). A header that is an object but no valid request gets an
error reply (the ops without a reply: nothing), and the connection goes on.
"""

from __future__ import annotations

import json
import math
import socket
import struct

HEADER = struct.Struct("<II")
MAX_HEADER_BYTES = 1 << 20
MAX_BODY_BYTES = 64 << 20  # 8M tokens
MAX_DEPTH = 16  # nesting of a header's arrays and objects (a hello's layout: 4)
MAX_INT_DIGITS = 40  # longer integers are out of every field's range: read as +-inf


class ProtocolError(ValueError):
    """A frame that breaks the format (sizes, nesting, JSON): the connection is closed."""


_KEEP = bytes(sorted(set(range(256)) - set(b"[]{}")))  # bytes.translate deletes these
_PAIRS = bytes.maketrans(b"[]{}", b"()()")


def nesting_within(head: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``head`` nests its arrays and objects at most ``limit`` deep (and
    its brackets outside strings pair up), found without parsing it: the parser recurses once a
    level, and ~100,000 levels end it in RecursionError. C-speed passes over at most 1 MiB."""
    if head.count(b"[") + head.count(b"{") <= limit:
        return True  # most headers: too few brackets to nest deeper, strings included
    # Drop what strings hold (escaped backslashes, then escaped quotes: what is left between
    # quotes is inside a string), keep the brackets outside them, as "(" and ")".
    text = head.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(text.split(b'"')[::2]).translate(_PAIRS, _KEEP)
    # Each pass removes the innermost pairs, one level: a sequence that pairs up and nests at
    # most ``limit`` deep is gone after ``limit`` passes; anything deeper or unpaired is not.
    for _ in range(limit):
        if not brackets:
            return True
        brackets = brackets.replace(b"()", b"")
    return not brackets


def _bounded_int(text: str) -> int | float:
    if len(text) > MAX_INT_DIGITS:  # int() of >4,300 digits raises, and no field is this wide
        return -math.inf if text.startswith("-") else math.inf
    return int(text)


def parse_header(head: bytes) -> dict:
    """A frame's header as a JSON object; ``ProtocolError`` when it is not one, or nests deeper
    than ``MAX_DEPTH``. Numbers past any range (``1e400``, ``Infinity``, 50 digits) parse as
    floats, for the schema (``radixkv.sidecar.messages``) to refuse by field."""
    if not nesting_within(head):
        raise ProtocolError(f"header nests deeper than {MAX_DEPTH} levels (or its brackets do not pair)")
    try:
        header = json.loads(head, parse_int=_bounded_int)
    except (ValueError, RecursionError) as e:  # RecursionError: never past nesting_within; kept as a guard
        raise ProtocolError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header must be a JSON object")
    return header


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
    """Bytes received so far on one connection; ``frames()`` yields each complete frame once
    (``next_frame()``: one, or None until one is complete). ``body``: the type bodies are
    made as, from the received bytes in one copy (the sidecar's: ``PackedTokens``, which its
    trees take as they are; an 8 M-token body copied once more cost ~0.1 s)."""

    def __init__(self, body: type[bytes] = bytes) -> None:
        self._buf = bytearray()
        self._body = body

    def __len__(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_frame(self) -> tuple[dict, bytes] | None:
        """The first complete frame, taken out; None when none is complete yet. Raises
        ``ProtocolError`` for one over the size limits (before its bytes arrive) or whose header
        is not a JSON object within ``MAX_DEPTH``."""
        if len(self._buf) < HEADER.size:
            return None
        head_len, body_len = HEADER.unpack_from(self._buf)
        if head_len > MAX_HEADER_BYTES or body_len > MAX_BODY_BYTES:
            raise ProtocolError(f"frame of {head_len} + {body_len} bytes is over the limits")
        end = HEADER.size + head_len + body_len
        if len(self._buf) < end:
            return None
        with memoryview(self._buf) as view:  # one copy of each (a slice of a bytearray is one more)
            head = bytes(view[HEADER.size : HEADER.size + head_len])
            body = self._body(view[HEADER.size + head_len : end])
        del self._buf[:end]
        return parse_header(head), body

    def frames(self):
        while (frame := self.next_frame()) is not None:
            yield frame


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
