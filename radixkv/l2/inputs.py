"""Argument checks shared by the L2 stores: bad input is a caller's bug and raises ValueError
naming what was wrong (a store that is down, slow or full never raises; see health.py)."""

from __future__ import annotations

from collections.abc import Sequence

from radixkv.l2.block_keys import key_identity
from radixkv.l2.value_format import Parts, as_parts, digest16

MAX_KEY_BYTES = 1024


def checked_keys(keys: Sequence[bytes], what: str) -> list[bytes]:
    """``keys`` as a list of non-empty bytes of at most MAX_KEY_BYTES each."""
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise ValueError(f"L2 {what}: keys must be a list of bytes, got {type(keys).__name__}")
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(
                f"L2 {what}: key {i} must be 1-{MAX_KEY_BYTES} bytes (block_keys gives 48), got {type(key).__name__}"
                + (f" of {len(key)} bytes" if isinstance(key, bytes) else "")
            )
    return list(keys)


def checked_items(items: Sequence[tuple[bytes, object]]) -> list[tuple[bytes, Parts]]:
    """``items`` as ``(key, byte views of the payload)`` pairs; no payload is copied. A payload
    is one buffer, or a list/tuple of buffers meaning their concatenation."""
    if not isinstance(items, Sequence):
        raise ValueError(f"L2 put_many: items must be a list of (key, payload), got {type(items).__name__}")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"L2 put_many: item {i} must be a (key, payload) tuple")
        checked_keys([item[0]], f"put_many item {i}")
        try:
            parts = as_parts(item[1])
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"L2 put_many: item {i}'s payload must be a contiguous bytes-like buffer or a list of them ({exc})"
            ) from None
        out.append((item[0], parts))
    return out


def identity_digest(identity: object) -> bytes | None:
    """The 16-byte digest a value header names ``identity`` by; None for None."""
    if identity is None:
        return None
    if not isinstance(identity, (bytes, bytearray, memoryview)):
        raise ValueError(f"L2 identity must be bytes, got {type(identity).__name__}")
    return digest16(bytes(identity))


_NO_IDENTITY = digest16(b"")


def identities(keys: list[bytes], fixed: bytes | None, what: str) -> list[bytes]:
    """The identity digest each key's value is written with and checked against: ``fixed`` (an
    ``identity=`` the caller gave), else the one a block key starts with (block_keys.py), else
    the digest of b"" for a key of another shape. ValueError when a block key was made for
    another identity than ``fixed``: the caller mixed up models."""
    out = []
    for i, key in enumerate(keys):
        own = key_identity(key)
        if fixed is not None and own is not None and own != fixed:
            raise ValueError(f"L2 {what}: key {i} was made by block_keys for another identity than identity=")
        out.append(fixed if fixed is not None else own if own is not None else _NO_IDENTITY)
    return out
