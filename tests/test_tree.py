"""Unit tests of ``radixkv.tree.RadixTree``: each operation on small tables of cases."""

from __future__ import annotations

import ast
import dataclasses
import doctest
from pathlib import Path

import pytest

import radixkv.tree.radix_tree as tree_module
from radixkv.tree import MatchResult, RadixTree, TreeInvariantError
from radixkv.tree.node import Node, pack, unpack

BLOCK_SIZES = [1, 16]


def seq(*labels: int, bs: int) -> list[int]:
    """Tokens of whole blocks; block ``label`` holds ``label * 1000 + j`` for ``j < bs``."""
    return [label * 1000 + j for label in labels for j in range(bs)]


def ids_of(tree: RadixTree) -> list[int]:
    return sorted(b for node in tree.iter_nodes() for b in node.block_ids)


# ------------------------------------------------------------------ construction


@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 256])
def test_power_of_two_block_sizes_accepted(block_size: int) -> None:
    assert RadixTree(block_size).block_size == block_size


@pytest.mark.parametrize("block_size", [0, -16, 3, 12, 24, 1.0, True, "16", None])
def test_bad_block_size_names_allowed_values(block_size: object) -> None:
    with pytest.raises(ValueError, match="power of two"):
        RadixTree(block_size)  # type: ignore[arg-type]


def test_default_block_size_is_16() -> None:
    assert RadixTree().block_size == 16


# ------------------------------------------------------------------ match


MATCH_CASES = [
    # (cached sequences as block labels, query labels, extra trailing tokens, expected matched labels)
    ([], [1, 2], 0, []),
    ([[1, 2, 3]], [1, 2, 3], 0, [1, 2, 3]),
    ([[1, 2, 3]], [1, 2, 3, 4], 0, [1, 2, 3]),
    ([[1, 2, 3]], [1, 2], 0, [1, 2]),  # ends inside an edge: split
    ([[1, 2, 3]], [1, 2, 9], 0, [1, 2]),  # diverges inside an edge: split
    ([[1, 2, 3]], [9, 1, 2], 0, []),
    ([[1, 2, 3]], [1, 2, 3], 5, [1, 2, 3]),  # partial trailing block ignored
    ([[1, 2], [1, 2, 3, 4], [1, 5]], [1, 2, 3, 7], 0, [1, 2, 3]),
    ([[1, 2], [1, 2, 3, 4], [1, 5]], [1, 5, 6], 0, [1, 5]),
]


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize(("cached", "query", "extra", "expected"), MATCH_CASES)
def test_match_longest_whole_block_prefix(
    bs: int, cached: list[list[int]], query: list[int], extra: int, expected: list[int]
) -> None:
    tree = RadixTree(bs)
    block_of: dict[tuple[int, ...], int] = {}  # prefix of labels -> block id holding its last block
    for labels in cached:
        ids = [
            block_of.setdefault(tuple(labels[: i + 1]), 100 * len(block_of) + i) for i in range(len(labels))
        ]
        tree.insert(seq(*labels, bs=bs), ids)
    tokens = seq(*query, bs=bs) + [7] * (extra % bs if bs > 1 else 0)
    result = tree.match(tokens)
    tree.check_invariants()
    assert result.num_tokens == len(expected) * bs
    assert result.block_ids == tuple(block_of[tuple(expected[: i + 1])] for i in range(len(expected)))
    if expected:
        assert result.node.num_tokens > 0 and not result.node.is_root
        assert result.node.block_ids[-1] == result.block_ids[-1]  # node ends exactly at num_tokens
    else:
        assert result.node.is_root


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_match_splits_edge_and_keeps_original_node_deeper(bs: int) -> None:
    tree = RadixTree(bs)
    tree.insert(seq(1, 2, 3, 4, bs=bs), [10, 11, 12, 13])
    leaf = tree.match(seq(1, 2, 3, 4, bs=bs)).node
    result = tree.match(seq(1, 2, 8, bs=bs))
    tree.check_invariants()
    assert result.block_ids == (10, 11)
    assert tree.num_nodes == 2
    assert leaf.parent is result.node and leaf.tokens == seq(3, 4, bs=bs) and leaf.block_ids == [12, 13]
    assert result.node.tokens == seq(1, 2, bs=bs)


@pytest.mark.parametrize("bs", [4, 16])
def test_mismatch_inside_a_block_drops_that_whole_block(bs: int) -> None:
    tree = RadixTree(bs)
    tree.insert(seq(1, 2, 3, bs=bs), [10, 11, 12])
    tokens = seq(1, 2, 3, bs=bs)
    tokens[bs + bs // 2] = -5  # middle of block 2
    assert tree.match(tokens).block_ids == (10,)
    tokens = seq(1, 2, 3, bs=bs)
    tokens[-1] = -5  # last token of block 3
    assert tree.match(tokens).block_ids == (10, 11)
    tree.check_invariants()


def test_match_accepts_any_int_sequence() -> None:
    tree = RadixTree(2)
    tree.insert((1, 2, 3, 4), (5, 6))
    assert tree.match(range(1, 5)).block_ids == (5, 6)
    assert tree.match([1, 2, 3, 4]).num_tokens == 4


@pytest.mark.parametrize("bad", [[1, "x"], [1, 2.5], [1, 2**64], [None, 1]])
def test_non_int_tokens_raise_value_error(bad: list[object]) -> None:
    tree = RadixTree(1)
    with pytest.raises(ValueError, match="token ids must be ints"):
        tree.match(bad)  # type: ignore[arg-type]


def test_pack_roundtrip_including_negative_and_large_ids() -> None:
    tokens = [0, -1, 2**63 - 1, -(2**63), 31999]
    assert unpack(pack(tokens, 5)) == tokens
    assert unpack(pack(tokens, 3)) == tokens[:3]


def test_match_result_is_frozen() -> None:
    result = RadixTree(1).match([1])
    assert isinstance(result, MatchResult)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.num_tokens = 3  # type: ignore[misc]


# ------------------------------------------------------------------ insert


INSERT_CASES = [
    # (first labels, first ids, second labels, second ids, returned blocks, expected match of second)
    ([1, 2, 3], [10, 11, 12], [1, 2, 3], [20, 21, 22], 3, (10, 11, 12)),  # already cached
    ([1, 2, 3], [10, 11, 12], [1, 2], [20, 21], 2, (10, 11)),  # ends inside an edge: no split
    ([1, 2, 3], [10, 11, 12], [1, 2, 4], [20, 21, 22], 2, (10, 11, 22)),  # split mid edge
    ([1, 2, 3], [10, 11, 12], [1, 2, 3, 4, 5], [20, 21, 22, 23, 24], 3, (10, 11, 12, 23, 24)),
    ([1, 2, 3], [10, 11, 12], [5, 6], [20, 21], 0, (20, 21)),
    ([1, 2, 3], [10, 11, 12], [], [], 0, ()),
]


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize(("first", "first_ids", "second", "second_ids", "returned", "expected"), INSERT_CASES)
def test_insert_returns_cached_prefix_and_takes_only_new_ids(
    bs: int,
    first: list[int],
    first_ids: list[int],
    second: list[int],
    second_ids: list[int],
    returned: int,
    expected: tuple[int, ...],
) -> None:
    tree = RadixTree(bs)
    assert tree.insert(seq(*first, bs=bs), first_ids) == 0
    assert tree.insert(seq(*second, bs=bs), second_ids) == returned * bs
    tree.check_invariants()
    assert tree.match(seq(*second, bs=bs)).block_ids == expected
    duplicates = second_ids[:returned]
    assert ids_of(tree) == sorted(set(first_ids) | set(second_ids[returned:]))
    assert not set(duplicates) & set(ids_of(tree))


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_insert_of_cached_sequence_changes_nothing_but_recency(bs: int) -> None:
    tree = RadixTree(bs)
    tree.insert(seq(1, 2, 3, bs=bs), [10, 11, 12])
    tree.insert(seq(5, bs=bs), [50])
    before = [(n.tokens, n.block_ids, n.uid) for n in tree.iter_nodes()]
    assert tree.insert(seq(1, 2, bs=bs), [20, 21]) == 2 * bs  # inside the first edge
    assert [(n.tokens, n.block_ids, n.uid) for n in tree.iter_nodes()] == before
    assert tree.evict(1) == [50]  # the re-inserted path became most recent
    tree.check_invariants()


@pytest.mark.parametrize("bs", [2, 16])
def test_insert_ignores_partial_trailing_block(bs: int) -> None:
    tree = RadixTree(bs)
    assert tree.insert(seq(1, 2, bs=bs) + [99] * (bs - 1), [10, 11]) == 0
    assert tree.num_cached_blocks == 2
    assert tree.match(seq(1, 2, 3, bs=bs)).num_tokens == 2 * bs


@pytest.mark.parametrize(("num_tokens", "num_ids"), [(32, 1), (32, 3), (47, 3), (15, 1), (0, 1)])
def test_insert_wrong_number_of_block_ids(num_tokens: int, num_ids: int) -> None:
    tree = RadixTree(16)
    with pytest.raises(ValueError, match=r"one block id per whole block of 16 tokens: .* got "):
        tree.insert(list(range(num_tokens)), list(range(num_ids)))
    assert tree.num_nodes == 0


@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_insert_split_in_middle_of_pinned_edge(bs: int) -> None:
    tree = RadixTree(bs)
    tree.insert(seq(1, 2, 3, bs=bs), [10, 11, 12])
    held = tree.match(seq(1, 2, 3, bs=bs)).node
    tree.pin(held)
    assert tree.insert(seq(1, 4, bs=bs), [20, 21]) == bs
    tree.check_invariants()
    top = held.parent
    assert top is not None and top.block_ids == [10] and top.pin_count == 1 and top.own_pins == 0
    assert held.block_ids == [11, 12] and held.own_pins == 1
    assert tree.evict(10) == [21]
    tree.unpin(held)
    tree.check_invariants()
    assert sorted(tree.evict(10)) == [10, 11, 12]


# ------------------------------------------------------------------ namespaces


@pytest.mark.parametrize("namespaces", [("a", "b"), (None, "tenant"), ((1, "lora"), (2, "lora"))])
def test_namespaces_never_share(namespaces: tuple[object, object]) -> None:
    first, second = namespaces
    tree = RadixTree(2)
    tokens = seq(1, 2, bs=2)
    assert tree.insert(tokens, [10, 11], namespace=first) == 0
    assert tree.match(tokens, namespace=second).num_tokens == 0
    assert tree.insert(tokens, [20, 21], namespace=second) == 0
    assert tree.match(tokens, namespace=first).block_ids == (10, 11)
    assert tree.match(tokens, namespace=second).block_ids == (20, 21)
    assert tree.num_cached_blocks == 4
    tree.check_invariants()
    assert sorted(tree.evict(100)) == [10, 11, 20, 21]
    tree.check_invariants()


def test_miss_in_new_namespace_returns_its_root_and_leaves_nothing_behind() -> None:
    tree = RadixTree(2)
    result = tree.match([1, 2], namespace="new")
    assert result.node.is_root and result.node.key == "new"
    with tree.pinned(result.node):
        tree.check_invariants()
    tree.check_invariants()
    assert list(tree.iter_nodes()) == [] and not result.node.attached


# ------------------------------------------------------------------ pins


def test_pinned_leaf_and_its_ancestors_are_never_evicted() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2], [10, 11])
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 5], [20, 21])
    tree.insert([7], [30])
    node = tree.match([1, 2, 3]).node
    tree.pin(node)
    assert tree.num_pinned_blocks == 3  # [1], [2], [3]
    assert sorted(tree.evict(100)) == [21, 30]
    assert tree.match([1, 2, 3]).block_ids == (10, 11, 12)
    tree.check_invariants()


def test_pinning_an_inner_node_leaves_its_children_evictable() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3], [10, 11, 12])
    inner = tree.match([1, 2]).node
    with tree.pinned(inner):
        assert tree.num_pinned_blocks == 2 and tree.num_evictable_blocks == 1
        assert tree.evict(100) == [12]
        tree.check_invariants()
    assert sorted(tree.evict(100)) == [10, 11]


def test_pinned_context_manager_releases_on_exception() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2], [10, 11])
    node = tree.match([1, 2]).node
    with pytest.raises(KeyError), tree.pinned(node):
        assert tree.evict(5) == []
        raise KeyError("boom")
    assert tree.num_pinned_blocks == 0 and node.pin_count == 0
    tree.check_invariants()
    assert sorted(tree.evict(5)) == [10, 11]


def test_pins_nest_and_count() -> None:
    tree = RadixTree(1)
    tree.insert([1], [10])
    node = tree.match([1]).node
    tree.pin(node)
    tree.pin(node)
    tree.unpin(node)
    assert tree.evict(1) == []
    tree.unpin(node)
    assert tree.evict(1) == [10]


def test_unpin_below_zero_raises() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2], [10, 11])
    node = tree.match([1, 2]).node
    with pytest.raises(RuntimeError, match="unpin without a matching pin"):
        tree.unpin(node)
    leaf = tree.match([1, 2]).node
    parent = tree.match([1]).node  # split: leaf stays [2], parent [1]
    tree.pin(leaf)
    with pytest.raises(RuntimeError, match="unpin without a matching pin"):
        tree.unpin(parent)  # pinned only through its child
    tree.check_invariants()


def test_pin_evicted_node_raises() -> None:
    tree = RadixTree(1)
    tree.insert([1], [10])
    node = tree.match([1]).node
    tree.evict(1)
    with pytest.raises(ValueError, match="no longer in the tree"):
        tree.pin(node)


def test_split_of_pinned_node_keeps_holder_reference_valid() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3, 4], [10, 11, 12, 13])
    held = tree.match([1, 2, 3, 4]).node
    tree.pin(held)
    top = tree.match([1, 2]).node  # split a pinned node
    assert held.parent is top and top.pin_count == 1 and held.own_pins == 1
    tree.check_invariants()
    tree.unpin(held)
    assert top.pin_count == 0 and tree.num_pinned_blocks == 0
    tree.check_invariants()
    assert sorted(tree.evict(100)) == [10, 11, 12, 13]


# ------------------------------------------------------------------ eviction


@pytest.mark.parametrize(
    ("touch", "expected_order"),
    [
        ([], [[10], [20], [30]]),  # insertion order
        ([1], [[20], [30], [10]]),  # match refreshes recency
        ([2, 1], [[30], [20], [10]]),
        ([3, 2, 1], [[30], [20], [10]]),
    ],
)
def test_evict_least_recently_used_first(touch: list[int], expected_order: list[list[int]]) -> None:
    tree = RadixTree(1)
    for label, block in [(1, 10), (2, 20), (3, 30)]:
        tree.insert([label], [block])
    for label in touch:
        tree.match([label])
    assert [tree.evict(1) for _ in expected_order] == expected_order
    tree.check_invariants()


def test_parent_evicted_after_its_children() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2], [10, 11])
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 2, 4], [10, 11, 14])
    tree.insert([9], [90])  # most recent, but a leaf of its own
    order = [tree.evict(1) for _ in range(4)]
    assert order == [[12], [14], [10, 11], [90]]  # [1, 2] becomes a leaf only after 3 and 4 go
    tree.check_invariants()


@pytest.mark.parametrize(
    ("num_blocks", "expected"),
    [(0, []), (1, [10, 11, 12]), (3, [10, 11, 12]), (4, [10, 11, 12, 20]), (100, [10, 11, 12, 20])],
)
def test_evict_frees_whole_leaves(num_blocks: int, expected: list[int]) -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([5], [20])
    assert tree.evict(num_blocks) == expected
    assert tree.num_cached_blocks == 4 - len(expected)
    tree.check_invariants()


def test_evict_negative_raises() -> None:
    with pytest.raises(ValueError, match="num_blocks >= 0"):
        RadixTree(1).evict(-1)


def test_evict_on_empty_tree() -> None:
    assert RadixTree(1).evict(5) == []


# ------------------------------------------------------------------ clear and counters


def test_clear_drops_unpinned_keeps_pinned_paths() -> None:
    tree = RadixTree(1)
    tree.insert([1, 2, 3], [10, 11, 12])
    tree.insert([1, 5], [10, 15])
    tree.insert([7], [70], namespace="x")
    held = tree.match([1, 2]).node
    tree.pin(held)
    assert sorted(tree.clear()) == [12, 15, 70]
    tree.check_invariants()
    assert ids_of(tree) == [10, 11] and tree.num_nodes == 2
    tree.unpin(held)
    assert sorted(tree.clear()) == [10, 11]
    assert tree.num_nodes == 0 and tree.num_cached_blocks == 0 and list(tree.iter_nodes()) == []
    tree.check_invariants()


def test_counters() -> None:
    tree = RadixTree(2)
    tree.insert(seq(1, 2, 3, bs=2), [10, 11, 12])
    tree.insert(seq(1, 4, bs=2), [10, 14])
    assert (tree.num_nodes, tree.num_cached_blocks) == (3, 4)
    node = tree.match(seq(1, 2, bs=2)).node  # splits [2, 3]
    assert tree.num_nodes == 4
    with tree.pinned(node):
        assert (tree.num_pinned_blocks, tree.num_evictable_blocks) == (2, 2)
    assert (tree.num_pinned_blocks, tree.num_evictable_blocks) == (0, 4)
    tree.check_invariants()


# ------------------------------------------------------------------ the checker itself


def _empty(node: Node) -> None:
    node.data = b""
    node.block_ids.clear()


def _corruptions() -> dict[str, tuple[str, object]]:
    """name -> (message fragment, function corrupting a small tree)."""

    def leaf(tree: RadixTree, label: int) -> Node:
        return tree.match(seq(1, label, bs=2)).node

    return {
        "pin count": ("pin_count", lambda t: setattr(leaf(t, 2), "pin_count", 1)),
        "own pins": ("negative own pins", lambda t: setattr(leaf(t, 2), "own_pins", -1)),
        "duplicate id": ("appear twice", lambda t: leaf(t, 2).block_ids.__setitem__(0, 14)),
        "ids vs tokens": ("tokens for", lambda t: leaf(t, 2).block_ids.append(99)),
        "child key": ("stored under key", lambda t: setattr(leaf(t, 2), "key", b"x" * 16)),
        "parent": ("has parent", lambda t: setattr(leaf(t, 2), "parent", leaf(t, 4))),
        "empty": ("empty non-root", lambda t: _empty(leaf(t, 2))),
        "evictable": ("evictable", lambda t: t._evictable.pop(0)),
        "cached counter": ("num_cached_blocks", lambda t: setattr(t, "_num_cached_blocks", 99)),
        "nodes counter": ("num_nodes", lambda t: setattr(t, "_num_nodes", 0)),
        "pinned counter": ("num_pinned_blocks", lambda t: setattr(t, "_num_pinned_blocks", 1)),
        "recency": ("used after its parent", lambda t: setattr(leaf(t, 2).parent, "last_access", 0)),
        "clock": ("outside", lambda t: setattr(leaf(t, 2), "last_access", t._clock + 5)),
        "owned set": ("owned block ids", lambda t: t._owned.add(99)),
        "negative id": ("not an int >= 0", lambda t: leaf(t, 2).block_ids.__setitem__(0, -12)),
    }


@pytest.mark.parametrize("name", list(_corruptions()))
def test_check_invariants_catches_corruption(name: str) -> None:
    fragment, corrupt = _corruptions()[name]
    tree = RadixTree(2)
    tree.insert(seq(1, 2, bs=2), [10, 12])
    tree.insert(seq(1, 4, bs=2), [10, 14])
    tree.check_invariants()
    corrupt(tree)  # type: ignore[operator]
    with pytest.raises(TreeInvariantError, match=fragment):
        tree.check_invariants()


def test_tree_modules_do_not_import_torch() -> None:
    package = Path(__file__).resolve().parents[1] / "radixkv" / "tree"
    allowed_local = {
        "radixkv.tree.node",
        "radixkv.tree.check",
        "radixkv.tree.radix_tree",
        "radixkv.tree.listener",
    }
    modules = sorted(package.glob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "node.py", "check.py", "radix_tree.py"}
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] != "torch", f"{path.name} imports {name}"
                if name.startswith("radixkv"):
                    assert name in allowed_local, f"{path.name} imports {name}"


def test_docstring_examples_run() -> None:
    failures, tried = doctest.testmod(tree_module)
    assert tried > 0 and failures == 0
