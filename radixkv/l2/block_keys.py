"""Content addresses of whole blocks for the shared tier: a chained hash, as vLLM hashes blocks.

``h_i = BLAKE3(seed || h_{i-1} || tokens of block i)``, where ``seed`` is a BLAKE3 digest of the
model identity, the namespace key and the block size (each length-prefixed, so no two different
triples feed the same bytes), and ``h_{-1}`` is 32 zero bytes (or the ``parent``'s). So ``h_i``
depends on the identity, the namespace and every token of blocks ``0..i``: equal prefixes give
equal chains on any machine and in any process, and a prefix that differs anywhere (another
model, another namespace, one earlier token) gives different keys from the first block where it
differs onwards. A partial last block has no key (the tree stores whole blocks only).

A key is ``BLAKE3(identity)[:16] || h_i`` (48 bytes): the identity digest up front lets a store
check a value's identity from its key alone (value_format.py), and lets an operator find or
drop one model's blocks by prefix (docs/l2.md).

A recurrent-state snapshot taken after the first ``p`` tokens (a model with recurrent layers)
is stored under ``snapshot_key(key of block p / block_size - 1)``: the block key at its position
plus ``SNAPSHOT_MARKER``. It depends on every token before it as the block key does, starts with
the same identity digest, and is longer than any block key, so it never names a block value.

Tokens are hashed as little-endian signed 64-bit integers, so key tokens (negative 63-bit mixes
of an id and an extra id; docs/design.md "Vocabulary") are hashed as the tree matches them.
Cost: one BLAKE3 call per block (~1 µs for 16 tokens) plus one ``array`` conversion of the
tokens; no torch.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import blake3

ID_BYTES = 16  # the identity digest that starts every key
KEY_BYTES = ID_BYTES + 32  # identity digest + chain digest
SNAPSHOT_MARKER = b"#snapshot/1"  # after a block key: the snapshot at that block's end
SNAPSHOT_KEY_BYTES = KEY_BYTES + len(SNAPSHOT_MARKER)
_DOMAIN = b"radixkv.l2.block/1"  # changes when the recipe above changes
_ROOT = bytes(32)


def _chain_seed(identity: bytes, namespace_key: bytes, block_size: int) -> bytes:
    h = blake3.blake3(_DOMAIN)
    for part in (identity, namespace_key):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    h.update(struct.pack("<Q", block_size))
    return h.digest()


def _as_int64(tokens: Sequence[int]) -> array:
    if hasattr(tokens, "tolist"):  # a torch tensor or numpy array: one conversion, not per item
        tokens = tokens.tolist()
    try:
        packed = array("q", tokens)
    except OverflowError as exc:
        raise ValueError(f"block_keys: tokens must fit a signed 64-bit integer ({exc})") from None
    except TypeError as exc:
        raise ValueError(f"block_keys: tokens must be integers ({exc})") from None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed


def block_keys(
    identity: bytes,
    namespace_key: bytes,
    tokens: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
) -> list[bytes]:
    """The 48-byte keys of the whole blocks of ``tokens``: ``len(tokens) // block_size`` of them.

    ``identity``: the model's identity (weights fingerprint and KV layout) as bytes;
    ``namespace_key``: every other whole-request key part (namespace, adapter) as bytes;
    ``tokens``: the key tokens (ints, a list, tuple, array or 1-D tensor);
    ``parent``: the key of the block before ``tokens[0]`` when continuing a chain (None: the
    tokens start the sequence). Raises ValueError naming the argument that is wrong.
    Complexity: O(len(tokens)). Pure function; thread safe.
    """
    for name, value in (("identity", identity), ("namespace_key", namespace_key)):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ValueError(f"block_keys: {name} must be bytes, got {type(value).__name__}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_keys: block_size must be a positive int, got {block_size!r}")
    identity = bytes(identity)
    id_digest = blake3.blake3(identity).digest(length=ID_BYTES)
    if parent is None:
        chain = _ROOT
    elif not isinstance(parent, bytes) or len(parent) != KEY_BYTES or parent[:ID_BYTES] != id_digest:
        raise ValueError(
            f"block_keys: parent must be a {KEY_BYTES}-byte key from block_keys for this identity, or None"
        )
    else:
        chain = parent[ID_BYTES:]
    packed = _as_int64(tokens)
    seed = _chain_seed(identity, bytes(namespace_key), block_size)
    view = memoryview(packed).cast("B")
    step = block_size * packed.itemsize
    keys: list[bytes] = []
    for i in range(len(packed) // block_size):
        h = blake3.blake3(seed)
        h.update(chain)
        h.update(view[i * step : (i + 1) * step])
        chain = h.digest()
        keys.append(id_digest + chain)
    return keys


def snapshot_key(block_key: bytes) -> bytes:
    """The key of the snapshot taken after the block ``block_key`` names (a ``block_keys`` key):
    the block key plus ``SNAPSHOT_MARKER``. Raises ValueError for a key of another length."""
    if not isinstance(block_key, bytes) or len(block_key) != KEY_BYTES:
        raise ValueError(f"snapshot_key: a {KEY_BYTES}-byte key from block_keys is needed")
    return block_key + SNAPSHOT_MARKER


def key_identity(key: bytes) -> bytes | None:
    """The identity digest a block key (or a snapshot key) starts with; None for another key."""
    if len(key) == KEY_BYTES or (len(key) == SNAPSHOT_KEY_BYTES and key.endswith(SNAPSHOT_MARKER)):
        return key[:ID_BYTES]
    return None
