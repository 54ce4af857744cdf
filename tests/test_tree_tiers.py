"""RadixTree tier marks: demotion candidates, host eviction order, tier order along paths."""

from __future__ import annotations

import pytest

from radixkv.tree import DEVICE, HOST, RadixTree, TierOrderError, TreeInvariantError


def test_demoted_leaf_makes_its_parent_a_device_candidate_and_keeps_its_lru_place() -> None:
    tree = RadixTree(block_size=2)
    tree.insert([1, 1, 2, 2], [10, 11])
    assert tree.insert([1, 1, 3, 3], [10, 12]) == 2  # splits: [1,1] -> {[2,2], [3,3]}
    tree.insert([5, 5], [13])
    tree.match([1, 1, 2, 2])
    node = tree.demotion_candidate()
    assert node.tokens == [3, 3]  # least recently used device leaf
    assert tree.demote(node, [0]) == [12]
    tree.check_invariants()
    assert node.tier == HOST and tree.num_host_blocks == 1
    assert tree.demotion_candidate().tokens == [5, 5]  # next in LRU order
    assert tree.demote(tree.demotion_candidate(), [1]) == [13]
    assert tree.demote(tree.demotion_candidate(), [2]) == [11]  # [2,2]
    parent = tree.match([1, 1]).node
    assert tree.demotion_candidate() is parent  # only host children left
    tree.check_invariants()
    # A match through the parent into a host leaf refreshes the parent's candidacy too.
    m = tree.match([1, 1, 3, 3])
    assert m.block_ids == (10, 0) and tree.host_blocks_at(m.node) == 1
    tree.check_invariants()
    assert tree.demote(parent, [3]) == [10]
    assert tree.num_host_blocks == 4 and tree.demotion_candidate() is None
    tree.check_invariants()
    # Host LRU: [5,5] (oldest), then [2,2], [3,3]; [1,1] goes only after its children.
    assert tree.evict_host(1) == [1]
    assert tree.evict_host(1) == [2]
    assert tree.evict_host(2) == [0, 3]
    tree.check_invariants()


def test_host_eviction_takes_leaves_before_parents_and_skips_pins() -> None:
    tree = RadixTree(block_size=1)
    tree.insert([1, 2], [0, 1])
    tree.insert([1, 3], [0, 2])
    for host_id in (5, 6, 7):
        tree.demote(tree.demotion_candidate(), [host_id])
    tree.check_invariants()
    assert tree.num_cached_blocks == tree.num_host_blocks == 3
    with tree.pinned(tree.match([1, 3]).node):
        assert tree.num_host_pinned_blocks == 2
        assert tree.evict_host(10) == [5]  # [1,2]'s leaf; the pinned path stays
        tree.check_invariants()
    assert sorted(tree.evict_host(10)) == [6, 7]
    assert tree.num_nodes == 0
    tree.check_invariants()


def test_device_blocks_cannot_hang_under_a_host_node() -> None:
    tree = RadixTree(block_size=1)
    tree.insert([1], [0])
    tree.demote(tree.demotion_candidate(), [0])
    with pytest.raises(TierOrderError, match="under host-resident"):
        tree.insert([1, 2], [9, 1])
    assert tree.insert([1, 2], [9, 1], tier=HOST) == 1  # the host id space is separate
    tree.check_invariants()
    assert tree.match([1, 2]).block_ids == (0, 1)


def test_evict_skips_device_candidates_with_host_children_and_clear_needs_tiers() -> None:
    tree = RadixTree(block_size=1)
    tree.insert([1], [0])
    tree.insert([1, 2], [0, 1])
    tree.insert([3], [2])
    tree.demote(tree.match([1, 2]).node, [0])
    tree.match([3])  # [1] (host child only) is now the LRU device candidate
    assert tree.evict(1) == [2]  # [1] cannot be dropped while its host child hangs below
    tree.check_invariants()
    with pytest.raises(ValueError, match="clear_tiers"):
        tree.clear()
    assert tree.clear_tiers() == ([0], [0])
    assert tree.num_nodes == 0
    tree.check_invariants()


def test_demote_refuses_pinned_or_inner_nodes_and_wrong_counts() -> None:
    tree = RadixTree(block_size=1)
    tree.insert([1, 2], [0, 1])
    inner = tree.match([1]).node
    with pytest.raises(ValueError, match="cannot demote"):
        tree.demote(inner, [0])
    leaf = tree.match([1, 2]).node
    with pytest.raises(ValueError, match="needs 1 host block ids"):
        tree.demote(leaf, [0, 1])
    with tree.pinned(leaf), pytest.raises(ValueError, match="cannot demote"):
        tree.demote(leaf, [0])
    tree.check_invariants()
    assert all(node.tier == DEVICE for node in tree.iter_nodes())


def test_checker_catches_broken_tier_marks() -> None:
    tree = RadixTree(block_size=1)
    tree.insert([1, 2], [0, 1])
    tree.match([1])  # split: [1] -> [2]
    tree.demote(tree.demotion_candidate(), [0])
    tree.match([1]).node.tier = HOST  # tier order holds, but the host counters now disagree
    with pytest.raises(TreeInvariantError):
        tree.check_invariants()
    tree = RadixTree(block_size=1)
    tree.insert([1, 2], [0, 1])
    tree.match([1])
    tree.demote(tree.demotion_candidate(), [0])
    tree.match([1, 2]).node.tier = DEVICE  # counters and LRU orders disagree
    with pytest.raises(TreeInvariantError):
        tree.check_invariants()


def test_promote_is_demote_reversed_for_a_pinned_host_chain() -> None:
    tree = RadixTree(block_size=2)
    tree.insert([1, 1, 2, 2, 3, 3], [10, 11, 12])
    tree.insert([1, 1, 2, 2, 4, 4], [10, 11, 13])  # [1,1,2,2] -> {[3,3], [4,4]}
    tree.match([1, 1, 2, 2, 3, 3])  # [4,4] is the least recently used leaf
    assert tree.demote(tree.demotion_candidate(), [21]) == [13]
    assert tree.demote(tree.demotion_candidate(), [20]) == [12]
    assert tree.demote(tree.demotion_candidate(), [22, 23]) == [10, 11]
    top = tree.match([1, 1, 2, 2]).node
    assert top.tier == HOST and tree.num_host_blocks == 4
    with pytest.raises(ValueError, match="cannot promote"):
        tree.promote(top, [30, 31])  # unpinned: the caller does not hold it
    leaf = tree.match([1, 1, 2, 2, 3, 3]).node
    tree.pin(leaf)
    with pytest.raises(ValueError, match="cannot promote"):
        tree.promote(leaf, [32])  # its parent is still on the host
    with pytest.raises(ValueError, match="2 device block ids"):
        tree.promote(top, [30])
    assert tree.promote(top, [30, 31]) == [22, 23]
    assert tree.promote(leaf, [32]) == [20]
    tree.check_invariants()
    assert (tree.num_host_blocks, tree.num_host_pinned_blocks) == (1, 0)
    tree.unpin(leaf)
    tree.check_invariants()
    assert tree.demotion_candidate() is leaf  # a device leaf again, in the device LRU order
    assert tree.match([1, 1, 2, 2, 3, 3]).block_ids == (30, 31, 32)
    assert tree.evict_host(5) == [21]  # the other leaf stayed on the host
    tree.check_invariants()
