"""Tier movement of ``KVStore`` (radixkv.store): make room on a tier, promote a host prefix back.

Making room on the device demotes the least recently used candidates when there is a host tier
(their blocks are copied to host blocks, the nodes stay in the tree) and evicts them otherwise;
the host drops its own LRU leaves. Promotion (task pins only) copies a host-resident path end
back to device blocks.

``StoreTierMoves`` is a base of ``KVStore``. Its methods run with the store's lock held and use
the store's ``tree``, ``pool``, ``host_pool`` (None without a host tier) and ``counters``.
"""

from __future__ import annotations

from radixkv.node import DEVICE, HOST
from radixkv.tier import copy_blocks
from radixkv.tree import MatchResult


class StoreTierMoves:
    """Moves blocks between the device and host pools of a ``KVStore``, under its lock."""

    def _host_blocks(self, match: MatchResult) -> int:
        return self.tree.host_blocks_at(match.node) if self.host_pool is not None else 0

    def _make_room_locked(self, tier: int, num_blocks: int) -> None:
        """Free ``num_blocks`` blocks of ``tier`` (fewer when too much is pinned): the host drops
        LRU leaves; the device drops them too, or demotes them when there is a host tier."""
        if tier == HOST:
            freed = self.tree.evict_host(num_blocks)
            self.host_pool.free(freed)
            self.counters.evicted_blocks += len(freed)
            return
        if self.host_pool is None:
            freed = self.tree.evict(num_blocks)
            self.pool.free(freed)
            self.counters.evicted_blocks += len(freed)
            return
        tree, host, done = self.tree, self.host_pool, 0
        while done < num_blocks:
            node = tree.demotion_candidate()
            if node is None:
                break
            n = len(node.block_ids)
            # Drop host leaves only when that makes room for the node: emptying the host for a
            # node larger than what it can free would lose its content and demote nothing.
            if host.num_free < n <= host.num_free + tree.num_host_blocks - tree.num_host_pinned_blocks:
                self._make_room_locked(HOST, n - host.num_free)
            if host.num_free < n:  # the host is pinned full: drop device leaves instead
                freed = tree.evict(num_blocks - done)
                self.pool.free(freed)
                self.counters.evicted_blocks += len(freed)
                return
            host_ids = host.allocate(n)
            # Under the lock: nobody can pin, read or overwrite the node's blocks meanwhile.
            self.counters.bytes_to_host += copy_blocks(self.pool, node.block_ids, host, host_ids)
            self.pool.free(tree.demote(node, host_ids))
            self.counters.demoted_blocks += n
            done += n

    def _promote_locked(self, node) -> bool:
        """Move the host-resident end of the path to ``node`` back to device blocks (task pins:
        never served from the host). Only when nothing else pins it (a reader's lease fixes
        which ids are host ids) and the device can make room; returns whether it moved."""
        tree, host = self.tree, self.host_pool
        chain = []
        while node.tier:
            chain.append(node)
            node = node.parent
        if not chain or chain[-1].pin_count:  # chain[-1]: the topmost host node; pins cover the path below
            return False
        chain.reverse()
        n = sum(len(c.block_ids) for c in chain)
        tree.pin(chain[-1])  # neither demotion nor host eviction may touch the path meanwhile
        try:
            if self.pool.num_free < n:
                self._make_room_locked(DEVICE, n - self.pool.num_free)
            if self.pool.num_free < n:
                return False
            for c in chain:  # top down: each one's parent is on the device by then
                ids = self.pool.allocate(len(c.block_ids))
                try:
                    self.counters.bytes_from_host += copy_blocks(host, c.block_ids, self.pool, ids)
                except BaseException:  # the node keeps its host blocks; ours go back
                    self.pool.free(ids)
                    raise
                host.free(tree.promote(c, ids))
                self.counters.promoted_blocks += len(ids)
            return True
        finally:
            tree.unpin(chain[-1])
