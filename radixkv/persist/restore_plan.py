"""Where a restore puts each node of a checked cache file: cached already, device, host, or dropped.

Pure bookkeeping (no tree, no torch): radixkv.persist asks the tree what it holds of each
node's path, then calls ``place`` under the store's lock. A file node's blocks are, in
order, ``have`` blocks the store holds already (duplicates: they take no room) and ``need``
new ones, which all go to one tier. Nodes are placed most recently used first (a parent is
never less recent than its children, and at equal recency comes first), each one

- on the device, if its path so far ends on the device (a root's does) and the device has room;
- else on the host tier, if there is one with room (device blocks never hang below host ones);
- else dropped, with everything below it (a dropped node's ``have`` blocks stay cached).

A node the caller ``skip``s (a namespace it does not want restored) is dropped with its subtree
before anything is placed, so it takes no room and evicts nothing.

So when the file is larger than the room, its least recently used prefixes are the ones left
out, and what the device cannot take lands on the host tier instead of being dropped.

>>> rows = [(-1, 0, 2, 9), (0, 0, 1, 9), (-1, 0, 3, 5)]   # (parent, namespace, blocks, recency)
>>> p = place(rows, first=[0, 2, 0], held=[(0, DEVICE)] * 3, device_room=3, host_room=2)
>>> p.tier, p.dropped_blocks                               # node 2 fits neither tier
({0: 0, 1: 0}, 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from radixkv.tree.node import DEVICE, HOST


@dataclasses.dataclass(frozen=True)
class Placement:
    """The outcome of ``place``; block counts are whole blocks of the file."""

    tier: dict[int, int]  # node -> DEVICE / HOST: where its new blocks go (nodes with some)
    have: dict[int, int]  # kept node -> its leading blocks the store holds already
    kept: list[int]  # nodes restored or held already, in file order (parents first)
    device_blocks: int  # new blocks placed on the device
    host_blocks: int  # new blocks placed on the host tier
    duplicate_blocks: int  # blocks of the file the store holds already
    dropped_blocks: int  # blocks of the file left out


def place(
    rows: Sequence[tuple[int, int, int, int]],
    first: Sequence[int],
    held: Sequence[tuple[int, int]],
    device_room: int,
    host_room: int | None,
    skip: Sequence[bool] | None = None,
) -> Placement:
    """Place every node of a file into ``device_room`` / ``host_room`` free blocks.

    ``rows[i]``: ``(parent, namespace, blocks, recency)`` of node i, parents before children
    (radixkv.persist's node table); ``first[i]``: the index of node i's first block in its
    path from the root; ``held[i]``: ``(blocks, tier)``: how many blocks of node i's whole path
    the store holds, and the tier of the last of them (any tier when none). ``host_room``
    None: the store has no host tier. ``skip[i]``: leave node i (and so its subtree) out,
    counted as dropped. O(N log N) for N nodes.
    """
    order = sorted(range(len(rows)), key=lambda i: (-rows[i][3], i))
    ends: dict[int, int] = {}  # kept node -> tier its path ends in (where its children may go)
    tier: dict[int, int] = {}
    have: dict[int, int] = {}
    used = [0, 0]  # new blocks placed per tier
    duplicate = dropped = 0
    for i in order:
        parent, _, blocks, _ = rows[i]
        # Skipped by the caller, or below a dropped node: nothing of it is restored.
        if (skip is not None and skip[i]) or (parent != -1 and parent not in ends):
            dropped += blocks
            continue
        cached, cached_tier = held[i]
        h = min(blocks, max(0, cached - first[i]))
        need = blocks - h
        duplicate += h
        if need == 0:
            have[i], ends[i] = h, cached_tier
            continue
        above = cached_tier if h else (ends[parent] if parent != -1 else DEVICE)
        if above == DEVICE and used[DEVICE] + need <= device_room:
            where = DEVICE
        elif host_room is not None and used[HOST] + need <= host_room:
            where = HOST
        else:
            dropped += need
            continue
        used[where] += need
        have[i], tier[i], ends[i] = h, where, where
    return Placement(tier, have, sorted(ends), used[DEVICE], used[HOST], duplicate, dropped)
