"""Save a KVStore's cached prefixes to one safetensors file and restore them, all or nothing.

File layout (one safetensors file; manifest in its header metadata, see radixkv.persist.manifest):

- ``tree.nodes``  int64 ``[N, 4]``: per node ``(parent, namespace, num_blocks, last_access)``;
  parent is -1 under a namespace root, else the index of an earlier row (parents first).
- ``tree.tokens`` int64 ``[blocks * block_size]``: the nodes' edges, concatenated in row order.
- ``kv.{l}.k`` / ``kv.{l}.v``: ``[blocks, block_size, kv_heads, head_dim]`` in the layer's
  dtype: the K/V of those blocks, same order.

One file rather than a manifest beside a data file: one ``os.replace`` publishes both
atomically, and the manifest can be read without the data
(``radixkv.persist.cache_file.read_manifest``, one header). The file I/O is in radixkv/persist/cache_file.py.

Saving snapshots the tree and pins its leaves under the store's lock (no copy: requests
wait microseconds), then, outside it, streams the pinned blocks ~4 MiB at a time through
sha256 into a temporary file in the same directory, fsyncs, renames and fsyncs the
directory (a crash or a full disk leaves the previous file as it was), and unpins. While a
save runs, commits that need the pinned blocks' room cache less (they degrade, as always). Restoring reads and checks everything first (manifest checksum,
format version, identity, layout, every tensor's shape, dtype and sha256, the tree's
structure); only then, under the lock, copies the blocks into free blocks and inserts the
paths. A refused file changes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Collection, Hashable

import torch

from radixkv.persist.cache_file import CacheFile, Gathered, atomic_save, nbytes, read_cache_file
from radixkv.persist.manifest import (
    FORMAT,
    FORMAT_VERSION,
    CacheFileError,
    canonical,
    encode_namespace,
    layout_of,
)
from radixkv.tree import TierOrderError
from radixkv.tree.node import HOST, TOKEN_BYTES, PackedTokens

logger = logging.getLogger(__name__)

Rename = Callable[[Hashable], Hashable]
_CACHED = -1  # restore: the id of a file block the store holds already (never copied nor inserted)


@dataclasses.dataclass(frozen=True)
class SaveResult:
    path: str
    num_nodes: int
    num_blocks: int
    num_tokens: int
    kv_bytes: int  # K and V bytes of the saved blocks
    file_bytes: int  # the file's size: kv_bytes plus token ids, node table and header


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a restore did. Tokens are whole blocks; every saved block is in exactly one count."""

    restored_tokens: int  # newly cached
    duplicate_tokens: int  # saved, but the store held them already (kept as they were)
    dropped_tokens: int  # did not fit in the free blocks: the least recently used part of the file
    restored_blocks: int
    dropped_blocks: int
    num_nodes: int  # nodes in the file


# -- save -----------------------------------------------------------------------------------
def _namespace_filter(namespaces) -> Callable[[Hashable], bool]:
    if namespaces is None:
        return lambda ns: True
    if callable(namespaces):
        return namespaces
    # A str or a tuple would be ambiguous: a namespace itself, or a collection of them?
    if not isinstance(namespaces, (list, set, frozenset)):
        raise TypeError(
            f"namespaces must be None, a list/set of namespaces or a predicate, got {type(namespaces).__name__}"
        )
    wanted = set(namespaces)
    return wanted.__contains__


def save_store(
    store,
    path: str | os.PathLike,
    *,
    namespaces: Collection[Hashable] | Callable[[Hashable], bool] | None = None,
    identity: object = None,
    rename: Rename | None = None,
    epoch: int | None = None,
) -> SaveResult:
    """Write ``store``'s cached prefixes (those of ``namespaces``: all when None) to ``path``.

    ``identity``: JSON-able; a restore must present an equal one. ``rename``: maps a store
    namespace to the one written (hf_patch drops its per-process model scope). Raises
    ValueError, writing nothing, for a namespace that has no file form (see
    ``encode_namespace``); OSError from the file system, leaving any previous file intact.
    ``epoch``: ``store.epoch`` read before ``identity`` was computed; RuntimeError, writing
    nothing, if the store was flushed since (its KV may be of other weights than ``identity``).
    """
    identity = canonical(identity)
    keep = _namespace_filter(namespaces)
    path = os.fspath(path)
    with store._exclusive() as (tree, pool, _):
        if epoch is not None and epoch != store.epoch:
            raise RuntimeError(
                f"save to {path}: the store was flushed (weights changed?) after the identity was "
                "computed; nothing was written"
            )
        rows, ns_list, tokens, ids, tiers, leaves = _snapshot(tree, pool, keep, rename)
        pools = [tier.pool for tier in store.tiers]  # a node's blocks index its tier's pool
        for leaf in leaves:  # the saved blocks can be neither evicted nor reused until written
            tree.pin(leaf)
    try:
        nodes = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 4)
        tensors: dict[str, torch.Tensor | Gathered] = {"tree.nodes": nodes, "tree.tokens": tokens}
        for i in range(len(pool.layers)):
            tensors[f"kv.{i}.k"] = Gathered([p.k[i] for p in pools], ids, tiers)
            tensors[f"kv.{i}.v"] = Gathered([p.v[i] for p in pools], ids, tiers)
        num_blocks = len(ids)
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "identity": identity,
            "layout": layout_of(pool),
            "namespaces": ns_list,
            "counts": {"nodes": len(rows), "blocks": num_blocks, "tokens": num_blocks * pool.block_size},
            # "checksums": filled in by the writer as it streams each tensor
        }
        atomic_save(tensors, manifest, path)
    finally:
        with store._exclusive() as (_, _, unpin):
            for leaf in leaves:
                unpin(tree, leaf)  # also right if the store was flushed meanwhile
    kv_bytes = sum(nbytes(t) for name, t in tensors.items() if name.startswith("kv."))
    result = SaveResult(
        path, len(rows), num_blocks, num_blocks * pool.block_size, kv_bytes, os.path.getsize(path)
    )
    logger.info("saved %d tokens (%d nodes) to %s", result.num_tokens, result.num_nodes, path)
    return result


def _snapshot(tree, pool, keep, rename):
    """Node rows, encoded namespaces, token ids, block ids, each block's tier and the leaves to
    pin. Under the lock."""
    rows: list[tuple[int, int, int, int]] = []
    index: dict[int, int] = {}  # id(node) -> row
    ns_index: dict[str, int] = {}  # encoded namespace (its JSON text) -> position in ns_list
    ns_list: list[object] = []
    data: list[bytes] = []
    ids: list[int] = []
    tiers: list[int] = []
    leaves = []  # pinning them pins every saved node (a pin holds the path to the root)
    for node in tree.iter_nodes():  # parents before children
        parent = node.parent
        if parent.is_root:
            if not keep(parent.key):
                continue
            encoded = encode_namespace(rename(parent.key) if rename else parent.key)
            ns = ns_index.setdefault(json.dumps(encoded, sort_keys=True), len(ns_list))
            if ns == len(ns_list):
                ns_list.append(encoded)
            parent_row = -1
        elif id(parent) in index:
            parent_row = index[id(parent)]
            ns = rows[parent_row][1]
        else:
            continue  # under a namespace left out
        index[id(node)] = len(rows)
        rows.append((parent_row, ns, len(node.block_ids), node.last_access))
        data.append(node.data)
        ids.extend(node.block_ids)
        tiers.extend([node.tier] * len(node.block_ids))
        if not node.children:
            leaves.append(node)
    tokens = (
        torch.frombuffer(bytearray(b"".join(data)), dtype=torch.int64)
        if data
        else torch.zeros(0, dtype=torch.int64)
    )
    return rows, ns_list, tokens, ids, tiers, leaves


def restore_store(
    store,
    path: str | os.PathLike,
    *,
    identity: object = None,
    rename: Rename | None = None,
    epoch: int | None = None,
) -> RestoreResult:
    """Merge the prefixes saved in ``path`` into ``store``; see ``KVStore.restore``."""
    data = read_cache_file(path, store.pool, identity)
    try:
        namespaces = [rename(ns) if rename else ns for ns in data.namespaces]
        for ns in namespaces:
            hash(ns)
    except Exception as e:
        raise CacheFileError(f"restore: cannot map the file's namespaces: {e}") from e
    bs = store.block_size
    width = bs * TOKEN_BYTES
    nodes = data.nodes
    # Each node's first block in the file, and its full path from the root, packed.
    start, paths, at = [], [], 0
    for parent, _ns, blocks, _last in nodes:
        start.append(at)
        edge = data.tokens[at * width : (at + blocks) * width]
        paths.append(edge if parent == -1 else paths[parent] + edge)
        at += blocks
    # Most recently used first; at equal recency a parent (earlier row) before its children.
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][3], i))
    with store._exclusive() as (tree, pool, _):
        if epoch is not None and epoch != store.epoch:
            raise RuntimeError(
                f"restore from {os.fspath(path)}: the store was flushed (weights changed?) after the "
                "file was checked against the model; nothing was restored"
            )
        # Blocks the store holds already need no free block: only each node's uncached tail is
        # copied. Its leading ids are placeholders the tree never takes: nothing is evicted under
        # this lock, so every insert below finds at least that much cached and keeps it. A tail
        # that would hang below a prefix the store holds on its host tier is dropped up front.
        fresh: dict[int, int] = {}  # node -> how many of its last blocks are not cached
        chosen: set[int] = set()
        used = cached_below_host = 0
        for i in order:
            parent, ns, blocks, _last = nodes[i]
            if parent == -1 or parent in chosen:
                first = len(paths[i]) // width - blocks  # the node's first block in its path
                cached, tier = tree.cached_prefix(PackedTokens(paths[i]), namespaces[ns])
                have = min(blocks, max(0, cached // bs - first))
                need = blocks - have
                if need and tier == HOST:  # device blocks never hang below host ones
                    cached_below_host += have
                    continue
                if used + need <= pool.num_free:
                    chosen.add(i)
                    fresh[i] = need
                    used += need
        selected = sorted(chosen)  # file order: when everything fits, the file's tensors copy as they are
        ids = pool.allocate(used)
        try:
            own: dict[int, list[int]] = {}
            rows: list[int] = []
            for i in selected:
                blocks, need = nodes[i][2], fresh[i]
                own[i] = [_CACHED] * (blocks - need) + ids[len(rows) : len(rows) + need]
                rows.extend(range(start[i] + blocks - need, start[i] + blocks))
            if rows:
                _copy_in(pool, data, rows, ids)
        except BaseException:
            pool.free(ids)
            raise
        # Insert oldest first, so the tree's clock keeps the saved recency order; at equal
        # recency children before parents (a parent's path is then already cached: no split).
        full: dict[int, list[int]] = {}
        taken: set[int] = set()
        for i in selected:
            parent = nodes[i][0]
            full[i] = (full[parent] if parent != -1 else []) + own[i]
        below_host: set[int] = set()
        try:
            for i in sorted(selected, key=lambda i: (nodes[i][3], -i)):
                path_ids = full[i]
                tokens, ns = PackedTokens(paths[i]), namespaces[nodes[i][1]]
                try:
                    already = tree.insert(tokens, path_ids, ns)
                except TierOrderError:
                    # The store holds part of this path demoted to its host tier, and device
                    # blocks never hang below host ones: keep the store's copy, drop ours below it.
                    below_host.update(path_ids[tree.match(tokens, ns).num_tokens // bs :])
                    continue
                taken.update(path_ids[already // bs :])
        finally:
            # Every block is the tree's or free again, even if an insert was interrupted (the
            # paths inserted by then are whole and correct: their blocks were all copied).
            unused = [b for b in ids if b not in taken]
            pool.free(unused)
    total = sum(row[2] for row in nodes)
    dropped = total - sum(nodes[i][2] for i in selected) - cached_below_host + len(below_host - taken)
    result = RestoreResult(
        restored_tokens=len(taken) * bs,
        duplicate_tokens=(total - dropped - len(taken)) * bs,
        dropped_tokens=dropped * bs,
        restored_blocks=len(taken),
        dropped_blocks=dropped,
        num_nodes=len(nodes),
    )
    if result.dropped_blocks:
        logger.warning(
            "restore from %s: %d blocks did not fit in the free pool (or sat below a prefix held on the "
            "host tier) and were dropped",
            path,
            dropped,
        )
    return result


def _copy_in(pool, data: CacheFile, rows: list[int], ids: list[int]) -> None:
    """Copy file blocks ``rows`` into pool blocks ``ids`` (same order), every layer."""
    everything = rows == list(range(data.k[0].shape[0]))
    pick = None if everything else torch.tensor(rows, dtype=torch.int64)
    n = len(rows) * pool.block_size

    def as_source(t: torch.Tensor, device) -> torch.Tensor:
        t = t if pick is None else t.index_select(0, pick)
        # [blocks, bs, H, D] -> [1, H, blocks * bs, D], a view: what scatter takes.
        return t.to(device).reshape(1, n, t.shape[2], t.shape[3]).permute(0, 2, 1, 3)

    ks = [as_source(k, s.device) for k, s in zip(data.k, pool.layers)]
    vs = [as_source(v, s.device) for v, s in zip(data.v, pool.layers)]
    pool.scatter(torch.tensor([ids], dtype=torch.int64), ks, vs)
