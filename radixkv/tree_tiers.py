"""Host-tier operations of ``RadixTree`` (pure Python, no torch): demote, promote, evict_host.

Each node records whether its blocks live in the device pool or in the host pool
(``Node.tier``); these methods move a node between the two, take host leaves off the host LRU
order and report which tier a cached prefix ends in. The tree never touches the pools: the
store copies the blocks and hands the new ids in.

``TierOps`` is a base of ``RadixTree`` and uses the fields of ``TreeState``: ``_roots``,
``_block_size``, ``_width``, ``_evictable`` and ``_host_evictable`` (the two LRU orders),
``_owned``/``_owned_host`` (None when ids are not checked), ``_num_host_blocks``,
``_num_host_pinned_blocks``, and the helpers ``_add_evictable``, ``_remove_leaf`` and ``_touch``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import radixkv.node as _node
from radixkv.node import DEVICE, HOST, TOKEN_BYTES, Node, Tokens, pack
from radixkv.tree_state import TreeState


class TierOps(TreeState):
    """Moves nodes between the device and host tiers.

    ``n`` below is the query length in tokens and ``L`` the number of evictable leaves.
    """

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

    def demote(self, node: Node, host_ids: Sequence[int]) -> list[int]:
        """Mark candidate ``node`` host-resident, its KV now in ``host_ids``; return its device ids.

        The caller has copied the blocks (same order, one host id per block). ``node`` keeps
        its place in the LRU order (its ``last_access``); its parent may become a candidate.
        Raises ValueError, changing nothing, when ``node`` is not a demotion candidate or the
        id count differs. O(log L + len(host_ids)).
        """
        if node.evict_entry is None or node.tier != DEVICE:
            raise ValueError(f"cannot demote {node!r}: not an unpinned device node without device children")
        if len(host_ids) != len(node.block_ids):
            raise ValueError(f"demote needs {len(node.block_ids)} host block ids, got {len(host_ids)}")
        new_ids = list(host_ids)
        if self._owned_host is not None:
            new_ids = _node.check_block_ids(new_ids, self._owned_host)
            self._owned.difference_update(node.block_ids)
            self._owned_host.update(new_ids)
        self._evictable.remove(node.evict_entry)
        node.evict_entry = None
        old, node.block_ids, node.tier = node.block_ids, new_ids, HOST
        self._num_host_blocks += len(new_ids)
        if not node.children:
            self._add_evictable(node)
        parent = node.parent
        parent.dev_children -= 1
        if not (parent.dev_children or parent.pin_count or parent.is_root or parent.evict_entry):
            self._add_evictable(parent)
        return old

    def promote(self, node: Node, device_ids: Sequence[int]) -> list[int]:
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
        new_ids = list(device_ids)
        if self._owned is not None:
            new_ids = _node.check_block_ids(new_ids, self._owned)
            self._owned_host.difference_update(node.block_ids)
            self._owned.update(new_ids)
        old, node.block_ids, node.tier = node.block_ids, new_ids, DEVICE
        self._num_host_blocks -= len(old)
        self._num_host_pinned_blocks -= len(old)  # pinned: unpin counts it as a device node now
        parent = node.parent
        parent.dev_children += 1
        if parent.evict_entry is not None:  # a device parent is no candidate with a device child
            self._evictable.remove(parent.evict_entry)
            parent.evict_entry = None
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
