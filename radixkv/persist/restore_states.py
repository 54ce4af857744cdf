"""Where a restore puts a cache file's recurrent-state snapshots, and attaching them (a store with
``states=``; radixkv.persist.restore does the KV and calls in here at each of its three steps).

A snapshot goes with its node: into the state pool of the tier the node's KV lands in (or
holds already), device or host, as ``Node.snap`` requires. Per step:

1. ``claim_snapshots`` (under the lock, after the KV placement): the kept nodes' snapshots, most
   recently used first, take free slots of their tier's state pool, held privately (in no node:
   ``Locked.private_snaps``); with ``evict`` the rest wait in a staging buffer for room (as many
   as the store has unpinned snapshots of that tier); the others are dropped, their nodes' KV
   kept. A node where the store holds a snapshot already is a duplicate: the store's is kept.
2. ``read_snapshots`` (without the lock): every ``state.{j}`` byte read and checked, straight
   into those slots (radixkv.persist.cache_read.read_states); the rest only hashed.
3. ``attach_snapshots`` (under the lock, after the inserts and their recency touches): staged
   snapshots get room (the store's least recently used unpinned snapshots of that tier are
   evicted, never KV) and are copied in; each slot is attached to the node ending at its
   file node's path, or freed when that node is gone, on another tier, or took a snapshot
   meanwhile. Attached after the touches, the snapshots' LRU order is the file's.

A refused file frees the private slots (``SnapClaim.release``): the store's snapshots are as
they were (only the bytes of free slots, which nothing reads, changed).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from radixkv.persist.cache_file import CacheFileHead
from radixkv.persist.cache_read import read_states, runs_of
from radixkv.persist.restore_plan import Placement
from radixkv.tree.node import DEVICE, HOST, TOKEN_BYTES

_STAGING = 2  # read_states destination index of the staging buffer (0, 1: device, host pool)


@dataclasses.dataclass
class SnapClaim:
    """What step 1 took: private slots, staged snapshots, and what it already knows is not restored."""

    slots: dict[int, tuple[int, int]]  # file node -> (tier, slot) it was given
    staged: list[tuple[int, int]]  # (file node, tier) waiting for room, most recent first
    taken: tuple[list[int], list[int]] = dataclasses.field(default_factory=lambda: ([], []))  # per tier
    duplicate: int = 0  # nodes whose snapshot the store holds already
    dropped: int = 0  # snapshots of nodes not kept, or that found no slot

    def release(self, locked, kept: tuple[set[int], set[int]] = (set(), set())) -> None:
        """Give back the private slots but those in ``kept`` (attached to nodes now): all of
        them when the file was refused or the store flushed. O(slots taken)."""
        for tier, slots in enumerate(self.taken):
            locked.private_snaps[tier].difference_update(slots)
            back = [s for s in slots if s not in kept[tier]]
            if back:
                locked.states[tier].free(back)  # in allocation order: the free list as it was
            slots.clear()


def _snapshot_at(live, path, namespace) -> bool:
    """Whether ``live`` holds a node ending exactly at ``path`` with a snapshot. Changes nothing."""
    node, tokens, _ = live.cached_node(path, namespace)
    if node is None or node.snap < 0 or tokens != path.num_tokens:
        return False
    end, n = 0, node
    while not n.is_root:
        end += len(n.data)
        n = n.parent
    return end // TOKEN_BYTES == tokens


def claim_snapshots(
    locked,
    tree,
    plan: Placement,
    held: Sequence[tuple[int, int]],
    evict: bool,
) -> SnapClaim:
    """Step 1 (under the lock, pins on the prefixes the file finds cached already held): give the
    kept nodes' snapshots free slots of their tier, most recent first. ``held[i]``: ``(blocks,
    tier)`` of the store's cached prefix of node i's path (restore_plan.place's ``held``)."""
    live, states = locked.tree, locked.states
    claim = SnapClaim({}, [])
    kept = set(plan.kept)
    free = [states[DEVICE].num_free, states[HOST].num_free if states[HOST] is not None else 0]
    room = [live.num_evictable_snapshots(DEVICE), live.num_evictable_snapshots(HOST)] if evict else [0, 0]
    direct: list[list[int]] = [[], []]
    with_snap = [i for i, row in enumerate(tree.snaps) if row >= 0]
    for i in sorted(with_snap, key=lambda i: (-tree.rows[i][3], i)):
        if i not in kept:  # its KV is not restored (no room, left out): its snapshot neither
            claim.dropped += 1
            continue
        tier = plan.tier.get(i, held[i][1])  # new blocks' tier, else the tier the store holds it in
        if i not in plan.tier and _snapshot_at(live, tree.paths[i], tree.namespaces[i]):
            claim.duplicate += 1
        elif states[tier] is None:  # a host node in a store without a host state pool
            claim.dropped += 1
        elif free[tier]:
            free[tier] -= 1
            direct[tier].append(i)
        elif room[tier]:
            room[tier] -= 1
            claim.staged.append((i, tier))
        else:
            claim.dropped += 1
    try:
        for tier in (DEVICE, HOST):
            mine = sorted(direct[tier])  # file order: ascending slots, read in place where they run
            if mine:
                taken = states[tier].allocate(len(mine))
                locked.private_snaps[tier].update(taken)
                claim.taken[tier].extend(taken)  # in allocation order: freed so, the free list is as it was
                for i, slot in zip(mine, sorted(taken)):
                    claim.slots[i] = (tier, slot)
    except BaseException:
        claim.release(locked)
        raise
    return claim


def read_snapshots(head: CacheFileHead, tree, claim: SnapClaim, states) -> list[torch.Tensor] | None:
    """Step 2 (without the lock): every snapshot byte read and checked; returns the staging
    tensors of the staged snapshots (per spec ``[staged, *shape]``, CPU), None when none are."""
    targets: list[tuple[int | None, int]] = [(None, 0)] * head.states[0].shape[0]  # per file snapshot
    for i, (tier, slot) in claim.slots.items():
        targets[tree.snaps[i]] = (tier, slot)
    staging = None
    if claim.staged:
        rows = sorted(tree.snaps[i] for i, _ in claim.staged)
        for n, row in enumerate(rows):
            targets[row] = (_STAGING, n)
        staging = [torch.empty((len(rows), *s.shape), dtype=s.dtype) for s in states[DEVICE].specs]
    dests = [states[DEVICE].tensors, states[HOST].tensors if states[HOST] is not None else None, staging]
    read_states(head, runs_of(targets), dests)
    return staging


def attach_snapshots(locked, tree, claim: SnapClaim, staging, times) -> tuple[list[int], int]:
    """Step 3 (under the lock, after the inserts): room for the staged snapshots, then every slot
    attached or freed. Returns the snapshots attached per tier and the duplicates found now
    (a node that took a snapshot meanwhile)."""
    live = locked.tree
    kept: tuple[set[int], set[int]] = (set(), set())
    duplicate = 0
    try:
        if claim.staged:
            _place_staged(locked, tree, claim, staging, times)
        for i, (tier, slot) in sorted(claim.slots.items()):
            node = live.node_at(tree.paths[i], tree.namespaces[i])
            if node is not None and node.snap < 0 and node.tier == tier:
                live.set_snapshot(node, slot)
                kept[tier].add(slot)
            elif node is not None and node.snap >= 0:
                duplicate += 1
            # else the node is gone (dropped, lost) or on the other tier now: the slot goes back
    finally:
        claim.release(locked, kept)  # every slot not attached goes back, an interrupted attach's too
    return [len(kept[0]), len(kept[1])], duplicate


def _place_staged(locked, tree, claim: SnapClaim, staging, times) -> None:
    """Make room for the staged snapshots (the store's LRU unpinned ones of their tier) and copy
    them into slots, most recent first; those that find none stay unplaced (dropped)."""
    states = locked.states
    want = [0, 0]
    for _, tier in claim.staged:
        want[tier] += 1
    for tier in (DEVICE, HOST):
        short = want[tier] - states[tier].num_free if want[tier] else 0
        if short > 0:
            locked.evict_snapshots(tier, short)
    staged_row = {row: n for n, row in enumerate(sorted(tree.snaps[i] for i, _ in claim.staged))}
    started = time.perf_counter()
    for i, tier in claim.staged:
        pool = states[tier]
        if not pool.num_free:
            continue  # counted as dropped by the caller: it is in no slot
        slot = pool.allocate(1)[0]
        claim.taken[tier].append(slot)
        locked.private_snaps[tier].add(slot)
        n = staged_row[tree.snaps[i]]
        for dst, src in zip(pool.tensors, staging):
            dst[slot].copy_(src[n])
        claim.slots[i] = (tier, slot)
    times.copy += time.perf_counter() - started
