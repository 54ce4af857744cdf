"""A compressed radix tree over token ids whose edges are whole KV blocks (pure Python, no torch).

Each node's edge holds a run of whole blocks of ``block_size`` tokens (packed as int64 bytes,
see ``radixkv.tree.node``) and the ids of the KV blocks storing them. Equal tokens under different namespaces never share a node: each
namespace has its own root. Eviction takes least-recently-used unpinned leaves first from a
``SortedList`` kept up to date incrementally, so it never scans the tree.

Recency is an integer clock bumped once per ``match``/``insert``, so ordering is
deterministic. Every node on a matched/inserted path gets the new clock value, which keeps
``parent.last_access >= child.last_access`` (checked by ``check_invariants``).

Tiers: each node records whether its blocks live in the device pool or in the host pool
(``Node.tier``); the tree never touches the pools. Device nodes form the top of every path.
Two LRU orders: ``evict``/``demote`` take unpinned device nodes without device children
(``_evictable``), ``evict_host`` unpinned host leaves (``_host_evictable``). A tree that only
ever holds device nodes behaves exactly as one without tiers.

Stateful trees (``stateful=True``, for models with recurrent layers): a node may carry a
snapshot of the recurrent states after its last token (``Node.snap``, a slot the store's state
pool holds). A match is usable only up to the deepest snapshot on its path; the KV matched
beyond it is reported (``MatchResult.kv_tokens``, the junction) but not served. Snapshots
have an LRU order of their own per tier (``evict_snapshots``), so state pressure never evicts
KV; a removed node's snapshot slot goes to ``free_snapshot(tier, slot)``.

The tree is not thread-safe; the store wraps it in one lock.

>>> tree = RadixTree(block_size=2)
>>> tree.insert([1, 2, 3, 4, 5], [10, 11])        # trailing partial block ignored
0
>>> r = tree.match([1, 2, 3, 9])
>>> (r.num_tokens, r.block_ids)
(2, (10,))
>>> with tree.pinned(r.node):
...     tree.evict(5)                                # only the unpinned leaf can go
[11]
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence

from sortedcontainers import SortedList

import radixkv.tree.node as _node
from radixkv.tree.check import check_snapshots, check_tree
from radixkv.tree.listener import TreeListener
from radixkv.tree.node import (
    DEVICE,
    HOST,
    TOKEN_BYTES,
    MatchResult,
    Node,
    Tokens,
    TreeInvariantError,
    pack,
    split,
    walk,
)

__all__ = ["DEVICE", "HOST", "MatchResult", "Node", "RadixTree", "TierOrderError", "TreeInvariantError"]

logger = logging.getLogger(__name__)


class TierOrderError(ValueError):
    """An insert would hang device-resident blocks under a host-resident node."""


class RadixTree:
    """Radix tree mapping whole-block token prefixes to KV block ids, with pins and LRU eviction.

    ``n`` below is the query length in tokens, ``d`` the depth of the path in nodes, ``L``
    the number of evictable leaves and ``N`` the number of nodes. Sections: state and
    counters, lookup and insert, pins, eviction, tiers (moving nodes between the device and
    host pools, whose blocks the store copies), inspection.
    """

    def __init__(
        self,
        block_size: int = 16,
        *,
        check_block_ids: bool = True,
        stateful: bool = False,
        free_snapshot: Callable[[int, int], None] | None = None,
    ) -> None:
        """``free_snapshot(tier, slot)``: called with the snapshot slot of every node the tree
        removes (eviction, drop, clear); without it the pairs collect in ``freed_snapshots``."""
        _node.check_block_size(block_size)
        self._block_size = block_size
        self._width = block_size * TOKEN_BYTES  # bytes of one packed block
        self._roots: dict[Hashable, Node] = {}
        # Unpinned non-root leaves as (last_access, uid, node); uid is unique so tuples never
        # compare nodes. Pop from the front = least recently used.
        self._evictable: SortedList = SortedList()
        self._host_evictable: SortedList = SortedList()  # unpinned host leaves, same entries
        self._lru = (self._evictable, self._host_evictable)  # indexed by Node.tier
        self._clock = 0
        self._next_uid = 0
        self._num_nodes = 0
        self._num_cached_blocks = 0
        self._num_pinned_blocks = 0
        self._num_host_blocks = 0  # of _num_cached_blocks, those in host nodes
        self._num_host_pinned_blocks = 0
        # Ids owned, so insert can refuse one held already (two KVs in one slot): ~15% of a
        # bench_tree request (cache misses); KVStore's ids come off the pool's free list: off.
        self._owned: set[int] | None = set() if check_block_ids else None
        self._owned_host: set[int] | None = set() if check_block_ids else None  # another id space
        self._stateful = stateful
        self._snap_lru = (SortedList(), SortedList())  # unpinned nodes with a snapshot, per tier
        self._num_snaps = [0, 0]  # per tier
        self.freed_snapshots: list[tuple[int, int]] = []
        self._free_snapshot = free_snapshot or (lambda tier, slot: self.freed_snapshots.append((tier, slot)))
        # Told of every node whose blocks enter, leave or change tier (radixkv.tree.listener):
        # KV events for routers. None costs one attribute test per change.
        self.listener: TreeListener | None = None

    # ---------------------------------------------------------------- counters

    @property
    def block_size(self) -> int:
        """Tokens per block (a power of two)."""
        return self._block_size

    @property
    def num_cached_blocks(self) -> int:
        """Blocks referenced by the tree (owned by it). O(1)."""
        return self._num_cached_blocks

    @property
    def num_pinned_blocks(self) -> int:
        """Blocks in nodes with a pin on themselves or a descendant. O(1)."""
        return self._num_pinned_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks that ``evict`` could free now (every unpinned node, leaves first). O(1)."""
        return self._num_cached_blocks - self._num_pinned_blocks

    @property
    def num_host_blocks(self) -> int:
        """Of ``num_cached_blocks``, those held by host-resident nodes. O(1)."""
        return self._num_host_blocks

    @property
    def num_host_pinned_blocks(self) -> int:
        """Of ``num_pinned_blocks``, those held by host-resident nodes. O(1)."""
        return self._num_host_pinned_blocks

    @property
    def stateful(self) -> bool:
        """Whether matches stop at snapshots of recurrent state (``RadixTree(stateful=True)``)."""
        return self._stateful

    @property
    def num_snapshots(self) -> int:
        """Device-resident snapshots held by nodes. O(1)."""
        return self._num_snaps[DEVICE]

    @property
    def num_host_snapshots(self) -> int:
        """Host-resident snapshots held by nodes. O(1)."""
        return self._num_snaps[HOST]

    def num_evictable_snapshots(self, tier: int = DEVICE) -> int:
        """Snapshots of ``tier`` that ``evict_snapshots`` could drop now (their nodes unpinned). O(1)."""
        return len(self._snap_lru[tier])

    @property
    def num_nodes(self) -> int:
        """Non-root nodes in the tree. O(1)."""
        return self._num_nodes

    # ---------------------------------------------------------------- internals

    def _root(self, namespace: Hashable) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node(b"", [], None, namespace, self._uid(), 0, is_root=True)
        return root

    def _check_owned(self, node: Node, op: str) -> None:
        """Raise ValueError unless ``node`` hangs under one of this tree's roots. O(d)."""
        root = _node.root_of(node)
        if not node.attached or self._roots.get(root.key) is not root:
            raise ValueError(f"cannot {op} {node!r}: it is no longer in the tree (or another tree's)")

    def _uid(self) -> int:
        self._next_uid += 1
        return self._next_uid

    def _split(self, node: Node, cut: int) -> Node:
        self._num_nodes += 1
        return split(node, cut, self._width, self._uid())

    def _add_leaf(self, parent: Node, data: bytes, block_ids: list[int], tick: int, tier: int) -> Node:
        # A host child ends a host parent's candidacy; a device parent stays a demotion candidate.
        if parent.evict_entry is not None and (parent.tier or not tier):
            self._lru[parent.tier].remove(parent.evict_entry)
            parent.evict_entry = None
        key = data[: self._width]
        leaf = parent.children[key] = Node(data, block_ids, parent, key, self._uid(), tick, tier=tier)
        self._num_nodes += 1
        self._num_cached_blocks += len(block_ids)
        if tier:
            self._num_host_blocks += len(block_ids)
        else:
            parent.dev_children += 1
        if self._owned is not None:
            (self._owned_host if tier else self._owned).update(block_ids)
        self._add_evictable(leaf)
        if self.listener is not None:
            self.listener.stored(leaf)
        return leaf

    def _remove_leaf(self, node: Node) -> None:
        """Detach an unpinned leaf already taken out of the evictable set; cascade to its parent."""
        parent = node.parent
        assert parent is not None
        if self.listener is not None:
            self.listener.removed(node)  # still attached: its path names its blocks
        if node.snap >= 0:
            self._drop_snap(node)
        del parent.children[node.key]
        node.parent = None
        node.attached = False
        self._num_nodes -= 1
        self._num_cached_blocks -= len(node.block_ids)
        if node.tier:
            self._num_host_blocks -= len(node.block_ids)
        else:
            parent.dev_children -= 1
        if self._owned is not None:
            (self._owned_host if node.tier else self._owned).difference_update(node.block_ids)
        if parent.children:
            # A device parent left without device children becomes a demotion candidate.
            if not (
                parent.dev_children or parent.tier or parent.pin_count or parent.is_root or parent.evict_entry
            ):
                self._add_evictable(parent)
            return
        if parent.pin_count:
            return
        if parent.is_root:
            self._drop_root(parent)
        elif parent.evict_entry is None:
            self._add_evictable(parent)

    def _drop_root(self, root: Node) -> None:
        del self._roots[root.key]
        root.attached = False

    def _add_evictable(self, node: Node) -> None:
        entry = node.evict_entry = (node.last_access, node.uid, node)
        self._lru[node.tier].add(entry)

    def _drop_snap(self, node: Node) -> None:
        """Take ``node``'s snapshot out of the tree and hand its slot to ``free_snapshot``."""
        if node.snap_entry is not None:
            self._snap_lru[node.tier].remove(node.snap_entry)
            node.snap_entry = None
        slot, node.snap = node.snap, -1
        self._num_snaps[node.tier] -= 1
        self._free_snapshot(node.tier, slot)

    def _add_snap_entry(self, node: Node) -> None:
        entry = node.snap_entry = (node.last_access, node.uid, node)
        self._snap_lru[node.tier].add(entry)

    def _touch_snaps(self, node: Node) -> None:
        """Refresh the snapshot LRU entries of the path ending at ``node`` that a walk stamped.
        Stateful trees only; O(d) steps plus O(log S) per snapshot moved."""
        while node is not None and not node.is_root:
            entry = node.snap_entry
            if entry is not None and entry[0] != node.last_access:
                self._snap_lru[node.tier].remove(entry)
                self._add_snap_entry(node)
            node = node.parent

    def _touch(self, node: Node) -> None:
        """Move ``node`` to the most-recent end of the eviction order if it is a candidate. O(log L)."""
        if node.evict_entry is not None and node.evict_entry[0] != node.last_access:
            self._lru[node.tier].remove(node.evict_entry)
            self._add_evictable(node)

    # ---------------------------------------------------------------- lookup and insert

    def match(self, tokens: Tokens, namespace: Hashable = None, *, kv: bool = False) -> MatchResult:
        """Longest cached whole-block prefix of ``tokens`` under ``namespace``.

        Tokens beyond the last whole block are ignored. Side effects: when the match ends
        inside an edge, that node is split at the block boundary so ``result.node`` ends
        exactly at ``num_tokens`` (the original node object stays the deeper part); every node
        on the matched path becomes most recently used; an unknown namespace gets an (empty)
        root. In a stateful tree the result ends at the deepest snapshot on the path (see
        ``MatchResult``), unless ``kv``: then at the whole KV match (a commit extending it).
        O(n) to pack the query (in C; a slice for ``PackedTokens``), one dict lookup and
        one ``memcmp`` per node on the path (O(d) Python steps), O(log(edge blocks))
        comparisons on a partially matched edge, and O(log L) to refresh the deepest node's
        place in the eviction order.
        """
        bs = self._block_size
        n = _node.num_tokens_of(tokens)
        query = pack(tokens, n - n % bs)
        tick = self._clock = self._clock + 1
        ids: list[int] = []
        node, pos, edge, matched = walk(self._root(namespace), query, self._width, tick, ids)
        if edge is not None:
            node = self._split(edge, matched)
            node.last_access = tick
            ids += node.block_ids
            pos += matched
        self._touch(node)
        if node.tier:
            self._touch_device_end(node)
        if not self._stateful:
            return MatchResult(pos // TOKEN_BYTES, tuple(ids), node)
        self._touch_snaps(node)
        if kv:
            return MatchResult(pos // TOKEN_BYTES, tuple(ids), node, node.snap, pos // TOKEN_BYTES)
        kv_tokens = pos // TOKEN_BYTES
        usable = node
        while usable.snap < 0 and not usable.is_root:
            pos -= len(usable.data)
            usable = usable.parent
        return MatchResult(
            pos // TOKEN_BYTES, tuple(ids[: pos // self._width]), usable, usable.snap, kv_tokens
        )

    def insert(
        self, tokens: Tokens, block_ids: Sequence[int], namespace: Hashable = None, tier: int = DEVICE
    ) -> int:
        """Cache ``tokens`` (whole blocks only) stored in ``block_ids``; return the tokens already cached.

        ``block_ids`` must hold one id per whole block: ``len(tokens) // block_size``. The tree
        takes ownership of ``block_ids[returned // block_size:]``; the leading
        ``returned // block_size`` ids are duplicates the caller frees itself. Inserting an
        already-cached sequence returns its full length and changes nothing but recency (when
        it ends inside an edge, that whole edge is refreshed and nothing is split). Side
        effects: may split one node; the path becomes most recently used. Cost as ``match``,
        plus O(new blocks) to check the ids the tree takes.

        ``tier``: the pool the new ids index (``DEVICE`` or ``HOST``). Raises
        ``TierOrderError`` (a ValueError), adding nothing, when device blocks would hang under
        a host-resident node (the prefix was demoted since the caller matched it).

        Raises ValueError, leaving the tree's contents unchanged (only recency may move), when
        the count is wrong, a token is not an int, or an id the tree would take is not an
        int >= 0, repeats, or is already owned by the tree.
        """
        bs = self._block_size
        n = _node.num_tokens_of(tokens)
        end = n - n % bs
        if len(block_ids) != end // bs:
            raise ValueError(
                f"insert needs one block id per whole block of {bs} tokens: "
                f"{n} tokens -> {end // bs} block ids, got {len(block_ids)}"
            )
        query = pack(tokens, end)
        end_bytes = len(query)
        tick = self._clock = self._clock + 1
        node, pos, edge, matched = walk(self._root(namespace), query, self._width, tick, None)
        cached = pos + matched  # bytes already in the tree (matched is 0 when edge is None)
        new_ids: list[int] = []
        if cached < end_bytes and (edge or node).tier > tier:
            self._touch(node)  # walk() stamped ``node``: keep its place in the eviction order
            if node.tier:
                self._touch_device_end(node)
            if self._stateful:
                self._touch_snaps(node)
            raise TierOrderError(f"cannot insert device blocks under host-resident {(edge or node)!r}")
        if cached < end_bytes and self._owned is None:  # trusted ids (check_block_ids=False)
            new_ids = list(block_ids[cached // self._width :])
        elif cached < end_bytes:
            try:  # the ids the tree takes
                owned = self._owned_host if tier else self._owned
                new_ids = _node.check_block_ids(block_ids[cached // self._width :], owned)
            except ValueError:
                self._touch(node)  # walk() stamped ``node``: keep its place in the eviction order
                if node.tier:
                    self._touch_device_end(node)
                if self._stateful:
                    self._touch_snaps(node)
                raise
        if edge is not None:
            if cached == end_bytes:  # already cached, ending inside ``edge``
                edge.last_access = tick
                node, pos = edge, end_bytes
            else:
                node = self._split(edge, matched)
                node.last_access = tick
                pos += matched
        if pos == end_bytes:
            self._touch(node)
        else:
            node = self._add_leaf(node, query[pos:], new_ids, tick, tier)
        if node.tier:
            self._touch_device_end(node)
        if self._stateful:
            self._touch_snaps(node)
        return pos // TOKEN_BYTES

    # ---------------------------------------------------------------- pins

    def pin(self, node: Node) -> None:
        """Pin ``node``: it and all its ancestors cannot be evicted until ``unpin``. O(d + log L).

        Raises ValueError, changing nothing, when ``node`` is not in this tree (evicted,
        dropped, or another tree's: e.g. a store's tree from before a flush).
        """
        self._check_owned(node, "pin")
        node.own_pins += 1
        n: Node | None = node
        while n is not None:
            if n.pin_count == 0:
                self._num_pinned_blocks += len(n.block_ids)
                if n.tier:
                    self._num_host_pinned_blocks += len(n.block_ids)
                if n.evict_entry is not None:
                    self._lru[n.tier].remove(n.evict_entry)
                    n.evict_entry = None
                if n.snap_entry is not None:
                    self._snap_lru[n.tier].remove(n.snap_entry)
                    n.snap_entry = None
            n.pin_count += 1
            n = n.parent

    def unpin(self, node: Node) -> None:
        """Release one ``pin(node)``; nodes left unpinned become evictable again. O(d + log L).

        A namespace root left unpinned and empty is dropped (a miss that was never followed by
        an insert leaves nothing behind).

        Raises RuntimeError when ``node`` holds no pin of its own.
        """
        if node.own_pins <= 0:
            raise RuntimeError(f"unpin without a matching pin on {node!r}")
        self._check_owned(node, "unpin")
        node.own_pins -= 1
        n: Node | None = node
        while n is not None:
            n.pin_count -= 1
            if n.pin_count == 0:
                self._num_pinned_blocks -= len(n.block_ids)
                if n.tier:
                    self._num_host_pinned_blocks -= len(n.block_ids)
                if n.snap >= 0:
                    self._add_snap_entry(n)
                if not n.children:  # only ``node`` itself can be a leaf on this path
                    if n.is_root:
                        self._drop_root(n)
                    else:
                        self._add_evictable(n)
                elif not n.dev_children and not n.tier and not n.is_root:
                    self._add_evictable(n)  # a device node whose children are all on the host
            n = n.parent

    @contextlib.contextmanager
    def pinned(self, node: Node) -> Iterator[Node]:
        """Context manager: ``pin(node)`` on entry, ``unpin(node)`` on exit (also on exceptions)."""
        self.pin(node)
        try:
            yield node
        finally:
            self.unpin(node)

    # ---------------------------------------------------------------- eviction

    def evict(self, num_blocks: int) -> list[int]:
        """Free at least ``num_blocks`` blocks, least-recently-used unpinned leaves first.

        Whole leaves go, so more may be freed; fewer when not enough is evictable. A parent
        left as an unpinned leaf becomes a candidate in turn; a namespace root left empty and
        unpinned is dropped. Returns the freed block ids (ownership passes to the caller).
        O(log L) per evicted node; never scans the tree.
        """
        if num_blocks < 0:
            raise ValueError(f"evict needs num_blocks >= 0, got {num_blocks}")
        freed: list[int] = []
        evictable = self._evictable
        kept: list[Node] = []  # device candidates with host children: only demote() can take them
        while len(freed) < num_blocks and evictable:
            node = evictable.pop(0)[2]
            node.evict_entry = None
            if node.children:
                kept.append(node)
                continue
            freed += node.block_ids
            self._remove_leaf(node)
        for node in kept:
            self._add_evictable(node)
        return freed

    def drop(self, namespaces: Callable[[Hashable], bool]) -> tuple[list[int], list[int]]:
        """Drop every unpinned node under the roots whose namespace ``namespaces(ns)`` accepts
        (an unloaded adapter's prefixes); pinned paths stay until unpinned, and then are
        ordinary LRU candidates. Returns (freed device ids, freed host ids); ownership passes
        to the caller. O(N log L) over the N nodes of the matching roots.
        """
        freed: tuple[list[int], list[int]] = ([], [])
        for key in [key for key in self._roots if namespaces(key)]:
            nodes: list[Node] = []  # parents before children
            stack = [self._roots[key]]
            while stack:
                node = stack.pop()
                nodes.append(node)
                stack.extend(node.children.values())
            for node in reversed(nodes):  # children first: each is a leaf when its turn comes
                if node.is_root or node.children or node.pin_count or not node.attached:
                    continue
                if node.evict_entry is not None:
                    self._lru[node.tier].remove(node.evict_entry)
                    node.evict_entry = None
                freed[node.tier].extend(node.block_ids)
                self._remove_leaf(node)
        return freed

    def clear(self) -> list[int]:
        """Drop every unpinned node (a cache flush) and return their block ids; pinned paths stay.

        Empty unpinned namespace roots are dropped too. O(N log N) for N nodes. Raises
        ValueError, changing nothing, while host nodes exist (their ids index another pool):
        use ``clear_tiers``.
        """
        if self._num_host_blocks:
            raise ValueError("the tree holds host-resident nodes: use clear_tiers()")
        return self.clear_tiers()[0]

    def clear_tiers(self) -> tuple[list[int], list[int]]:
        """``clear`` for a tree with tiers: returns (freed device ids, freed host ids)."""
        host = self.evict_host(self._num_host_blocks)  # host nodes hang below device ones: first
        freed = self.evict(self._num_cached_blocks)
        for root in list(self._roots.values()):
            if not root.children and root.pin_count == 0:
                self._drop_root(root)
        logger.debug(
            "clear freed %d+%d blocks, %d remain pinned", len(freed), len(host), self._num_cached_blocks
        )
        return freed, host

    # ---------------------------------------------------------------- tiers
    # Each node records whether its blocks live in the device pool or in the host pool
    # (``Node.tier``); these methods move a node between the two, take host leaves off the
    # host LRU order and report which tier a cached prefix ends in. The tree never touches the
    # pools: the store copies the blocks and hands the new ids in.

    def cached_prefix(self, tokens: Tokens, namespace: Hashable = None) -> tuple[int, int]:
        """``(tokens, tier)``: the length of ``tokens``' longest cached whole-block prefix and the
        tier of the node it ends in (DEVICE when nothing matches), changing nothing.

        Unlike ``match`` it neither splits a node nor moves recency (a restore sizing what it
        must copy). O(n) to pack, one dict lookup and memcmp per node, O(edge blocks) on the last.
        """
        return self.cached_node(tokens, namespace)[1:]

    def cached_node(self, tokens: Tokens, namespace: Hashable = None) -> tuple[Node | None, int, int]:
        """``cached_prefix`` plus the deepest node holding that prefix (None when it is empty):
        pinning it keeps the whole prefix cached (its edge may reach past the prefix). Changes
        nothing. Cost as ``cached_prefix``."""
        bs, width = self._block_size, self._width
        n = _node.num_tokens_of(tokens)
        query = pack(tokens, n - n % bs)
        node, pos = self._roots.get(namespace), 0
        if node is None:
            return None, 0, DEVICE
        while pos < len(query):
            child = node.children.get(query[pos : pos + width])
            if child is None:
                break
            if query.startswith(child.data, pos):
                node, pos = child, pos + len(child.data)
                continue
            blocks = 1  # the key matched; count the following whole blocks that do too
            while query[pos + blocks * width : pos + (blocks + 1) * width] == child.data[
                blocks * width : (blocks + 1) * width
            ] and pos + (blocks + 1) * width <= len(query):
                blocks += 1
            return child, (pos + blocks * width) // TOKEN_BYTES, child.tier
        return (None if node.is_root else node), pos // TOKEN_BYTES, node.tier

    def evict_host(self, num_blocks: int) -> list[int]:
        """As ``evict``, for host-resident leaves: returns freed host block ids. O(log L) per node."""
        if num_blocks < 0:
            raise ValueError(f"evict_host needs num_blocks >= 0, got {num_blocks}")
        freed: list[int] = []
        evictable = self._host_evictable
        while len(freed) < num_blocks and evictable:
            node = evictable.pop(0)[2]
            node.evict_entry = None
            freed += node.block_ids
            self._remove_leaf(node)
        return freed

    def demotion_candidate(self) -> Node | None:
        """The least recently used unpinned device node without device children, or None. O(1)."""
        return self._evictable[0][2] if self._evictable else None

    def demote(self, node: Node, host_ids: Sequence[int], host_snap: int = -1) -> list[int]:
        """Mark candidate ``node`` host-resident, its KV now in ``host_ids``; return its device ids.

        The caller has copied the blocks (same order, one host id per block), and a snapshot
        the node holds into host slot ``host_snap`` (its device slot, ``node.snap`` before the
        call, is the caller's to free). ``node`` keeps
        its place in the LRU order (its ``last_access``); its parent may become a candidate.
        Raises ValueError, changing nothing, when ``node`` is not a demotion candidate or the
        id count differs. O(log L + len(host_ids)).
        """
        if node.evict_entry is None or node.tier != DEVICE:
            raise ValueError(f"cannot demote {node!r}: not an unpinned device node without device children")
        if len(host_ids) != len(node.block_ids):
            raise ValueError(f"demote needs {len(node.block_ids)} host block ids, got {len(host_ids)}")
        if (node.snap >= 0) != (host_snap >= 0):
            raise ValueError(f"demote of {node!r}: a host snapshot slot exactly when the node has a snapshot")
        new_ids = list(host_ids)
        if self._owned_host is not None:
            new_ids = _node.check_block_ids(new_ids, self._owned_host)
            self._owned.difference_update(node.block_ids)
            self._owned_host.update(new_ids)
        self._evictable.remove(node.evict_entry)
        node.evict_entry = None
        if node.snap >= 0:
            self._snap_lru[DEVICE].remove(node.snap_entry)
            self._num_snaps[DEVICE] -= 1
            self._num_snaps[HOST] += 1
        old, node.block_ids, node.tier = node.block_ids, new_ids, HOST
        if node.snap >= 0:
            node.snap = host_snap
            self._add_snap_entry(node)
        self._num_host_blocks += len(new_ids)
        if not node.children:
            self._add_evictable(node)
        parent = node.parent
        parent.dev_children -= 1
        if not (parent.dev_children or parent.pin_count or parent.is_root or parent.evict_entry):
            self._add_evictable(parent)
        if self.listener is not None:
            self.listener.moved(node, DEVICE)
        return old

    def promote(self, node: Node, device_ids: Sequence[int], device_snap: int = -1) -> list[int]:
        """Mark pinned host ``node`` under a device parent device-resident, its KV now in
        ``device_ids``; return its host ids. The reverse of ``demote``, for a caller holding
        the only pins on ``node`` (a reader's lease fixes which of its ids are host ids).

        The caller has copied the blocks (same order). Raises ValueError, changing nothing,
        when ``node`` is not a pinned host node whose parent is on the device, or the id count
        differs. O(len(device_ids)).
        """
        if node.tier != HOST or node.parent is None or node.parent.tier != DEVICE or not node.pin_count:
            raise ValueError(f"cannot promote {node!r}: not a pinned host node under a device node")
        if len(device_ids) != len(node.block_ids):
            raise ValueError(f"promote needs {len(node.block_ids)} device block ids, got {len(device_ids)}")
        if (node.snap >= 0) != (device_snap >= 0):
            raise ValueError(
                f"promote of {node!r}: a device snapshot slot exactly when the node has a snapshot"
            )
        new_ids = list(device_ids)
        if self._owned is not None:
            new_ids = _node.check_block_ids(new_ids, self._owned)
            self._owned_host.difference_update(node.block_ids)
            self._owned.update(new_ids)
        old, node.block_ids, node.tier = node.block_ids, new_ids, DEVICE
        if node.snap >= 0:  # pinned: no LRU entry to move; the host slot is the caller's to free
            node.snap = device_snap
            self._num_snaps[HOST] -= 1
            self._num_snaps[DEVICE] += 1
        self._num_host_blocks -= len(old)
        self._num_host_pinned_blocks -= len(old)  # pinned: unpin counts it as a device node now
        parent = node.parent
        parent.dev_children += 1
        if parent.evict_entry is not None:  # a device parent is no candidate with a device child
            self._evictable.remove(parent.evict_entry)
            parent.evict_entry = None
        if self.listener is not None:
            self.listener.moved(node, HOST)
        return old

    def host_blocks_at(self, node: Node) -> int:
        """Blocks of host-resident nodes on the path ending at ``node`` (they end it). O(host nodes)."""
        count = 0
        while node.tier:
            count += len(node.block_ids)
            node = node.parent
        return count

    def _touch_device_end(self, node: Node) -> None:
        """Refresh the last device node above host ``node``: walk() stamped it, and it may be a
        demotion candidate (its device children all demoted). O(host nodes on the path + log L)."""
        while node.tier:
            node = node.parent
        if not node.is_root:
            self._touch(node)

    # ---------------------------------------------------------------- snapshots
    # Stateful trees only: a snapshot is the recurrent state after a node's last token, held in
    # a slot of the state pool of the node's tier. The store allocates and copies the slots.

    def node_at(self, tokens: Tokens, namespace: Hashable = None) -> Node | None:
        """The node ending exactly after the whole blocks of ``tokens`` (an edge is split there),
        or None when that prefix is not all cached (or is empty). Moves no recency. O(as match)."""
        bs = self._block_size
        n = _node.num_tokens_of(tokens)
        query = pack(tokens, n - n % bs)
        root = self._roots.get(namespace)
        if root is None or not query:
            return None
        node, pos, edge, matched = self._walk_quietly(root, query)
        if edge is not None and pos + matched == len(query):
            return self._split(edge, matched)
        return node if pos == len(query) else None

    def _walk_quietly(self, root: Node, query: bytes) -> tuple[Node, int, Node | None, int]:
        """``walk`` without stamping recency (each node keeps its ``last_access``)."""
        pos, node = 0, root
        width = self._width
        while pos < len(query):
            child = node.children.get(query[pos : pos + width])
            if child is None:
                return node, pos, None, 0
            if query.startswith(child.data, pos):
                node, pos = child, pos + len(child.data)
                continue
            blocks = 1
            while (
                pos + (blocks + 1) * width <= len(query)
                and query[pos + blocks * width : pos + (blocks + 1) * width]
                == child.data[blocks * width : (blocks + 1) * width]
            ):
                blocks += 1
            return node, pos, child, blocks * width
        return node, pos, None, 0

    def set_snapshot(self, node: Node, slot: int) -> None:
        """Attach snapshot ``slot`` (in the state pool of ``node.tier``) to ``node``, which has none.

        Raises ValueError, changing nothing, for a tree that is not stateful, a root, a node no
        longer in the tree, one with a snapshot already, or a slot that is not an int >= 0. O(log S).
        """
        if not self._stateful:
            raise ValueError("set_snapshot on a tree without recurrent state (RadixTree(stateful=True))")
        if node.is_root:
            raise ValueError("a namespace root holds the initial state: it takes no snapshot")
        self._check_owned(node, "attach a snapshot to")
        if node.snap >= 0:
            raise ValueError(f"{node!r} holds a snapshot already")
        if type(slot) is not int or slot < 0:
            raise ValueError(f"snapshot slot must be an int >= 0, got {slot!r}")
        node.snap = slot
        self._num_snaps[node.tier] += 1
        if node.pin_count == 0:
            self._add_snap_entry(node)

    def detach_snapshot(self, node: Node) -> int:
        """Take ``node``'s snapshot off it, its KV staying; returns the slot (the caller's now)."""
        if node.snap < 0:
            raise ValueError(f"{node!r} holds no snapshot")
        if node.snap_entry is not None:
            self._snap_lru[node.tier].remove(node.snap_entry)
            node.snap_entry = None
        slot, node.snap = node.snap, -1
        self._num_snaps[node.tier] -= 1
        return slot

    def evict_snapshots(self, num_snapshots: int, tier: int = DEVICE) -> list[int]:
        """Drop up to ``num_snapshots`` least recently used unpinned snapshots of ``tier``; their
        nodes (and KV) stay. Returns the slots (ownership passes to the caller). O(log S) each."""
        if num_snapshots < 0:
            raise ValueError(f"evict_snapshots needs num_snapshots >= 0, got {num_snapshots}")
        lru, slots = self._snap_lru[tier], []
        while len(slots) < num_snapshots and lru:
            node = lru.pop(0)[2]
            node.snap_entry = None
            slots.append(node.snap)
            node.snap = -1
            self._num_snaps[tier] -= 1
        return slots

    # ---------------------------------------------------------------- inspection

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children. O(N); do not mutate while iterating."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    def check_invariants(self) -> None:
        """Recount everything from scratch; raise ``TreeInvariantError`` naming the first violation. O(N log N)."""
        check_tree(
            roots=self._roots,
            evictable=self._evictable,
            block_size=self._block_size,
            clock=self._clock,
            num_nodes=self._num_nodes,
            num_cached_blocks=self._num_cached_blocks,
            num_pinned_blocks=self._num_pinned_blocks,
            owned=self._owned,
            host_evictable=self._host_evictable,
            num_host_blocks=self._num_host_blocks,
            num_host_pinned_blocks=self._num_host_pinned_blocks,
            owned_host=self._owned_host,
        )
        check_snapshots(self._roots, self._snap_lru, self._num_snaps, self._stateful)
