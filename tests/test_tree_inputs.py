"""Bad input to ``RadixTree``: a clear ValueError, and the tree exactly as it was before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixkv.tree import RadixTree
from tests.test_tree_stress import tree_contents


def small_tree() -> RadixTree:
    tree = RadixTree(2)
    tree.insert([1, 2, 3, 4], [10, 11])
    tree.insert([1, 2, 5, 6], [10, 12])
    tree.insert([7, 8], [20])
    return tree


def snapshot(tree: RadixTree) -> tuple:
    return (tree_contents(tree), tree.num_nodes, tree.num_cached_blocks, tree.num_pinned_blocks)


@pytest.mark.parametrize(
    "tokens",
    [
        torch.tensor([[1, 2, 3, 4]]),  # [1, n] from a tokenizer: len() is 1, would match nothing
        torch.tensor([1, 2, 3, 4]),
        torch.tensor([1.0, 2.0, 3.0, 4.0]),
        np.array([1, 2, 3, 4]),
    ],
    ids=["tensor_2d", "tensor_1d", "tensor_float", "ndarray"],
)
@pytest.mark.parametrize("op", ["match", "insert"])
def test_arrays_as_tokens_are_refused(tokens, op: str) -> None:
    tree = small_tree()
    before = snapshot(tree)
    with pytest.raises(ValueError, match=r"tokens must be a sequence of ints \(ids.tolist\(\)\)"):
        if op == "match":
            tree.match(tokens)
        else:
            tree.insert(tokens, [30] * (len(tokens) // 2))
    assert snapshot(tree) == before
    tree.check_invariants()


@pytest.mark.parametrize(
    ("block_ids", "message"),
    [
        ([10, 30], "already in the tree"),  # 10 holds [1, 2]
        ([30, 20], "already in the tree"),
        ([30, 30], "must be distinct"),
        ([30, -1], r"ints >= 0"),
        ([30, 2.0], r"ints >= 0"),
        ([30, "31"], r"ints >= 0"),
        ([30, None], r"ints >= 0"),
        (torch.tensor([30, 31]), "block_ids must be a sequence of ints"),
    ],
)
def test_bad_block_ids_are_refused_without_change(block_ids, message: str) -> None:
    tree = small_tree()
    before = snapshot(tree)
    with pytest.raises(ValueError, match=message):
        tree.insert([9, 9, 8, 8], block_ids)
    assert snapshot(tree) == before
    tree.check_invariants()
    assert tree.insert([9, 9, 8, 8], [30, 31]) == 0  # still usable


def test_leading_ids_of_the_cached_prefix_are_not_taken() -> None:
    """The store passes the matched prefix's own ids first: they may be the tree's ids."""
    tree = small_tree()
    assert tree.insert([1, 2, 3, 4, 9, 9], [10, 11, 30]) == 4
    tree.check_invariants()
    assert tree.match([1, 2, 3, 4, 9, 9]).block_ids == (10, 11, 30)


def test_refused_insert_keeps_the_eviction_order_consistent() -> None:
    """The walk stamps the matched leaf before the ids are checked; its LRU entry must follow."""
    tree = RadixTree(2)
    tree.insert([7, 8], [20])
    tree.insert([1, 2, 3, 4], [10, 11])
    with pytest.raises(ValueError, match="already in the tree"):
        tree.insert([7, 8, 5, 5], [20, 11])  # walks through leaf [7, 8], then refuses id 11
    tree.check_invariants()  # a stale evict entry for [7, 8] would fail here
    assert tree.evict(1) == [10, 11]  # [7, 8] was just used (and its entry says so)


def test_pin_and_unpin_of_another_trees_node_change_nothing() -> None:
    mine, other = small_tree(), small_tree()
    node = other.match([1, 2, 3, 4]).node
    before = snapshot(mine)
    with pytest.raises(ValueError, match="another tree"):
        mine.pin(node)
    other.pin(node)
    with pytest.raises(ValueError, match="another tree"):
        mine.unpin(node)
    assert snapshot(mine) == before and node.own_pins == 1
    mine.check_invariants()
    other.check_invariants()
    other.unpin(node)
    other.check_invariants()


def test_pin_of_a_dropped_namespace_root_is_refused() -> None:
    tree = small_tree()
    root = tree.match([5, 5], namespace="gone").node
    with tree.pinned(root):
        pass  # unpinned and empty: dropped
    with pytest.raises(ValueError, match="no longer in the tree"):
        tree.pin(root)
    tree.check_invariants()


def test_owned_id_freed_by_eviction_can_be_inserted_again() -> None:
    tree = small_tree()
    freed = tree.evict(1)
    assert freed == [11]
    assert tree.insert([4, 4], freed) == 0
    tree.check_invariants()


# -- PackedTokens: packed once, from a list or straight from int64 memory -----------------------
def test_packed_tokens_match_and_insert_like_the_list() -> None:
    from array import array

    from radixkv import pack_tokens

    tokens = [1, 2, 3, 4, 5, 6, 7]
    packed = [
        pack_tokens(tokens),
        pack_tokens(tuple(tokens)),
        pack_tokens(np.array(tokens, dtype=np.int64)),
        pack_tokens(torch.tensor(tokens).numpy()),
        pack_tokens(array("q", tokens)),
        pack_tokens(np.array([0] + tokens, dtype=np.int64)[1:]),  # a view with an offset
    ]
    assert all(p == packed[0] and p.num_tokens == 7 for p in packed)
    assert pack_tokens(packed[0]) is packed[0]
    assert packed[0].head(4) == pack_tokens(tokens[:4]) and packed[0].head(99) is packed[0]
    for p in packed:
        plain, fast = small_tree(), small_tree()
        assert fast.insert(p, [30, 31, 32]) == plain.insert(tokens, [30, 31, 32]) == 4  # [1..4] cached
        assert snapshot(fast) == snapshot(plain)
        assert fast.match(p).block_ids == plain.match(tokens).block_ids == (10, 11, 32)
        fast.check_invariants()


@pytest.mark.parametrize(
    "buffer",
    [
        np.array([1, 2, 3, 4], dtype=np.int32),  # another width
        np.array([1.0, 2.0, 3.0, 4.0]),  # float64: 8 bytes, not ints
        np.array([[1, 2], [3, 4]], dtype=np.int64),  # 2-D
        b"\x01\x02\x03\x04",  # bytes: not token ids
    ],
    ids=["int32", "float64", "2d", "bytes"],
)
def test_pack_tokens_refuses_other_buffers(buffer) -> None:
    from radixkv import pack_tokens

    with pytest.raises(ValueError, match="1-D native int64"):
        pack_tokens(buffer)


def test_pack_tokens_refuses_a_tensor() -> None:
    from radixkv import pack_tokens

    with pytest.raises(ValueError, match=r"pack_tokens\(ids.numpy\(\)\)"):
        pack_tokens(torch.tensor([[1, 2, 3, 4]]))


def test_unchecked_ids_are_trusted_but_still_recounted() -> None:
    """check_block_ids=False (KVStore: ids fresh off the pool) skips the owned-set; a duplicate
    is then not refused by insert, but check_invariants still finds it."""
    tree = RadixTree(2, check_block_ids=False)
    assert tree.insert([1, 2, 3, 4], [10, 11]) == 0
    tree.check_invariants()
    tree.insert([5, 6], [10])  # a caller bug the checked tree would refuse
    with pytest.raises(AssertionError, match="appear twice|owned twice|unique"):
        tree.check_invariants()


def test_store_trees_trust_the_pool() -> None:
    from radixkv import BlockPool, KVStore, LayerSpec

    store = KVStore(BlockPool([LayerSpec(1, 2, 2, torch.float32, "cpu")], 8, 2))
    assert store.tree._owned is None
    store.flush()
    assert store.tree._owned is None
