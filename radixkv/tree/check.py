"""Full recount of a ``RadixTree``'s structure and counters (used by ``check_invariants``).

Kept apart from the tree so the hot paths stay short; every check here raises
``TreeInvariantError`` (not ``assert``, which ``python -O`` would strip).
"""

from __future__ import annotations

from collections.abc import Hashable

from sortedcontainers import SortedList

from radixkv.tree.node import DEVICE, HOST, TOKEN_BYTES, Node, TreeInvariantError


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise TreeInvariantError(message)


def _check_root(namespace: Hashable, root: Node) -> None:
    _require(root.is_root and root.attached, f"root of namespace {namespace!r} is not an attached root")
    _require(root.parent is None, f"root of namespace {namespace!r} has a parent")
    _require(root.key == namespace, f"root of namespace {namespace!r} has key {root.key!r}")
    _require(
        not root.tokens and not root.block_ids, f"root of namespace {namespace!r} holds tokens or blocks"
    )
    _require(root.evict_entry is None, f"root of namespace {namespace!r} is in the evictable set")
    _require(root.tier == DEVICE, f"root of namespace {namespace!r} is not device-resident")


def _check_edge(parent: Node, key: Hashable, node: Node, block_size: int, clock: int) -> None:
    """Checks of one non-root node against its parent."""
    _require(not node.is_root and node.attached, f"{node!r} under {parent!r} is a root or detached")
    _require(node.parent is parent, f"{node!r} has parent {node.parent!r}, but sits under {parent!r}")
    _require(len(node.block_ids) > 0, f"{node!r} is an empty non-root node")
    _require(
        isinstance(node.data, bytes) and len(node.data) == len(node.block_ids) * block_size * TOKEN_BYTES,
        f"{node!r} has {len(node.data) / TOKEN_BYTES} tokens for {len(node.block_ids)} blocks of {block_size}",
    )
    first_block = node.data[: block_size * TOKEN_BYTES]
    _require(
        key == node.key == first_block,
        f"{node!r} is stored under key {key!r}, its key is {node.key!r}, its first block {first_block!r}",
    )
    _require(0 <= node.last_access <= clock, f"{node!r} last_access outside [0, clock={clock}]")
    _require(node.tier in (DEVICE, HOST), f"{node!r} has tier {node.tier!r}")
    _require(node.tier >= parent.tier, f"device-resident {node!r} hangs under host-resident {parent!r}")
    if not parent.is_root:
        _require(
            parent.last_access >= node.last_access,
            f"{node!r} was used after its parent {parent!r} (path recency not monotone)",
        )


def _check_blocks_unique(node: Node, seen_blocks: set[int]) -> None:
    _require(
        all(type(b) is int and b >= 0 for b in node.block_ids),
        f"{node!r} holds a block id that is not an int >= 0",
    )
    own = set(node.block_ids)
    duplicates = own & seen_blocks
    if len(own) != len(node.block_ids):
        duplicates |= {b for b in own if node.block_ids.count(b) > 1}
    _require(not duplicates, f"block ids {sorted(duplicates)} of {node!r} appear twice in the tree")
    seen_blocks |= own


def _check_device_children(node: Node) -> None:
    count = sum(1 for child in node.children.values() if child.tier == DEVICE)
    _require(node.dev_children == count, f"{node!r} dev_children {node.dev_children} != recount {count}")


def _check_pins(node: Node) -> None:
    expected = node.own_pins + sum(child.pin_count for child in node.children.values())
    _require(node.own_pins >= 0, f"{node!r} has negative own pins")
    _require(
        node.pin_count == expected,
        f"{node!r} pin_count {node.pin_count} != own pins {node.own_pins} + children's pins",
    )


def check_tree(
    *,
    roots: dict[Hashable, Node],
    evictable: SortedList,
    block_size: int,
    clock: int,
    num_nodes: int,
    num_cached_blocks: int,
    num_pinned_blocks: int,
    owned: set[int] | None,
    host_evictable: SortedList,
    num_host_blocks: int,
    num_host_pinned_blocks: int,
    owned_host: set[int] | None,
) -> None:
    """Recount the tree under ``roots`` and compare with both LRU orders and the counters. O(N log N)."""
    seen_blocks: tuple[set[int], set[int]] = (set(), set())  # per tier: ids index different pools
    seen_uids: set[int] = set()
    candidates: tuple[set[int], set[int]] = (set(), set())  # id() of nodes each LRU order must hold
    count_nodes = count_blocks = count_pinned = count_host = count_host_pinned = 0
    for namespace, root in roots.items():
        _check_root(namespace, root)
        stack = [root]
        while stack:
            node = stack.pop()
            _require(node.uid not in seen_uids, f"uid {node.uid} appears twice")
            seen_uids.add(node.uid)
            _check_pins(node)
            _check_device_children(node)
            for key, child in node.children.items():
                _check_edge(node, key, child, block_size, clock)
                stack.append(child)
            if node.is_root:
                continue
            count_nodes += 1
            count_blocks += len(node.block_ids)
            count_host += len(node.block_ids) if node.tier == HOST else 0
            _check_blocks_unique(node, seen_blocks[node.tier])
            if node.pin_count > 0:
                count_pinned += len(node.block_ids)
                count_host_pinned += len(node.block_ids) if node.tier == HOST else 0
            # Device: no device children (host ones may stay); host: a true leaf.
            if node.pin_count == 0 and not (node.dev_children if node.tier == DEVICE else node.children):
                candidates[node.tier].add(id(node))
                _require(
                    node.evict_entry == (node.last_access, node.uid, node),
                    f"evictable leaf {node!r} has a stale or missing evict entry {node.evict_entry!r}",
                )
            else:
                _require(node.evict_entry is None, f"non-evictable {node!r} has an evict entry")
    _check_evictable(evictable, candidates[DEVICE], "device")
    _check_evictable(host_evictable, candidates[HOST], "host")
    _require(count_host == num_host_blocks, f"num_host_blocks {num_host_blocks} != recount {count_host}")
    _require(
        count_host_pinned == num_host_pinned_blocks,
        f"num_host_pinned_blocks {num_host_pinned_blocks} != recount {count_host_pinned}",
    )
    _require(count_nodes == num_nodes, f"num_nodes {num_nodes} != recount {count_nodes}")
    _require(
        count_blocks == num_cached_blocks, f"num_cached_blocks {num_cached_blocks} != recount {count_blocks}"
    )
    _require(
        count_pinned == num_pinned_blocks, f"num_pinned_blocks {num_pinned_blocks} != recount {count_pinned}"
    )
    if owned is not None:  # None: the tree does not track them (check_block_ids=False)
        _require(seen_blocks[DEVICE] == owned, "the set of owned block ids differs from the ids in the tree")
    if owned_host is not None:
        _require(
            seen_blocks[HOST] == owned_host, "the owned host block ids differ from the host ids in the tree"
        )


def _check_evictable(evictable: SortedList, candidates: set[int], tier: str) -> None:
    """An LRU order holds exactly its tier's candidates, each once, sorted by last access."""
    try:
        evictable._check()  # sortedcontainers' own structural check
    except AssertionError as exc:
        raise TreeInvariantError(f"{tier} evictable SortedList is corrupt: {exc!r}") from exc
    for entry in evictable:
        _require(entry[2].evict_entry is entry, f"stale evictable entry {entry[:2]} for {entry[2]!r}")
    members = [id(entry[2]) for entry in evictable]
    _require(len(members) == len(set(members)), f"a node appears twice in the {tier} evictable set")
    extra = len(set(members) - candidates)
    missing = len(candidates - set(members))
    _require(
        not extra and not missing,
        f"{tier} evictable set differs from the unpinned leaves: {extra} extra, {missing} missing",
    )


def check_snapshots(
    roots: dict[Hashable, Node], snap_lru: tuple[SortedList, SortedList], num_snaps: list[int], stateful: bool
) -> None:
    """Snapshots: only in stateful trees, never on roots, slots unique per tier, counts and the
    per-tier LRU orders (exactly the unpinned nodes holding one, sorted by last access) right."""
    slots: tuple[set[int], set[int]] = (set(), set())
    members: tuple[set[int], set[int]] = (set(), set())
    for root in roots.values():
        _require(root.snap == -1 and root.snap_entry is None, f"root {root!r} holds a snapshot")
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.snap < 0:
                _require(node.snap == -1 and node.snap_entry is None, f"{node!r} has a stale snapshot entry")
                continue
            _require(stateful, f"{node!r} holds a snapshot in a tree without recurrent state")
            _require(node.snap not in slots[node.tier], f"snapshot slot {node.snap} appears twice")
            slots[node.tier].add(node.snap)
            if node.pin_count == 0:
                _require(
                    node.snap_entry == (node.last_access, node.uid, node),
                    f"{node!r} has a stale or missing snapshot LRU entry {node.snap_entry!r}",
                )
                members[node.tier].add(id(node))
            else:
                _require(node.snap_entry is None, f"pinned {node!r} is in the snapshot LRU order")
    for tier, name in ((DEVICE, "device"), (HOST, "host")):
        _require(
            len(slots[tier]) == num_snaps[tier],
            f"{name} snapshot count {num_snaps[tier]} != recount {len(slots[tier])}",
        )
        lru = snap_lru[tier]
        try:
            lru._check()
        except AssertionError as exc:
            raise TreeInvariantError(f"{name} snapshot LRU is corrupt: {exc!r}") from exc
        ids = [id(entry[2]) for entry in lru]
        _require(
            len(ids) == len(set(ids)) and set(ids) == members[tier],
            f"{name} snapshot LRU differs from the unpinned nodes holding one",
        )
        for entry in lru:
            _require(
                entry[2].snap_entry is entry and entry[2].tier == tier, f"stale snapshot entry {entry[:2]}"
            )


def snapshot_slots(roots: dict[Hashable, Node]) -> tuple[list[int], list[int]]:
    """Every snapshot slot the tree holds, per tier (device, host). O(N)."""
    out: tuple[list[int], list[int]] = ([], [])
    for root in roots.values():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.snap >= 0:
                out[node.tier].append(node.snap)
    return out
