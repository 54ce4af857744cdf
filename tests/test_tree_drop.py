"""Dropping whole namespaces (an unloaded adapter's prefixes): ``RadixTree.drop`` against a plain
model of what must stay, with the invariant checker after every step, and ``KVStore.drop`` on
both tiers."""

from __future__ import annotations

import random

import pytest

from radixkv import BlockPool, KVStore, RadixTree, host_pool_for
from tests.test_store import BS, SPECS, kv_for


def _paths(rng: random.Random, bs: int) -> list[list[int]]:
    """Sequences sharing prefixes: a few stems, each extended a few ways (whole blocks)."""
    out = []
    for stem in range(3):
        head = [stem * 100 + t for t in range(bs * rng.randint(1, 3))]
        for branch in range(rng.randint(1, 3)):
            out.append(head + [stem * 100 + 50 + branch * 7 + t for t in range(bs * rng.randint(1, 2))])
    return out


@pytest.mark.parametrize("seed", range(12))
def test_drop_removes_exactly_the_unpinned_nodes_of_the_chosen_namespaces(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 4])
    tree = RadixTree(bs)
    namespaces = ["base", ("adapter", "a"), ("adapter", "b")]
    contents: dict[object, list[list[int]]] = {}
    next_id = 0
    for ns in namespaces:
        contents[ns] = _paths(rng, bs)
        for tokens in contents[ns]:
            cached = tree.match(tokens, ns).num_tokens
            need = (len(tokens) - cached) // bs
            tree.insert(tokens, [*tree.match(tokens, ns).block_ids, *range(next_id, next_id + need)], ns)
            next_id += need
    tree.check_invariants()
    # Pin one path of adapter a (a request still running under it).
    pinned_tokens = rng.choice(contents[("adapter", "a")])
    pinned = tree.match(pinned_tokens, ("adapter", "a"))
    tree.pin(pinned.node)
    before = {ns: [tree.match(t, ns).num_tokens for t in contents[ns]] for ns in namespaces}
    cached_before = tree.num_cached_blocks

    device, host = tree.drop(lambda ns: isinstance(ns, tuple))
    tree.check_invariants()
    assert host == []
    assert len(device) == len(set(device)) and cached_before - tree.num_cached_blocks == len(device)
    assert [tree.match(t, "base").num_tokens for t in contents["base"]] == before["base"]  # untouched
    assert all(tree.match(t, ("adapter", "b")).num_tokens == 0 for t in contents[("adapter", "b")])
    # Of adapter a only the pinned path is left: each path keeps what it shares with it.
    for tokens in contents[("adapter", "a")]:
        common = 0
        while common < min(len(tokens), pinned.num_tokens) and tokens[common] == pinned_tokens[common]:
            common += 1
        assert tree.match(tokens, ("adapter", "a")).num_tokens == common - common % bs
    tree.unpin(pinned.node)
    tree.check_invariants()
    tree.evict(tree.num_cached_blocks)  # the survivor is an ordinary LRU candidate again
    assert tree.num_cached_blocks == 0
    tree.check_invariants()


def test_store_drop_frees_both_tiers_and_keeps_other_namespaces() -> None:
    device = BlockPool(SPECS, 4, BS)
    store = KVStore(device, host_pool_for(device, tokens=12 * BS))
    prompts = {ns: [[ns * 10 + p] * 8 + [99] for p in range(3)] for ns in (1, 2)}
    for ns, rows in prompts.items():
        for tokens in rows:
            store.commit(tokens, *kv_for(tokens), namespace=ns)
    stats = store.stats()
    assert stats["host_cached_blocks"] > 0  # some of the dropped namespace's blocks are on the host
    freed = store.drop(lambda ns: ns == 1)
    store.check_invariants()
    after = store.stats()
    assert freed == 6  # 3 prompts x 2 blocks, wherever they lived
    assert (
        after["free_blocks"] + after["host_free_blocks"]
        == stats["free_blocks"] + stats["host_free_blocks"] + 6
    )
    for tokens in prompts[1]:
        with store.acquire(tokens, namespace=1) as lease:
            assert lease.num_tokens == 0
    for tokens in prompts[2]:
        with store.acquire(tokens, namespace=2) as lease:
            assert lease.num_tokens == 8
    assert store.drop(lambda ns: False) == 0
