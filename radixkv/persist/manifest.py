"""The manifest of a saved cache file: what its KV depends on, and the checks a restore makes.

A cache file (``radixkv.persist``) is one safetensors file whose header metadata holds two
strings: ``radixkv.manifest`` (this JSON document) and ``radixkv.manifest_sha256`` (its
hash, so a flipped bit in a namespace or a count is caught, not silently obeyed). The
manifest holds:

- ``format`` / ``version``: ``FORMAT`` and a version in ``READABLE_VERSIONS``; anything else
  is refused. Version 2 added ``checksum``, the algorithm of the tensors' checksums
  (radixkv.persist.checksum: "blake3"; version 1 files used sha256 and still restore). Version 3
  (this radixkv writes it) adds recurrent-state snapshots (``layout.states``, below); a file
  without them is a version 2 file in all but the number, so versions 1 and 2 still restore
  into stores without states.
- ``identity``: an opaque JSON object from the caller (hf_patch puts the model class, a
  config hash and a weights fingerprint there); a restore requires it to be equal.
- ``layout``: block size and every layer's KV heads, head dims and dtype (not the device:
  a file saved on one GPU restores on another, or on the CPU); for a store with a state pool
  (``KVStore(states=)``) also ``states``: every ``StateSpec``'s shape and dtype, in order. A
  file with states restores only into a store with the same states, one without only into a
  store without (``check_compatible`` says which side has none).
- ``namespaces``: the namespaces of the saved nodes, JSON-encoded by ``encode_namespace``.
- ``counts``: nodes, blocks, tokens (and snapshots, with states); ``checksums``: the hex digest
  of every tensor's bytes.

Namespaces are limited to None, str, bytes, int, tuples of these and KeyedNamespace: each has one JSON
spelling, so a namespace restores equal (and hashing equal) to the one saved.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
from collections.abc import Hashable, Mapping, Sequence

import torch

FORMAT = "radixkv-cache"
FORMAT_VERSION = 3  # written; versions 1 (sha256 checksums) and 2 (no snapshots) are still read
READABLE_VERSIONS = (1, 2, 3)
STATES_SINCE = 3  # the first version whose layout may hold ``states``
MANIFEST_KEY = "radixkv.manifest"
MANIFEST_HASH_KEY = "radixkv.manifest_sha256"


class CacheFileError(ValueError):
    """A cache file was refused; the store was not changed."""


class CorruptCacheFile(CacheFileError):
    """The file is empty, truncated, altered or not a radixkv cache file."""


class CacheFileMismatch(CacheFileError):
    """The file is intact but was saved for another model, layout or format version."""


# -- namespaces -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KeyedNamespace:
    """A namespace plus key parts the KV depends on (e.g. ``("adapter", name, weights digest)``).

    Its own type, so that no user namespace (a plain tuple) can ever equal one, in the tree or
    in a file: ``{"keyed": [namespace, parts]}``.
    """

    namespace: Hashable
    parts: tuple


def encode_namespace(ns: Hashable) -> object:
    """``ns`` as JSON: null, {"str": s}, {"bytes": base64}, {"int": n}, {"tuple": [...]},
    {"keyed": [namespace, parts]}.

    Raises ValueError for any other type (a bool too: True == 1 would restore as 1).
    """
    if ns is None:
        return None
    if type(ns) is str:
        return {"str": ns}
    if type(ns) is bytes:
        return {"bytes": base64.b64encode(ns).decode("ascii")}
    if type(ns) is int:
        return {"int": ns}
    if type(ns) is tuple:
        return {"tuple": [encode_namespace(x) for x in ns]}
    if type(ns) is KeyedNamespace:
        return {"keyed": [encode_namespace(ns.namespace), encode_namespace(ns.parts)]}
    raise ValueError(
        f"namespace {ns!r} ({type(ns).__name__}) cannot be saved: only None, str, bytes, int, "
        "tuples of these and KeyedNamespace have one unambiguous file form"
    )


def decode_namespace(obj: object) -> Hashable:
    """Inverse of ``encode_namespace``; raises CorruptCacheFile on anything it never writes."""
    if obj is None:
        return None
    if isinstance(obj, dict) and len(obj) == 1:
        ((kind, value),) = obj.items()
        if kind == "str" and type(value) is str:
            return value
        if kind == "int" and type(value) is int:
            return value
        if kind == "bytes" and type(value) is str:
            try:
                return base64.b64decode(value.encode("ascii"), validate=True)
            except ValueError:
                pass
        if kind == "tuple" and type(value) is list:
            return tuple(decode_namespace(x) for x in value)
        if kind == "keyed" and type(value) is list and len(value) == 2:
            parts = decode_namespace(value[1])
            if type(parts) is tuple:
                return KeyedNamespace(decode_namespace(value[0]), parts)
    raise CorruptCacheFile(f"cache file: invalid namespace entry {obj!r}")


# -- layout and identity --------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(pool, states=None) -> dict:
    """The pool's block size and per-layer KV shapes, as JSON (devices left out); with a
    StatePool ``states``, also its snapshots' tensors (``states``: shape and dtype of each
    StateSpec, in order). Without one the dict is exactly what format 2 wrote (and what a
    sidecar's pool geometry parses), so plain stores' files and keys are unchanged."""
    out = {
        "block_size": pool.block_size,
        "layers": [
            {
                "num_kv_heads": s.num_kv_heads,
                "k_head_dim": s.k_head_dim,
                "v_head_dim": s.v_head_dim,
                "dtype": dtype_name(s.dtype),
            }
            for s in pool.layers
        ],
    }
    if states is not None:
        out["states"] = [{"shape": list(s.shape), "dtype": dtype_name(s.dtype)} for s in states.specs]
    return out


def canonical(obj: object) -> object:
    """``obj`` as it reads back from JSON (tuples become lists), for equality with a file's copy."""
    try:
        return json.loads(json.dumps(obj, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise ValueError(f"identity must be JSON-serialisable: {e}") from None


def _differences(what: str, have: object, want: object) -> list[str]:
    """Human-readable paths where ``have`` (the file) and ``want`` (this store) differ."""
    if isinstance(have, dict) and isinstance(want, dict):
        out = []
        for key in sorted(set(have) | set(want)):
            if key not in have:
                out.append(f"{what}.{key}: missing in the file, this store has {want[key]!r}")
            elif key not in want:
                out.append(f"{what}.{key}: the file has {have[key]!r}, this store has none")
            else:
                out += _differences(f"{what}.{key}", have[key], want[key])
        return out
    if isinstance(have, list) and isinstance(want, list) and len(have) == len(want):
        return [d for i, (a, b) in enumerate(zip(have, want)) for d in _differences(f"{what}[{i}]", a, b)]
    if have != want:
        return [f"{what}: the file has {have!r}, this store needs {want!r}"]
    return []


def check_format(manifest: Mapping) -> int:
    """The manifest's format version: CorruptCacheFile unless it is a radixkv cache file,
    CacheFileMismatch for a version this radixkv does not read."""
    if manifest.get("format") != FORMAT:
        raise CorruptCacheFile(f"not a radixkv cache file (format {manifest.get('format')!r})")
    version = manifest.get("version")
    if version not in READABLE_VERSIONS:
        raise CacheFileMismatch(
            f"cache file format version {version!r}; this radixkv reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    return version


def check_compatible(manifest: Mapping, pool, identity: object, states=None) -> None:
    """Raise CacheFileMismatch naming every difference of format, identity or layout.

    ``states``: the store's StatePool (None: a store without recurrent state). A file with
    snapshots is refused by a store without a state pool and vice versa, saying so first."""
    version = check_format(manifest)
    layout = manifest.get("layout")
    has_states = isinstance(layout, Mapping) and "states" in layout
    if has_states and version < STATES_SINCE:
        raise CorruptCacheFile(f"cache file of format version {version} with recurrent-state snapshots")
    problems = []
    if has_states and states is None:
        problems.append(
            "the file holds recurrent-state snapshots (a model with recurrent layers) and this store "
            "has no state pool (KVStore(states=))"
        )
    elif states is not None and not has_states:
        problems.append(
            "the file holds no recurrent-state snapshots (saved by a store without a state pool) and "
            "this store's model has recurrent layers: its KV alone can serve nothing"
        )
    problems += _differences("identity", manifest.get("identity"), canonical(identity))
    have, want = layout, layout_of(pool, states)
    if has_states != (states is not None):  # said above: compare the rest
        want.pop("states", None)
        have = {k: v for k, v in layout.items() if k != "states"} if has_states else layout
    problems += _differences("layout", have, want)
    if problems:
        raise CacheFileMismatch("cache file was saved for another model or store: " + "; ".join(problems))


# -- the manifest text ------------------------------------------------------------------------
def to_metadata(manifest: Mapping) -> dict[str, str]:
    text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return {MANIFEST_KEY: text, MANIFEST_HASH_KEY: hashlib.sha256(text.encode()).hexdigest()}


def from_metadata(metadata: Mapping[str, str] | None) -> dict:
    """The manifest of a file's safetensors metadata; CorruptCacheFile unless it is intact."""
    metadata = metadata if isinstance(metadata, Mapping) else {}
    text, digest = metadata.get(MANIFEST_KEY), metadata.get(MANIFEST_HASH_KEY)
    if not isinstance(text, str) or not isinstance(digest, str):
        raise CorruptCacheFile("a safetensors file without a radixkv manifest: not a radixkv cache file")
    if hashlib.sha256(text.encode()).hexdigest() != digest:
        raise CorruptCacheFile("cache file manifest does not match its checksum (the file was altered)")
    try:
        manifest = json.loads(text)
    except ValueError:
        raise CorruptCacheFile("cache file manifest is not valid JSON") from None
    if not isinstance(manifest, dict):
        raise CorruptCacheFile("cache file manifest is not a JSON object")
    return manifest


def expected_tensors(layout: Mapping, counts: Mapping) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype name) of every tensor a file with this layout and these counts holds
    (a layout with ``states`` and ``counts["snapshots"]``: ``tree.snaps`` and ``state.{j}`` too)."""
    bs, nb = layout["block_size"], counts["blocks"]
    out = {"tree.nodes": ((counts["nodes"], 4), "int64"), "tree.tokens": ((nb * bs,), "int64")}
    if "states" in layout:
        out["tree.snaps"] = ((counts["nodes"],), "int64")
    for i, layer in enumerate(layout["layers"]):
        out[f"kv.{i}.k"] = ((nb, bs, layer["num_kv_heads"], layer["k_head_dim"]), layer["dtype"])
        out[f"kv.{i}.v"] = ((nb, bs, layer["num_kv_heads"], layer["v_head_dim"]), layer["dtype"])
    for j, spec in enumerate(layout.get("states", ())):
        out[f"state.{j}"] = ((counts["snapshots"], *spec["shape"]), spec["dtype"])
    return out


def count_field(counts: Mapping, name: str) -> int:
    value = counts.get(name) if isinstance(counts, Mapping) else None
    if type(value) is not int or value < 0:
        raise CorruptCacheFile(f"cache file manifest: counts.{name} is {value!r}, not an int >= 0")
    return value


def decode_namespaces(entries: object) -> Sequence[Hashable]:
    if not isinstance(entries, list):
        raise CorruptCacheFile("cache file manifest: namespaces is not a list")
    return [decode_namespace(e) for e in entries]
