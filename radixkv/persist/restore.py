"""Restore a cache file into a KVStore: checked first, read once, straight into free blocks.

Three steps (``restore_store``):

1. Under the store's lock: ``open_cache_file`` has checked the header, the manifest and the
   tree; the file's nodes are placed (radixkv.persist.restore_plan) into the free blocks, or with
   ``evict`` into the free and unpinned ones; the prefixes the file finds cached are pinned,
   and the free blocks the placement uses are taken, private (no tree references them).
2. Without the lock: ``read_kv`` reads and checks every KV byte, straight into those blocks
   (blocks that need room made first go to a staging buffer). A damaged file is refused
   here: the blocks go back to the free list, the pins are released, and the store holds
   exactly what it held (only the bytes of free blocks, which nothing reads, changed).
3. Under the lock: room made for the staged blocks (evict: the store's least recently used
   unpinned blocks are demoted to the host tier or evicted), the blocks inserted, parents
   first (each node keeps its tier), then touched oldest first so that the tree's recency
   order is the file's: restored prefixes are the most recently used.

The store serves requests meanwhile; what changed in it during step 2 is checked in step 3
(a prefix gone: the node is dropped; cached meanwhile by a request: a duplicate).

A store with recurrent state (``states=``) gets the file's snapshots alongside, in each step
(radixkv.persist.restore_states): slots of the state pool of each node's tier taken in step 1,
the ``state.{j}`` bytes read into them and checked in step 2, attached to their nodes in step 3
after the inserts. A snapshot that finds no slot is dropped, its node's KV kept.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Hashable

import torch

from radixkv.persist.cache_file import CacheFileHead, open_cache_file
from radixkv.persist.cache_read import read_kv, runs_of
from radixkv.persist.manifest import CacheFileError
from radixkv.persist.restore_plan import Placement, place
from radixkv.persist.restore_states import attach_snapshots, claim_snapshots, read_snapshots
from radixkv.persist.save import Rename, RestoreResult
from radixkv.tree import RadixTree, TierOrderError
from radixkv.tree.node import DEVICE, HOST, TOKEN_BYTES, PackedTokens

logger = logging.getLogger(__name__)

_CACHED = -1  # the id of a file block the store holds already (never copied nor inserted)
_STAGING = 2  # read_kv destination index of the staging buffer (0, 1: device, host pool)


@dataclasses.dataclass(frozen=True)
class _FileTree:
    """The file's nodes with what a restore needs of each: its namespace in the store, its
    path from the root (packed), its first block in that path and in the file."""

    rows: list[list[int]]  # (parent, namespace, blocks, recency)
    namespaces: list[Hashable]  # per node
    paths: list[PackedTokens]
    first: list[int]  # the node's first block in its path
    start: list[int]  # the node's first block in the file
    snaps: list[int] | None  # per node: its snapshot's row in the file, or -1 (None: no states)

    @classmethod
    def of(cls, head: CacheFileHead, rename: Rename | None, block_size: int) -> _FileTree:
        try:
            mapped = [rename(ns) if rename else ns for ns in head.namespaces]
            for ns in mapped:
                hash(ns)
        except Exception as e:
            raise CacheFileError(f"restore: cannot map the file's namespaces: {e}") from e
        width = block_size * TOKEN_BYTES
        paths, first, start, at = [], [], [], 0
        for parent, _ns, blocks, _last in head.nodes:
            edge = head.tokens[at * width : (at + blocks) * width]
            paths.append(PackedTokens(edge if parent == -1 else paths[parent] + edge))
            first.append(len(paths[-1]) // width - blocks)
            start.append(at)
            at += blocks
        return cls(head.nodes, [mapped[row[1]] for row in head.nodes], paths, first, start, head.snaps)

    def new_rows(self, i: int, plan: Placement) -> range:
        """File blocks of node i that the store does not hold."""
        return range(self.start[i] + plan.have[i], self.start[i] + self.rows[i][2])


@dataclasses.dataclass
class _Claim:
    """What step 1 took from the store: pins, the placement, private blocks, staged nodes."""

    tree: RadixTree  # the live tree then (a flush may replace the store's meanwhile)
    pins: list
    plan: Placement
    ids: dict[int, list[int]]  # node -> its new blocks' ids in its tier's pool
    staged: list[int]  # nodes read into the staging buffer (most recent first)
    taken: tuple[list[int], list[int]] = dataclasses.field(default_factory=lambda: ([], []))  # ids per tier
    held: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # per node: restore_plan's held

    def release(self, locked) -> None:
        """Give back the private blocks and the pins (the file was refused or the store flushed)."""
        for where, ids in enumerate(self.taken):
            locked.private[where].difference_update(ids)
            if ids:
                locked.pools[where].free(ids[::-1])  # the free stack as it was
        for node in self.pins:
            locked.unpin(self.tree, node)


def restore_store(
    store,
    path: str | os.PathLike,
    *,
    identity: object = None,
    rename: Rename | None = None,
    epoch: int | None = None,
    evict: bool = False,
    namespaces: Callable[[Hashable], bool] | None = None,
) -> RestoreResult:
    """Merge the prefixes saved in ``path`` into ``store``; see ``KVStore.restore``."""
    started = time.perf_counter()
    snaps = snap_staging = None  # the snapshots' claim and staging buffer (a store with states=)

    def release(locked) -> None:
        claim.release(locked)
        if snaps is not None:
            snaps.release(locked)

    with open_cache_file(path, store.pool, identity, store.states) as head:
        tree = _FileTree.of(head, rename, store.block_size)
        skip = None if namespaces is None else [not namespaces(ns) for ns in tree.namespaces]
        with store._exclusive() as locked:
            _check_epoch(store, epoch, path)
            claim = _claim(locked, tree, evict, skip)
            if tree.snaps is not None:
                try:
                    snaps = claim_snapshots(locked, tree, claim.plan, claim.held, evict)
                except BaseException:
                    claim.release(locked)
                    raise
        try:
            staging = _read(head, tree, claim, locked.pools)
            if snaps is not None:
                snap_staging = read_snapshots(head, tree, snaps, locked.states)
        except BaseException:
            with store._exclusive() as again:
                release(again)
            raise
    with store._exclusive() as locked:
        try:
            _check_epoch(store, epoch, path)
        except RuntimeError:
            release(locked)
            raise
        c = locked.counters
        before = (c.evicted_blocks, c.demoted_blocks, c.evicted_snapshots)
        for where, ids in enumerate(claim.taken):
            locked.private[where].difference_update(ids)
        attached, duplicate_snaps = [0, 0], 0
        try:
            restored, dropped, lost = _finish(locked, tree, claim, staging, head.times)
            if snaps is not None:  # after the inserts' touches: the snapshots' LRU order is the file's
                attached, duplicate_snaps = attach_snapshots(locked, tree, snaps, snap_staging, head.times)
                duplicate_snaps += snaps.duplicate
        finally:
            if snaps is not None:
                snaps.release(locked)  # nothing left after a whole attach
            for node in claim.pins:
                locked.unpin(claim.tree, node)
        evicted, demoted = c.evicted_blocks - before[0], c.demoted_blocks - before[1]
        evicted_snaps = c.evicted_snapshots - before[2]
    bs = store.block_size
    num_snaps = 0 if tree.snaps is None else sum(row >= 0 for row in tree.snaps)
    total = sum(row[2] for row in tree.rows)
    dropped += claim.plan.dropped_blocks + lost
    head.times.total = time.perf_counter() - started
    result = RestoreResult(
        restored_tokens=sum(restored) * bs,
        duplicate_tokens=(total - sum(restored) - dropped) * bs,
        dropped_tokens=dropped * bs,
        restored_blocks=sum(restored),
        dropped_blocks=dropped,
        num_nodes=len(tree.rows),
        host_blocks=restored[HOST],
        evicted_blocks=evicted,
        demoted_blocks=demoted,
        seconds=head.times.total,
        times=head.times,
        num_snapshots=num_snaps,
        restored_snapshots=sum(attached),
        host_snapshots=attached[HOST],
        duplicate_snapshots=duplicate_snaps,
        dropped_snapshots=num_snaps - sum(attached) - duplicate_snaps,
        evicted_snapshots=evicted_snaps,
    )
    # Dropped blocks of nodes the filter refused were left out on purpose: room was not the reason.
    left_out = 0 if skip is None else sum(row[2] for row, s in zip(tree.rows, skip) if s)
    if dropped > left_out:
        logger.warning(
            "restore from %s: %d blocks did not fit (the least recently used part of the file)%s",
            path,
            dropped - left_out,
            "" if evict else "; evict=True would make room for them",
        )
    if left_out:
        logger.info("restore from %s: left out %d blocks of namespaces not asked for", path, left_out)
    if result.dropped_snapshots:
        logger.info(
            "restore from %s: %d of %d state snapshots not restored (their nodes dropped or left out, "
            "or no free state slot%s)",
            path,
            result.dropped_snapshots,
            num_snaps,
            "" if evict else "; evict=True would make room",
        )
    return result


def _check_epoch(store, epoch: int | None, path) -> None:
    if epoch is not None and epoch != store.epoch:
        raise RuntimeError(
            f"restore from {os.fspath(path)}: the store was flushed (weights changed?) after the "
            "file was checked against the model; nothing was restored"
        )


def _claim(locked, tree: _FileTree, evict: bool, skip: list[bool] | None = None) -> _Claim:
    """Step 1, under the lock: pin what the file finds cached, place it, take free blocks."""
    live, pools = locked.tree, locked.pools
    bs = pools[DEVICE].block_size
    claim = _Claim(live, [], Placement({}, {}, [], 0, 0, 0, 0), {}, [])
    try:
        held = []
        for i in range(len(tree.rows)):
            if skip is not None and skip[i]:  # left out: nothing to look up or pin
                held.append((0, DEVICE))
                continue
            node, tokens, tier = live.cached_node(tree.paths[i], tree.namespaces[i])
            if node is not None:  # the placeholders of this prefix stay valid until we insert
                live.pin(node)
                claim.pins.append(node)
            held.append((tokens // bs, tier))
        claim.held = held
        host = len(pools) > 1
        free = [pools[DEVICE].num_free, pools[HOST].num_free if host else 0]
        room = list(free)
        if evict:  # the file wins over the store's unpinned blocks
            host_unpinned = live.num_host_blocks - live.num_host_pinned_blocks
            room = [free[DEVICE] + live.num_evictable_blocks - host_unpinned, free[HOST] + host_unpinned]
        plan = claim.plan = place(
            tree.rows, tree.first, held, room[DEVICE], room[HOST] if host else None, skip
        )
        # The most recent placed nodes take the free blocks now; the rest wait for room (staged).
        direct = []
        for i in sorted(plan.tier, key=lambda i: (-tree.rows[i][3], i)):
            need = len(tree.new_rows(i, plan))
            if need <= free[plan.tier[i]]:
                free[plan.tier[i]] -= need
                direct.append(i)
            else:
                claim.staged.append(i)
        for where in (DEVICE, HOST):
            mine = sorted(i for i in direct if plan.tier[i] == where)  # file order: one run when possible
            if mine:
                # Ascending: consecutive file blocks land in consecutive pool blocks, read in place.
                ids = sorted(pools[where].allocate(sum(len(tree.new_rows(i, plan)) for i in mine)))
                locked.private[where].update(ids)
                claim.taken[where].extend(ids)
                at = 0
                for i in mine:
                    n = len(tree.new_rows(i, plan))
                    claim.ids[i], at = ids[at : at + n], at + n
    except BaseException:
        claim.release(locked)
        raise
    return claim


@dataclasses.dataclass(frozen=True)
class _Staging:
    """The staged nodes' new blocks, in file order: per layer ``[blocks, bs, H, D]`` CPU tensors."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


def _read(head: CacheFileHead, tree: _FileTree, claim: _Claim, pools) -> _Staging | None:
    """Step 2, without the lock: every KV byte read and checked; returns the staging buffer
    of the staged nodes (None when there are none)."""
    targets: list[tuple[int | None, int]] = [(None, 0)] * sum(row[2] for row in tree.rows)
    for i, ids in claim.ids.items():
        for row, block in zip(tree.new_rows(i, claim.plan), ids):
            targets[row] = (claim.plan.tier[i], block)
    staging = None
    if claim.staged:
        rows = [row for i in sorted(claim.staged) for row in tree.new_rows(i, claim.plan)]
        for n, row in enumerate(rows):
            targets[row] = (_STAGING, n)
        pool = pools[DEVICE]
        staging = _Staging(
            [torch.empty((len(rows), *k.shape[1:]), dtype=k.dtype) for k in pool.k],
            [torch.empty((len(rows), *v.shape[1:]), dtype=v.dtype) for v in pool.v],
        )
    dests = [pools[DEVICE], pools[HOST] if len(pools) > 1 else None, staging]
    read_kv(head, runs_of(targets), dests)
    return staging


def _place_staged(locked, tree: _FileTree, claim: _Claim, staging, times) -> int:
    """Step 3a: make room for the staged nodes (most recent first), copy them in; returns the
    blocks dropped because the room could not be made (pinned blocks, a full host tier)."""
    plan, pools = claim.plan, locked.pools
    want = [0, 0]
    for i in claim.staged:
        want[plan.tier[i]] += len(tree.new_rows(i, plan))
    if want[DEVICE] > pools[DEVICE].num_free:
        locked.make_room(DEVICE, want[DEVICE] - pools[DEVICE].num_free)  # may demote to the host
    if want[HOST] > (pools[HOST].num_free if len(pools) > 1 else 0):
        locked.make_room(HOST, want[HOST] - pools[HOST].num_free)
    first_row, at = {}, 0
    for i in sorted(claim.staged):  # staging rows follow file order
        first_row[i], at = at, at + len(tree.new_rows(i, plan))
    dropped = 0
    for i in claim.staged:
        where, need = plan.tier[i], len(tree.new_rows(i, plan))
        if need > pools[where].num_free:
            dropped += need  # its descendants are dropped at insert: their path is not cached
            continue
        ids = pools[where].allocate(need)
        claim.taken[where].extend(ids)
        claim.ids[i] = ids
        started = time.perf_counter()
        rows = slice(first_row[i], first_row[i] + need)
        for stored, staged in zip(pools[where].k + pools[where].v, staging.k + staging.v):
            _copy_rows(stored, ids, staged[rows])
        times.copy += time.perf_counter() - started
    return dropped


def _copy_rows(stored, ids: list[int], rows) -> None:
    """``stored[ids[j]] = rows[j]``: one slice copy when the ids are consecutive."""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        stored[ids[0] : ids[0] + len(ids)].copy_(rows)
    else:
        stored.index_copy_(0, torch.tensor(ids, device=stored.device), rows.to(stored.device))


def _finish(
    locked, tree: _FileTree, claim: _Claim, staging: _Staging | None, times
) -> tuple[list[int], int, int]:
    """Step 3: the staged nodes, then the inserts. Returns the blocks the tree took per tier,
    the staged blocks dropped for want of room, and placed blocks the tree could not take."""
    taken: tuple[set[int], set[int]] = (set(), set())
    try:
        dropped = _place_staged(locked, tree, claim, staging, times) if claim.staged else 0
        lost = _insert(locked, tree, claim, taken)
    finally:
        # Every block is the tree's or free again, even if an insert was interrupted (the
        # paths inserted by then are whole and correct: their blocks were all copied).
        for where in (DEVICE, HOST):
            unused = [b for b in claim.taken[where] if b not in taken[where]]
            if unused:
                locked.pools[where].free(unused)
    return [len(taken[DEVICE]), len(taken[HOST])], dropped, lost


def _insert(locked, tree: _FileTree, claim: _Claim, taken: tuple[set[int], set[int]]) -> int:
    """Insert every kept path, parents first (a child never creates its parent's node, so each
    node keeps its tier), then touch them oldest first (the file's recency order). Adds the
    ids the tree took to ``taken``; returns the placed blocks it could not take."""
    live, plan = locked.tree, claim.plan
    bs = locked.pools[DEVICE].block_size
    lost = 0
    full: dict[int, list[int]] = {}
    for i in plan.kept:  # file order: parents first
        parent = tree.rows[i][0]
        own = claim.ids.get(i, [])
        full[i] = (full[parent] if parent != -1 else []) + [_CACHED] * plan.have[i] + own
        if not own:
            continue
        try:
            # Placeholders must be cached (pinned, or inserted just before): else drop the node.
            if live.cached_prefix(tree.paths[i], tree.namespaces[i])[0] < (tree.first[i] + plan.have[i]) * bs:
                raise TierOrderError("a prefix the file relied on is gone")
            already = live.insert(tree.paths[i], full[i], tree.namespaces[i], plan.tier[i])
        except TierOrderError:  # its parent was dropped, or the store demoted its prefix
            lost += len(own)
            continue
        taken[plan.tier[i]].update(full[i][already // bs :])
    for i in sorted(plan.kept, key=lambda i: (tree.rows[i][3], i)):
        live.match(tree.paths[i], tree.namespaces[i])
    return lost
