"""What one value in the shared tier holds: an 80-byte header, then the payload.

Header (little-endian)::

    magic      4 bytes  b"rkL2"
    version    u16      FORMAT_VERSION
    reserved   u16      0
    length     u64      payload length in bytes
    identity   16 bytes BLAKE3(identity)[:16]: whose block this is
    key        16 bytes BLAKE3(key)[:16]: the key the value was stored under
    checksum   32 bytes BLAKE3(payload)

A value is refused (``check`` returns a reason, never the payload) when it is shorter than a
header, has another magic or version, a length that disagrees with its size (truncated or
extended), another identity, another key (a value copied under the wrong key), or a checksum
that does not match. Every header field is compared with what it must be, so a flipped bit
anywhere, header included, is refused; the hash covers the payload alone (hashing a 48-byte
header first cost 3x the time of the payload alone at 64 KiB: BLAKE3's SIMD wants whole
chunks from the start). Like the cache files' checksums this
guards against damage and mix-ups, not against someone who can write to the store: they can
write a matching checksum too (docs/l2.md "Security").

Copies: ``pack_header`` reads the payload once (the checksum) and copies nothing; the stores
send or write header and payload side by side (resp_sets.py, file_store.py). ``pack_into``
(one buffer holding both) is for tests and tools. ``check`` returns a memoryview into the
fetched value, no copy.
"""

from __future__ import annotations

import struct

import blake3

MAGIC = b"rkL2"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHQ16s16s")  # the header before the checksum
HEADER_BYTES = _FIXED.size + 32
DIGEST_BYTES = 16

# The reasons a value is refused (also the names the stores log and count).
SHORT, MAGIC_KIND, VERSION, LENGTH, IDENTITY, KEY, CHECKSUM = (
    "short",
    "magic",
    "version",
    "length",
    "identity",
    "key",
    "checksum",
)
NOT_A_FILE = "not_a_file"  # file: a symlink, FIFO, device or directory where a block should be

WHY = {
    SHORT: "shorter than a header",
    MAGIC_KIND: "not a radixkv value",
    VERSION: "another value format version",
    LENGTH: "truncated, extended or over max_value_bytes",
    IDENTITY: "written for another model identity",
    KEY: "stored under another key",
    CHECKSUM: "checksum mismatch: damaged",
    NOT_A_FILE: "not a plain file (symlink, FIFO, device or directory)",
}


def digest16(data: bytes) -> bytes:
    """BLAKE3(data)[:16]: how the header names an identity or a key."""
    return blake3.blake3(data).digest(length=DIGEST_BYTES)


Parts = tuple[memoryview, ...]  # a payload given in pieces (e.g. one region per layer): their concatenation


def _parts(payload: memoryview | Parts) -> Parts:
    return (payload,) if isinstance(payload, memoryview) else payload


def _checksum(parts: Parts) -> bytes:
    h = blake3.blake3()
    for part in parts:
        h.update(part)  # the blake3 package releases the GIL on large inputs
    return h.digest()


def as_bytes_view(payload: object) -> memoryview:
    """A flat byte view of any C-contiguous buffer (bytes, bytearray, memoryview, numpy); no copy."""
    view = memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("L2 payload must be a C-contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def as_parts(payload: object) -> Parts:
    """A payload as byte views, no copy: one buffer, or a list/tuple of buffers meaning their
    concatenation (so a caller holding a block as regions needs no join)."""
    if isinstance(payload, (list, tuple)):
        return tuple(as_bytes_view(p) for p in payload)
    return (as_bytes_view(payload),)


def parts_nbytes(payload: memoryview | Parts) -> int:
    return sum(p.nbytes for p in _parts(payload))


def pack_header(identity_digest: bytes, key: bytes, payload: memoryview | Parts) -> bytes:
    """The 80 header bytes for ``payload`` stored under ``key`` (O(len(payload)) for the checksum)."""
    parts = _parts(payload)
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, parts_nbytes(parts), identity_digest, digest16(key))
    return fixed + _checksum(parts)


def pack_into(
    dest: memoryview, identity_digest: bytes, key: bytes, payload: memoryview | Parts
) -> memoryview:
    """Write header and payload to the start of ``dest`` (a copy of the payload); the view
    of ``dest`` they fill. ``dest`` must hold ``HEADER_BYTES + parts_nbytes(payload)`` bytes."""
    parts = _parts(payload)
    n = HEADER_BYTES + parts_nbytes(parts)
    if dest.nbytes < n:
        raise ValueError(f"pack_into: {dest.nbytes} bytes of room for a {n}-byte value")
    dest[:HEADER_BYTES] = pack_header(identity_digest, key, parts)
    at = HEADER_BYTES
    for part in parts:
        dest[at : at + part.nbytes] = part
        at += part.nbytes
    return dest[:n]


def pack(identity_digest: bytes, key: bytes, payload: memoryview | Parts) -> memoryview:
    """Header and payload in one new buffer; a view of it."""
    dest = memoryview(bytearray(HEADER_BYTES + parts_nbytes(payload)))
    return pack_into(dest, identity_digest, key, payload)


def check(
    value: bytes | bytearray | memoryview, identity_digest: bytes, key: bytes
) -> tuple[memoryview | None, str | None]:
    """``(payload view, None)`` for a sound value stored under ``key`` for this identity,
    ``(None, reason)`` otherwise (reason: one of the kinds above). Never raises on any bytes.
    """
    view = memoryview(value)
    if view.nbytes < HEADER_BYTES:
        return None, SHORT
    fixed = view[: _FIXED.size]
    magic, version, reserved, length, ident, key_digest = _FIXED.unpack(fixed)
    if magic != MAGIC:
        return None, MAGIC_KIND
    if version != FORMAT_VERSION or reserved != 0:
        return None, VERSION
    if length != view.nbytes - HEADER_BYTES:
        return None, LENGTH
    if ident != identity_digest:
        return None, IDENTITY
    if key_digest != digest16(key):
        return None, KEY
    payload = view[HEADER_BYTES:]
    if _checksum((payload,)) != view[_FIXED.size : HEADER_BYTES]:
        return None, CHECKSUM
    return payload, None
