"""A compressed radix tree over token ids whose edges are whole KV blocks (pure Python, no torch).

Each node's edge holds a run of whole blocks of ``block_size`` tokens (packed as int64 bytes,
see ``radixkv.node``) and the ids of the KV blocks storing them. Equal tokens under different namespaces never share a node: each
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
from collections.abc import Hashable, Iterator, Sequence

import radixkv.node as _node
from radixkv.node import (
    DEVICE,
    HOST,
    TOKEN_BYTES,
    MatchResult,
    Node,
    Tokens,
    TreeInvariantError,
    pack,
    walk,
)
from radixkv.tree_check import check_tree
from radixkv.tree_tiers import TierOps

__all__ = ["DEVICE", "HOST", "MatchResult", "Node", "RadixTree", "TierOrderError", "TreeInvariantError"]

logger = logging.getLogger(__name__)


class TierOrderError(ValueError):
    """An insert would hang device-resident blocks under a host-resident node."""


class RadixTree(TierOps):
    """Radix tree mapping whole-block token prefixes to KV block ids, with pins and LRU eviction.

    ``n`` below is the query length in tokens, ``d`` the depth of the path in nodes and ``L``
    the number of evictable leaves. Its fields, counters and node bookkeeping live in
    ``TreeState`` (radixkv.tree_state), the host-tier operations in ``TierOps``
    (radixkv.tree_tiers).
    """

    # ---------------------------------------------------------------- lookup and insert

    def match(self, tokens: Tokens, namespace: Hashable = None) -> MatchResult:
        """Longest cached whole-block prefix of ``tokens`` under ``namespace``.

        Tokens beyond the last whole block are ignored. Side effects: when the match ends
        inside an edge, that node is split at the block boundary so ``result.node`` ends
        exactly at ``num_tokens`` (the original node object stays the deeper part); every node
        on the matched path becomes most recently used; an unknown namespace gets an (empty)
        root. O(n) to pack the query (in C; a slice for ``PackedTokens``), one dict lookup and
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
        return MatchResult(pos // TOKEN_BYTES, tuple(ids), node)

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
