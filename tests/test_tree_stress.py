"""Seeded random stress of ``RadixTree`` against a brute-force model, single- and multi-threaded.

Threads share one tree behind one ``threading.Lock`` (the tree itself is not thread-safe;
the store wraps it the same way). After every locked step the tree's own
``check_invariants()`` runs and the tree is compared with the model: every cached prefix
and its block id, pins, counters, and the accounting of every block id (free list, tree,
held by a request between allocation and insert) with no id lost or freed twice.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from radixkv.tree import MatchResult, RadixTree

Key = tuple[Hashable, tuple[int, ...]]  # (namespace, whole-block prefix)


class ReferenceCache:
    """Brute-force model: every cached whole-block prefix -> the id of the block ending it."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.blocks: dict[Key, int] = {}
        self.key_of: dict[int, Key] = {}
        self.pins: Counter[Key] = Counter()

    def keys(self, tokens: Sequence[int], namespace: Hashable) -> list[Key]:
        return [(namespace, tuple(tokens[:end])) for end in range(self.bs, len(tokens) + 1, self.bs)]

    def longest(self, tokens: Sequence[int], namespace: Hashable) -> list[int]:
        """Block ids of the longest cached whole-block prefix."""
        ids = []
        for key in self.keys(tokens, namespace):
            if key not in self.blocks:
                break
            ids.append(self.blocks[key])
        return ids

    def insert(self, tokens: Sequence[int], block_ids: Sequence[int], namespace: Hashable) -> int:
        keys = self.keys(tokens, namespace)
        cached = len(self.longest(tokens, namespace))
        for key, block in zip(keys[cached:], block_ids[cached:]):
            assert block not in self.key_of, f"block {block} inserted twice"
            self.blocks[key], self.key_of[block] = block, key
        return cached * self.bs

    def pin(self, tokens: Sequence[int], namespace: Hashable, num_blocks: int, delta: int) -> None:
        for key in self.keys(tokens, namespace)[:num_blocks]:
            self.pins[key] += delta
            assert self.pins[key] >= 0
            if not self.pins[key]:
                del self.pins[key]

    def remove(self, freed: Sequence[int]) -> None:
        """Drop freed blocks; they must be cached, unpinned, and leave the cache prefix-closed."""
        for block in freed:
            assert block in self.key_of, f"freed block {block} is not cached (double free?)"
            key = self.key_of.pop(block)
            assert not self.pins[key], f"pinned block {block} was freed"
            del self.blocks[key]
        for namespace, prefix in self.blocks:
            if len(prefix) > self.bs:
                assert (namespace, prefix[: -self.bs]) in self.blocks, "eviction left a prefix gap"

    @property
    def num_evictable(self) -> int:
        return len(self.blocks) - len(self.pins)


def tree_contents(tree: RadixTree) -> dict[Key, int]:
    """The tree's cached prefixes, rebuilt by walking each node up to its namespace root."""
    contents: dict[Key, int] = {}
    for node in tree.iter_nodes():
        path, root = [], node
        while root.parent is not None:
            path.append(root)
            root = root.parent
        tokens = [t for n in reversed(path) for t in n.tokens]
        start = len(tokens) - node.num_tokens
        for i, block in enumerate(node.block_ids):
            contents[(root.key, tuple(tokens[: start + (i + 1) * tree.block_size]))] = block
    return contents


class Harness:
    """One tree, its model, a free list and a lock shared by the worker threads."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.tree = RadixTree(block_size)
        self.model = ReferenceCache(block_size)
        self.num_blocks = num_blocks
        self.free = list(range(num_blocks))
        self.held: dict[int, list[int]] = {}  # worker -> ids allocated, not yet inserted or freed
        self.lock = threading.Lock()
        self.steps = 0
        self.interleaved = 0  # requests during which another worker changed the tree

    # -- checks, called with the lock held --------------------------------------------

    def verify(self) -> None:
        self.steps += 1
        tree, model = self.tree, self.model
        tree.check_invariants()
        assert tree_contents(tree) == model.blocks
        assert tree.num_cached_blocks == len(model.blocks)
        assert tree.num_pinned_blocks == len(model.pins)
        held = [b for ids in self.held.values() for b in ids]
        everything = self.free + list(model.key_of) + held
        assert len(everything) == len(set(everything)) == self.num_blocks, "a block id is lost or duplicated"

    def give_back(self, ids: Sequence[int]) -> None:
        assert not set(ids) & set(self.free), f"double free of {set(ids) & set(self.free)}"
        self.free += ids

    # -- operations, called with the lock held ----------------------------------------

    def match(self, tokens: list[int], namespace: Hashable) -> MatchResult:
        result = self.tree.match(tokens, namespace)
        assert list(result.block_ids) == self.model.longest(tokens, namespace)
        assert result.num_tokens == len(result.block_ids) * self.tree.block_size
        return result

    def evict(self, num_blocks: int) -> list[int]:
        evictable = self.model.num_evictable
        assert self.tree.num_evictable_blocks == evictable
        freed = self.tree.evict(num_blocks)
        assert len(freed) >= min(num_blocks, evictable)
        if len(freed) < num_blocks:
            assert self.tree.num_evictable_blocks == 0
        self.model.remove(freed)
        self.give_back(freed)
        return freed

    def clear(self) -> None:
        evictable = self.model.num_evictable
        freed = self.tree.clear()
        assert len(freed) == evictable and self.tree.num_evictable_blocks == 0
        self.model.remove(freed)
        self.give_back(freed)


def random_prompt(rng: random.Random, bs: int) -> list[int]:
    """A shared 'system prompt' (tokens 0..2) plus a short tail from a 2-token vocabulary,
    so prefixes collide often and edges split in their middle."""
    system = [[], [0] * bs, [1, 2] * bs, [2] * (3 * bs)][rng.randrange(4)]
    return system + [rng.randrange(2) for _ in range(rng.randrange(5 * bs))]


def worker(h: Harness, seed: int, wid: int, steps: int, bs: int) -> None:
    """One request at a time: match+pin, allocate, insert (each a separate locked step), unpin."""
    rng = random.Random(seed)
    for _ in range(steps):
        tokens, namespace = random_prompt(rng, bs), rng.choice([None, "tenant"])
        roll = rng.random()
        with h.lock:
            if roll < 0.05:
                h.clear()
                h.verify()
                continue
            if roll < 0.15:
                h.evict(rng.randrange(6))
                h.verify()
                continue
            result = h.match(tokens, namespace)
            h.tree.pin(result.node)
            h.model.pin(tokens, namespace, len(result.block_ids), +1)
            h.verify()
            matched_at = h.steps
        time.sleep(0)  # let other workers in between our steps
        full = tokens + [rng.randrange(2) for _ in range(rng.randrange(3 * bs))]  # prompt + reply
        have = len(result.block_ids)
        need = len(full) // bs - have
        with h.lock:
            if need > len(h.free):
                h.evict(need - len(h.free))
            h.held[wid] = ids = h.free[-need:] if need and need <= len(h.free) else []
            del h.free[len(h.free) - len(ids) :]
            h.verify()
        time.sleep(0)
        with h.lock:
            h.interleaved += h.steps != matched_at + 1
            if len(ids) == need:
                block_ids = list(result.block_ids) + ids
                cached = h.tree.insert(full, block_ids, namespace)
                assert cached == h.model.insert(full, block_ids, namespace)
                assert cached >= result.num_tokens  # our prefix was pinned
                del h.held[wid]
                h.give_back(ids[: cached // bs - have])  # another worker inserted them first
            else:
                h.give_back(h.held.pop(wid))
            h.tree.unpin(result.node)
            h.model.pin(tokens, namespace, have, -1)
            h.verify()


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stress_single_thread(bs: int, seed: int) -> None:
    h = Harness(bs, num_blocks=40 if bs == 4 else 120)
    worker(h, seed, wid=0, steps=700, bs=bs)
    assert h.steps > 1500
    h.clear()
    h.verify()
    assert h.tree.num_cached_blocks == 0 and sorted(h.free) == list(range(h.num_blocks))


@pytest.mark.parametrize("bs", [1, 4])
def test_stress_threads_share_one_locked_tree(bs: int) -> None:
    h = Harness(bs, num_blocks=48 if bs == 4 else 150)
    num_threads = 4
    with ThreadPoolExecutor(num_threads) as pool:
        futures = [pool.submit(worker, h, 100 + wid, wid, 500, bs) for wid in range(num_threads)]
        for future in futures:
            future.result()  # re-raises a worker's assertion
    assert not h.held and h.tree.num_pinned_blocks == 0
    assert h.interleaved > 50, "workers never overlapped: the lock was not exercised"
    h.clear()
    h.verify()
    assert sorted(h.free) == list(range(h.num_blocks))
