"""The state of a ``RadixTree`` and the primitives that keep it consistent (pure Python, no torch).

``TreeState`` owns every field of the tree: the namespace roots, the two LRU orders, the clock,
the counters and the owned-id sets, with the private helpers that add, split and detach nodes
while keeping those counters and orders in step. ``TierOps`` (radixkv.tree_tiers) and
``RadixTree`` (radixkv.tree) build their operations on it; only ``RadixTree`` is public.
"""

from __future__ import annotations

from collections.abc import Hashable

from sortedcontainers import SortedList

import radixkv.node as _node
from radixkv.node import TOKEN_BYTES, Node, split


class TreeState:
    """Fields, counters and node bookkeeping of a ``RadixTree`` (see radixkv.tree for the operations).

    ``L`` below is the number of evictable leaves, ``d`` the depth of a path in nodes.
    """

    def __init__(self, block_size: int = 16, *, check_block_ids: bool = True) -> None:
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
        return leaf

    def _remove_leaf(self, node: Node) -> None:
        """Detach an unpinned leaf already taken out of the evictable set; cascade to its parent."""
        parent = node.parent
        assert parent is not None
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

    def _touch(self, node: Node) -> None:
        """Move ``node`` to the most-recent end of the eviction order if it is a candidate. O(log L)."""
        if node.evict_entry is not None and node.evict_entry[0] != node.last_access:
            self._lru[node.tier].remove(node.evict_entry)
            self._add_evictable(node)
