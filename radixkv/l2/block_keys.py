"""Content addresses of whole blocks for the shared tier: a chained hash, as vLLM hashes blocks.

``key_i = BLAKE3(seed || key_{i-1} || tokens of block i)``, where ``seed`` is a BLAKE3 digest of
the model identity, the namespace key and the block size (each length-prefixed, so no two
different triples feed the same bytes), and ``key_{-1}`` is 32 zero bytes (or ``parent``). So
``key_i`` depends on the identity, the namespace and every token of blocks ``0..i``: equal
prefixes give equal chains on any machine and in any process, and a prefix that differs
anywhere (another model, another namespace, one earlier token) gives different keys from the
first block where it differs onwards. A partial last block has no key (the tree stores whole
blocks only).

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

KEY_BYTES = 32  # a key is a raw BLAKE3 digest
_DOMAIN = b"radixkv.l2.block/1"  # changes when the recipe above changes
_ROOT = bytes(KEY_BYTES)


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
    """The 32-byte keys of the whole blocks of ``tokens``: ``len(tokens) // block_size`` of them.

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
    if parent is None:
        parent = _ROOT
    elif not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise ValueError(f"block_keys: parent must be a {KEY_BYTES}-byte key from block_keys or None")
    packed = _as_int64(tokens)
    seed = _chain_seed(bytes(identity), bytes(namespace_key), block_size)
    view = memoryview(packed).cast("B")
    step = block_size * packed.itemsize
    keys: list[bytes] = []
    for i in range(len(packed) // block_size):
        h = blake3.blake3(seed)
        h.update(parent)
        h.update(view[i * step : (i + 1) * step])
        parent = h.digest()
        keys.append(parent)
    return keys
