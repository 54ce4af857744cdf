"""What a cache file holds, without a store: ``radixkv cache inspect FILE [--verify]``.

``describe(path)`` reads the safetensors header and the manifest (a few KiB, whatever the
file's size) and reports the format version, what the KV was computed by (the identity hf_patch
wrote: model class, config and weights digests), the layout (block size, layers, dtypes, state
snapshots), the counts and the namespaces. ``verify=True`` also streams every tensor's bytes
through its checksum, in bounded chunks and without a memory map (a file cut short while read
gives an error, not a SIGBUS), and names each tensor that does not match: what a restore would
refuse, found before a server starts on it.

A file that is not a radixkv cache file, or is truncated, or whose manifest was altered, raises
CorruptCacheFile (radixkv.persist.manifest) with the reason, as a restore would.
"""

from __future__ import annotations

import collections
import os

import torch

from radixkv.persist.cache_file import _checked_entry, _read_header
from radixkv.persist.checksum import algorithm_of, new_hasher
from radixkv.persist.manifest import (
    CorruptCacheFile,
    check_format,
    count_field,
    decode_namespaces,
    expected_tensors,
    from_metadata,
)

CHUNK = 16 << 20  # bytes hashed at a time by verify


def describe(path: str | os.PathLike, verify: bool = False) -> dict:
    """A JSON-able description of the cache file at ``path`` (see the module docstring).
    Raises FileNotFoundError, CorruptCacheFile, CacheFileMismatch (a format version or checksum
    algorithm this radixkv does not read)."""
    path = os.fspath(path)
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise CorruptCacheFile(f"cache file {path} is empty")
        header = _read_header(f, size, path)
        data_start = f.tell()
        manifest = from_metadata(header.pop("__metadata__", None))
        version = check_format(manifest)
        algorithm = algorithm_of(manifest)
        layout, counts = manifest.get("layout"), manifest.get("counts")
        if not isinstance(layout, dict) or not isinstance(layout.get("layers"), list):
            raise CorruptCacheFile("cache file manifest: layout is not an object with layers")
        n, nb = count_field(counts, "nodes"), count_field(counts, "blocks")
        snaps = count_field(counts, "snapshots") if "states" in layout else 0
        try:
            expected = expected_tensors(layout, {"nodes": n, "blocks": nb, "snapshots": snaps})
        except (KeyError, TypeError) as e:
            raise CorruptCacheFile(f"cache file manifest: layout lacks {e}") from None
        if set(header) != set(expected):
            raise CorruptCacheFile(f"cache file holds tensors {sorted(header)}, expected {sorted(expected)}")
        places = {
            name: _checked_entry(name, header[name], shape, dtype, getattr(torch, dtype))
            for name, (shape, dtype) in expected.items()
        }
        out = {
            "path": path,
            "bytes": size,
            "format_version": version,
            "checksum": algorithm,
            "identity": manifest.get("identity"),
            "block_size": layout.get("block_size"),
            "layers": _layer_groups(layout["layers"]),
            "states": [{"shape": s.get("shape"), "dtype": s.get("dtype")} for s in layout.get("states", ())],
            "nodes": n,
            "blocks": nb,
            "tokens": count_field(counts, "tokens"),
            "snapshots": snaps,
            "kv_bytes": sum(
                _nbytes(shape, dtype) for name, (shape, dtype) in expected.items() if name.startswith("kv.")
            ),
            "namespaces": [repr(ns) for ns in decode_namespaces(manifest.get("namespaces"))],
        }
        if verify:
            checksums = manifest.get("checksums")
            if not isinstance(checksums, dict):
                raise CorruptCacheFile("cache file manifest has no checksums")
            bad = []
            for name, (shape, dtype) in expected.items():
                f.seek(data_start + places[name])
                if _digest(f, _nbytes(shape, dtype), algorithm, path, name) != checksums.get(name):
                    bad.append(name)
            out["verified"] = not bad
            out["mismatched"] = bad
    return out


def _nbytes(shape, dtype: str) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _digest(f, length: int, algorithm: str, path: str, name: str) -> str:
    hasher = new_hasher(algorithm)
    buf = bytearray(min(CHUNK, max(length, 1)))
    view = memoryview(buf)
    left = length
    while left:
        want = min(left, len(buf))
        got = f.readinto(view[:want])
        if not got:
            raise CorruptCacheFile(f"cache file {path} ended inside tensor {name} (truncated while read?)")
        hasher.update(view[:got])
        left -= got
    return hasher.hexdigest()


def _layer_groups(layers: list) -> list[dict]:
    """Runs of identical layers: ``{"count", "num_kv_heads", "k_head_dim", "v_head_dim", "dtype"}``."""
    runs: list[dict] = []
    for layer in layers:
        if not isinstance(layer, dict):
            raise CorruptCacheFile("cache file manifest: a layer is not an object")
        spec = {k: layer.get(k) for k in ("num_kv_heads", "k_head_dim", "v_head_dim", "dtype")}
        if runs and {k: v for k, v in runs[-1].items() if k != "count"} == spec:
            runs[-1]["count"] += 1
        else:
            runs.append({"count": 1, **spec})
    return runs


def summary(info: dict) -> str:
    """``describe``'s result as the lines ``radixkv cache inspect`` prints."""
    rows: list[tuple[str, str]] = []
    ident = info.get("identity")
    if isinstance(ident, dict):
        rows.append(("model", str(ident.get("model_class", "?"))))
        rows += [(key, str(ident[key])) for key in sorted(k for k in ident if k != "model_class")]
    else:
        rows.append(("identity", repr(ident)))
    layers = ", ".join(
        f"{g['count']} x ({g['num_kv_heads']} KV heads, head dim {g['k_head_dim']}/{g['v_head_dim']}, {g['dtype']})"
        for g in info["layers"]
    )
    rows += [
        ("layers", layers or "none (recurrent state only)"),
        ("block size", str(info["block_size"])),
        ("cached", f"{info['tokens']:,} tokens in {info['blocks']:,} blocks, {info['nodes']:,} nodes, "
                   f"{info['kv_bytes']:,} bytes of KV"),
    ]  # fmt: skip
    if info["states"]:
        rows.append(("snapshots", f"{info['snapshots']:,} of {len(info['states'])} state tensors"))
    names = list(collections.Counter(info["namespaces"]))
    rows.append(
        ("namespaces", ", ".join(names[:8]) + (f" ... ({len(names)} in all)" if len(names) > 8 else ""))
    )
    if "verified" in info:
        verdict = (
            "every tensor matches" if info["verified"] else "MISMATCH in " + ", ".join(info["mismatched"])
        )
        rows.append(("checksums", f"{verdict} ({info['checksum']})"))
    width = max(len(label) for label, _ in rows) + 2
    head = f"{info['path']}: radixkv cache file, format {info['format_version']}, {info['bytes']:,} bytes"
    return "\n".join([head, *(f"  {label + ':':<{width}}{value}" for label, value in rows)])
