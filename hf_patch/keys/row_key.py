"""What a row's KV is keyed by: its token ids, per-token extra ids, and its namespace.

The tree matches int64 token sequences under a namespace root. Everything else the KV depends
on is folded into that key here:

- **Extra ids** (TensorRT-LLM's semantics): a uint64 per prompt token, 0 for plain text; the
  same id for the same embedding table / image. A plain token keys as itself; a token with
  extra id ``e != 0`` keys as a 63-bit mix of ``(token, e)`` with the top bit set, a negative
  int64 that no real token id can equal. Equal pairs match, other pairs do not (two different
  pairs collide with probability 2**-63). The mix is fixed arithmetic, the same in every
  process, so cache files keep their meaning.
- **Namespaces** (tenants, salts, adapters) are tree roots: rows of different namespaces never
  share a node. A *shared prefix* is the exception: its first ``length`` tokens are keyed under
  a public root (a task prompt every tenant reads, pinned once), and the rest of the row is
  folded with a salt derived from the row's private namespace, so what a tenant appends never
  matches another tenant's tokens.

>>> plain = np.array([5, 6, 7], dtype=np.int64)
>>> fold(plain, None).tolist() == plain.tolist()
True
>>> keyed = fold(plain, np.array([0, 9, 9], dtype=np.uint64))
>>> int(keyed[0]), bool(keyed[1] < 0), bool(keyed[1] != keyed[2])
(5, True, True)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from radixkv import KeyedNamespace, PackedTokens, pack_tokens
from radixkv.persist.manifest import encode_namespace

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TOP = np.uint64(1 << 63)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised over uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def fold(ids: np.ndarray, extra: np.ndarray | None) -> np.ndarray:
    """Key tokens of one row: ``ids`` int64 ``[n]``, ``extra`` uint64 ``[n]`` or None -> int64 ``[n]``."""
    if extra is None or not extra.any():
        return ids
    with np.errstate(over="ignore"):
        mixed = _mix(_mix(ids.astype(np.uint64) ^ _GOLDEN) ^ extra.astype(np.uint64)) | _TOP
    return np.where(extra != 0, mixed.view(np.int64), ids)


def namespace_salt(namespace: Hashable) -> int:
    """A nonzero 64-bit id of ``namespace``, the same in every process where it has a file form."""
    try:
        text = json.dumps(encode_namespace(namespace), sort_keys=True)
    except ValueError:  # no file form: then it cannot be saved either, a process-local id will do
        text = f"local:{hash(namespace)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") or 1


def combine(extra: np.ndarray | None, salt: int, start: int, length: int) -> np.ndarray:
    """``extra`` (or zeros) with positions ``start:`` mixed with ``salt``: nonzero there, and
    different for different salts whatever the extra id was."""
    out = np.zeros(length, dtype=np.uint64) if extra is None else extra.astype(np.uint64).copy()
    with np.errstate(over="ignore"):
        out[start:] = _mix(out[start:] ^ np.uint64(salt)) | np.uint64(1)
    return out


@dataclass(frozen=True)
class SharedPrefix:
    """The first ``length`` tokens of a row are public, keyed under ``namespace`` (a task
    prompt's); the row's own namespace keys only what follows."""

    namespace: Hashable
    length: int

    def __post_init__(self) -> None:
        hash(self.namespace)
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 0:
            raise ValueError(f"SharedPrefix.length must be an int >= 0, got {self.length!r}")


@dataclass(frozen=True)
class RowKey:
    """One row's key. ``ids``: its real token ids; ``tokens``: what the tree matches (ids with
    extra ids and the private salt folded in); ``namespace``: the tree root; ``computable``: how
    many leading tokens have KV that depends on their ids alone (no extra id), so that a forward
    over ids can compute them (in-batch sharing)."""

    ids: PackedTokens
    tokens: PackedTokens
    namespace: Hashable
    computable: int


def row_key(
    ids: np.ndarray,
    extra: np.ndarray | None,
    namespace: Hashable,
    shared: SharedPrefix | None,
    scope: int,
    adapter: tuple = (),
) -> RowKey:
    """The key of one row's real tokens (``ids`` int64, ``extra`` uint64 or None, both ``[n]``).

    The tree namespace is ``(scope, namespace)``, or, under a shared prefix of ``length > 0``,
    ``(scope, shared.namespace)`` with the tail salted by the private namespace; with an active
    adapter (``adapter``: its key parts, see hf_patch.keys.adapters) the second element is a
    ``KeyedNamespace`` carrying them, public part included (an adapter changes every token's KV).
    ``scope`` names the model (hf_patch.keys.weights.model_scope).
    """
    if extra is not None and not extra.any():
        extra = None
    nonzero = np.flatnonzero(extra) if extra is not None else ()
    computable = int(nonzero[0]) if len(nonzero) else len(ids)
    if shared is not None and shared.length > 0:
        base = shared.namespace
        start = min(shared.length, len(ids))
        folded = fold(ids, combine(extra, namespace_salt(namespace), start, len(ids)))
    else:
        base = namespace
        folded = fold(ids, extra)
    root = (scope, KeyedNamespace(base, adapter) if adapter else base)
    return RowKey(pack_tokens(ids), pack_tokens(folded), root, computable)
