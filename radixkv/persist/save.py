"""Save a KVStore's cached prefixes to one safetensors file and restore them, all or nothing.

File layout (one safetensors file; manifest in its header metadata, see radixkv.persist.manifest):

- ``tree.nodes``  int64 ``[N, 4]``: per node ``(parent, namespace, num_blocks, last_access)``;
  parent is -1 under a namespace root, else the index of an earlier row (parents first).
- ``tree.tokens`` int64 ``[blocks * block_size]``: the nodes' edges, concatenated in row order.
- ``kv.{l}.k`` / ``kv.{l}.v``: ``[blocks, block_size, kv_heads, head_dim]`` in the layer's
  dtype: the K/V of those blocks, same order.
- A store with recurrent state (``KVStore(states=)``, format 3) adds ``tree.snaps`` int64
  ``[N]``: per node the row of its snapshot (the states after its last token), or -1; and
  ``state.{j}`` ``[snapshots, *spec.shape]`` per ``StateSpec`` j in its dtype: the snapshots,
  in row order (the nodes' order).

One file rather than a manifest beside a data file: one ``os.replace`` publishes both
atomically, and the manifest can be read without the data
(``radixkv.persist.cache_file.read_manifest``, one header).

Saving snapshots the tree and pins its leaves under the store's lock (no copy: requests
wait microseconds), then, outside it, streams the pinned blocks through the checksum into a
temporary file (radixkv.persist.cache_write), fsyncs, renames and fsyncs the directory (a crash, a
full disk or a deadline leaves the previous file as it was), and unpins. ``max_bytes`` keeps
the most recently used prefixes that fit, a node's snapshot counted with its blocks. While a
save runs, commits that need the pinned blocks' room cache less (they degrade, as always);
the pinned nodes' snapshots are neither evicted nor moved meanwhile.

Restoring (radixkv.persist.restore) checks the header, manifest and tree first, reads the KV
straight into free blocks it holds privately and checks every byte, and only then inserts
the paths, making room first if asked to (``evict``). A refused file changes nothing the
store holds. The result records of both directions live here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Collection, Hashable

import torch

from radixkv.persist.cache_write import MIN_RUN_BYTES, Gathered, atomic_save, nbytes, pieces_of
from radixkv.persist.file_io import IoTimes
from radixkv.persist.manifest import FORMAT, FORMAT_VERSION, canonical, encode_namespace, layout_of
from radixkv.tree import RadixTree
from radixkv.tree.node import DEVICE

logger = logging.getLogger(__name__)

Rename = Callable[[Hashable], Hashable]


@dataclasses.dataclass(frozen=True)
class SaveResult:
    path: str
    num_nodes: int
    num_blocks: int
    num_tokens: int
    kv_bytes: int  # K and V bytes of the saved blocks
    file_bytes: int  # the file's size: kv_bytes, state_bytes, token ids, node table and header
    skipped_nodes: int = 0  # cached but left out by ``max_bytes`` (the least recently used)
    skipped_blocks: int = 0
    skipped_tokens: int = 0
    seconds: float = 0.0  # the whole save, snapshot to directory fsync
    times: IoTimes = dataclasses.field(default_factory=IoTimes)  # where the time went
    num_snapshots: int = 0  # recurrent-state snapshots written (a store with states=)
    state_bytes: int = 0  # their bytes
    skipped_snapshots: int = 0  # held by the skipped nodes


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    """What a restore did. Tokens are whole blocks; every saved block is in exactly one of
    restored / duplicate / dropped."""

    restored_tokens: int  # newly cached
    duplicate_tokens: int  # saved, but the store held them already (kept as they were)
    dropped_tokens: int  # did not fit (the least recently used first), or left out by ``namespaces``
    restored_blocks: int
    dropped_blocks: int
    num_nodes: int  # nodes in the file
    host_blocks: int = 0  # of restored_blocks, those placed on the host tier
    evicted_blocks: int = 0  # store blocks dropped to make room (evict=True)
    demoted_blocks: int = 0  # store blocks moved to the host tier to make room (evict=True)
    seconds: float = 0.0  # read, check, place and copy
    times: IoTimes = dataclasses.field(default_factory=IoTimes)
    # Recurrent-state snapshots (a store with states=): every snapshot of the file is in
    # exactly one of restored / duplicate / dropped.
    num_snapshots: int = 0  # in the file
    restored_snapshots: int = 0  # attached to their nodes
    host_snapshots: int = 0  # of restored_snapshots, those in the host tier's state pool
    duplicate_snapshots: int = 0  # the store held a snapshot at that node already (kept)
    # no slot in the state pool of the node's tier (the node's KV kept), or the node itself
    # dropped or left out by ``namespaces``
    dropped_snapshots: int = 0
    evicted_snapshots: int = 0  # store snapshots dropped to make room (evict=True)


@dataclasses.dataclass(frozen=True)
class Locked:
    """What radixkv.persist may use of a store while it holds the store's lock (``_exclusive``)."""

    tree: RadixTree  # the live tree
    pools: tuple  # the BlockPools, by tier: (device,) or (device, host)
    counters: object  # the store's StoreCounters (evicted_blocks, demoted_blocks, ...)
    unpin: Callable[[RadixTree, object], None]  # of a node pinned earlier (a flushed tree's too)
    make_room: Callable[[int, int], None]  # (tier, blocks): evict / demote least recently used
    private: tuple[set[int], set[int]]  # per tier: blocks taken from the pool, in no tree yet
    # A store with states=: the StatePools by tier (device, host or None); () without
    states: tuple = ()
    private_snaps: tuple[set[int], set[int]] = (set(), set())  # per tier: slots taken, in no node yet
    evict_snapshots: Callable[[int, int], None] | None = None  # (tier, n): drop LRU unpinned snapshots


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
    max_bytes: int | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    max_rate: float | None = None,
) -> SaveResult:
    """Write ``store``'s cached prefixes (those of ``namespaces``: all when None) to ``path``.

    ``identity``: JSON-able; a restore must present an equal one. ``rename``: maps a store
    namespace to the one written (hf_patch drops its per-process model scope). ``max_bytes``:
    at most this many KV and snapshot bytes, the most recently used prefixes first (a prefix
    always with the path above it, a node with its snapshot). ``deadline`` (``time.monotonic()``) / ``cancel``: stop writing once
    passed / set, raising radixkv.SaveAborted, the previous file intact. ``max_rate``: at most
    this many KV bytes per second (a save in the background of requests).

    Raises ValueError, writing nothing, for a namespace that has no file form (see
    ``encode_namespace``) and for a ``max_bytes`` below 0 or a ``max_rate`` not above 0; OSError from the file system, leaving any previous file intact.
    ``epoch``: ``store.epoch`` read before ``identity`` was computed; RuntimeError, writing
    nothing, if the store was flushed since (its KV may be of other weights than ``identity``).
    """
    started = time.perf_counter()
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Integral) or max_bytes < 0
    ):
        raise ValueError(
            f"save to {path}: max_bytes must be an int >= 0 or None, got {max_bytes!r}; nothing was written"
        )
    if max_rate is not None and (
        isinstance(max_rate, bool) or not isinstance(max_rate, numbers.Real) or not max_rate > 0
    ):
        raise ValueError(
            f"save to {path}: max_rate must be a number of bytes per second > 0 or None, got {max_rate!r}; nothing was written"
        )
    identity = canonical(identity)
    keep = _namespace_filter(namespaces)
    path = os.fspath(path)
    with store._exclusive() as locked:
        tree, pool, states = locked.tree, locked.pools[DEVICE], locked.states
        if epoch is not None and epoch != store.epoch:
            raise RuntimeError(
                f"save to {path}: the store was flushed (weights changed?) after the identity was "
                "computed; nothing was written"
            )
        costs = (pool.block_size * pool.bytes_per_token, states[DEVICE].slot_bytes if states else 0)
        snap = _snapshot(tree, keep, rename, max_bytes, costs)
        for leaf in snap.leaves:  # the saved blocks can be neither evicted nor reused until written
            tree.pin(leaf)  # nor their snapshots: a pinned node's snapshot is neither evicted nor moved
    try:
        nodes = torch.tensor(snap.rows, dtype=torch.int64).reshape(len(snap.rows), 4)
        tensors: dict[str, torch.Tensor | Gathered] = {"tree.nodes": nodes, "tree.tokens": snap.tokens}
        if states:
            tensors["tree.snaps"] = torch.tensor(snap.snaps, dtype=torch.int64)
        tensors.update(_gathered("kv", [(p.k, p.v) for p in locked.pools], snap.ids, snap.tiers))
        if states:
            pools = [(p.tensors,) for p in states if p is not None]  # a host pool only after the device's
            tensors.update(_gathered("state", pools, snap.slots, snap.slot_tiers))
        num_blocks = len(snap.ids)
        counts = {"nodes": len(snap.rows), "blocks": num_blocks, "tokens": num_blocks * pool.block_size}
        if states:
            counts["snapshots"] = len(snap.slots)
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "identity": identity,
            "layout": layout_of(pool, states[DEVICE] if states else None),
            "namespaces": snap.namespaces,
            "counts": counts,
            # "checksum", "checksums": filled in by the writer as it streams each tensor
        }
        times = atomic_save(tensors, manifest, path, deadline=deadline, cancel=cancel, max_rate=max_rate)
    finally:
        with store._exclusive() as again:
            for leaf in snap.leaves:
                again.unpin(tree, leaf)  # also right if the store was flushed meanwhile
    bs = pool.block_size
    result = SaveResult(
        path,
        len(snap.rows),
        num_blocks,
        num_blocks * bs,
        sum(nbytes(t) for name, t in tensors.items() if name.startswith("kv.")),
        os.path.getsize(path),
        snap.skipped_nodes,
        snap.skipped_blocks,
        snap.skipped_blocks * bs,
        time.perf_counter() - started,
        times,
        num_snapshots=len(snap.slots),
        state_bytes=sum(nbytes(t) for name, t in tensors.items() if name.startswith("state.")),
        skipped_snapshots=snap.skipped_snapshots,
    )
    logger.info(
        "saved %d tokens (%d nodes%s) to %s in %.2fs%s",
        result.num_tokens,
        result.num_nodes,
        f", {result.num_snapshots} state snapshots" if states else "",
        path,
        result.seconds,
        f", skipped {result.skipped_tokens} less recently used tokens" if result.skipped_nodes else "",
    )
    return result


def _gathered(prefix: str, pools, ids: list[int], tiers: list[int]) -> dict[str, Gathered]:
    """The file tensors ``{prefix}.{...}`` of rows ``ids`` (of tiers ``tiers``) of per-tier pools.

    ``pools[tier]``: a tuple of tensor lists, one per kind (KV: ``(k, v)``, named
    ``kv.{l}.k`` / ``kv.{l}.v``; states: ``(tensors,)``, named ``state.{j}``), each tensor
    ``[rows, ...]``. Consecutive rows of one tier go in runs of at least ~``MIN_RUN_BYTES``."""
    first = pools[DEVICE]
    if not first[0]:  # no tensors (a model without attention KV): nothing to gather
        return {}
    per_row = min(math.prod(t.shape[1:]) * t.element_size() for kind in first for t in kind)
    pieces = pieces_of(ids, tiers, max(1, MIN_RUN_BYTES // max(1, per_row)))
    out = {}
    for i in range(len(first[0])):
        for kind in range(len(first)):
            name = f"kv.{i}.{'kv'[kind]}" if prefix == "kv" else f"{prefix}.{i}"
            out[name] = Gathered([p[kind][i] for p in pools], pieces, len(ids))
    return out


@dataclasses.dataclass
class _Snapshot:
    rows: list[tuple[int, int, int, int]]  # the file's node table
    namespaces: list[object]  # encoded
    tokens: torch.Tensor  # int64, the edges in row order
    ids: list[int]  # block ids in file order
    tiers: list[int]  # each block's tier
    leaves: list  # nodes to pin: that pins every saved node
    skipped_nodes: int
    skipped_blocks: int
    snaps: list[int]  # per row: its snapshot's row in state.{j}, or -1 (a stateful tree)
    slots: list[int]  # the snapshots' state pool slots, in row order
    slot_tiers: list[int]  # each snapshot's tier
    skipped_snapshots: int


def _snapshot(tree, keep, rename, max_bytes: int | None, costs: tuple[int, int]) -> _Snapshot:
    """The nodes of the kept namespaces (the most recent ``max_bytes`` worth; ``costs``: bytes of
    a block, of a snapshot). Under the lock."""
    candidates: list[tuple[object, int]] = []  # (node, parent's index or -1), parents first
    index: dict[int, int] = {}  # id(node) -> candidate index
    for node in tree.iter_nodes():
        parent = node.parent
        if parent.is_root:
            if not keep(parent.key):
                continue
            up = -1
        elif id(parent) in index:
            up = index[id(parent)]
        else:
            continue  # under a namespace left out
        index[id(node)] = len(candidates)
        candidates.append((node, up))
    chosen = _most_recent(candidates, max_bytes, costs)
    rows: list[tuple[int, int, int, int]] = []
    row_of: dict[int, int] = {}  # candidate index -> row
    ns_index: dict[str, int] = {}  # encoded namespace (its JSON text) -> position in ns_list
    ns_list: list[object] = []
    data: list[bytes] = []
    ids: list[int] = []
    tiers: list[int] = []
    snaps: list[int] = []
    slots: list[int] = []
    slot_tiers: list[int] = []
    has_child: set[int] = set()
    for c, (node, up) in enumerate(candidates):
        if c not in chosen:
            continue
        if up == -1:
            key = node.parent.key
            encoded = encode_namespace(rename(key) if rename else key)
            ns = ns_index.setdefault(json.dumps(encoded, sort_keys=True), len(ns_list))
            if ns == len(ns_list):
                ns_list.append(encoded)
            parent_row = -1
        else:
            parent_row = row_of[up]
            ns = rows[parent_row][1]
            has_child.add(up)
        row_of[c] = len(rows)
        rows.append((parent_row, ns, len(node.block_ids), node.last_access))
        data.append(node.data)
        ids.extend(node.block_ids)
        tiers.extend([node.tier] * len(node.block_ids))
        snaps.append(len(slots) if node.snap >= 0 else -1)
        if node.snap >= 0:
            slots.append(node.snap)
            slot_tiers.append(node.tier)
    leaves = [candidates[c][0] for c in row_of if c not in has_child]  # pinning them pins the rest
    tokens = (
        torch.frombuffer(bytearray(b"".join(data)), dtype=torch.int64)
        if data
        else torch.zeros(0, dtype=torch.int64)
    )
    left = [node for c, (node, _) in enumerate(candidates) if c not in chosen]
    return _Snapshot(
        rows,
        ns_list,
        tokens,
        ids,
        tiers,
        leaves,
        len(left),
        sum(len(node.block_ids) for node in left),
        snaps,
        slots,
        slot_tiers,
        sum(node.snap >= 0 for node in left),
    )


def _most_recent(
    candidates: list[tuple[object, int]], max_bytes: int | None, costs: tuple[int, int]
) -> set[int]:
    """Indices of the most recently used candidates whose bytes fit ``max_bytes`` (all when
    None), each with its parent; a node costs its blocks (``costs[0]`` bytes each) and its
    snapshot if it has one (``costs[1]``). A parent is never less recent than its child, and
    at equal recency comes first (a lower index): it is always considered before it."""
    if max_bytes is None:
        return set(range(len(candidates)))
    per_block, per_snap = costs
    order = sorted(range(len(candidates)), key=lambda c: (-candidates[c][0].last_access, c))
    chosen: set[int] = set()
    used = 0
    for c in order:
        node, up = candidates[c]
        cost = len(node.block_ids) * per_block + (per_snap if node.snap >= 0 else 0)
        if (up == -1 or up in chosen) and used + cost <= max_bytes:
            chosen.add(c)
            used += cost
    return chosen
