"""Hypothesis state machine over ``RadixTree``: random match/insert/pin/unpin/evict/clear sequences.

A 2-token vocabulary makes prefixes collide, so edges split in their middle. Random queries
mostly miss once the tree is deep, so ``*_known`` rules re-use a cut of an inserted sequence
plus a new tail: matches then end inside (pinned) edges and split them, pins land on inner
nodes, and inserts extend cached paths. ``clear`` runs only while pins are held (the case it
must get right; eviction already empties the tree otherwise). After every step the tree
recounts itself (``check_invariants``) and must hold exactly the prefixes the brute-force
model says, with every block id either free or in the tree.

Tiers: ``demote`` moves the LRU device candidate to host ids (numbered from ``HOST_BASE``, so
the model keeps one id space), ``evict_host`` drops host leaves, and an insert below a
demoted prefix goes to the host tier (a device insert there is refused).
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.tree import HOST, MatchResult, RadixTree, TierOrderError
from tests.test_tree_stress import ReferenceCache, tree_contents

NUM_BLOCKS = 24
HOST_BASE, NUM_HOST = 1000, 12  # host ids: another pool, numbered apart for the model
tokens_st = st.lists(st.integers(0, 1), max_size=14)
namespace_st = st.sampled_from([None, "tenant"])


class TreeMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.free = list(range(NUM_BLOCKS))
        self.host_free = list(range(HOST_BASE, HOST_BASE + NUM_HOST))
        self.results: list[tuple[MatchResult, list[int], Hashable]] = []  # earlier matches
        self.pins: list[tuple[MatchResult, list[int], Hashable]] = []  # pins held
        self.inserted: list[tuple[list[int], Hashable]] = []  # recent inserts, for *_known rules

    @initialize(block_size=st.sampled_from([1, 2, 4]))
    def setup(self, block_size: int) -> None:
        self.tree = RadixTree(block_size)
        self.model = ReferenceCache(block_size)

    def _release(self, freed: list[int], host: bool = False) -> None:
        self.model.remove(freed)
        free = self.host_free if host else self.free
        assert not set(freed) & set(free), "double free"
        free += freed

    def _known(self, data: st.DataObject) -> tuple[list[int], Hashable]:
        """A cut of a recently inserted sequence plus a fresh tail, in its namespace."""
        tokens, namespace = data.draw(st.sampled_from(self.inserted))
        cut = len(tokens) - data.draw(st.integers(0, len(tokens)))  # hypothesis favours small draws
        return tokens[:cut] + data.draw(st.lists(st.integers(0, 1), max_size=6)), namespace

    @precondition(lambda self: self.inserted)
    @rule(data=st.data(), pin=st.booleans())
    def match_known(self, data: st.DataObject, pin: bool) -> None:
        self.match(*self._known(data))
        if pin:
            self._pin(self.results[-1])

    @precondition(lambda self: self.inserted)
    @rule(data=st.data())
    def insert_known(self, data: st.DataObject) -> None:
        self.insert(*self._known(data))

    @rule(tokens=tokens_st, namespace=namespace_st)
    def match(self, tokens: list[int], namespace: Hashable) -> None:
        result = self.tree.match(tokens, namespace)
        assert list(result.block_ids) == self.model.longest(tokens, namespace)
        assert result.num_tokens == len(result.block_ids) * self.tree.block_size
        self.results = [*self.results[-5:], (result, tokens, namespace)]

    @precondition(lambda self: self.results)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        self._pin(data.draw(st.sampled_from(self.results)))

    def _pin(self, entry: tuple[MatchResult, list[int], Hashable]) -> None:
        result, tokens, namespace = entry
        if not result.node.attached:  # evicted (or its empty namespace dropped) since
            with pytest.raises(ValueError, match="no longer in the tree"):
                self.tree.pin(result.node)
            return
        self.tree.pin(result.node)
        self.model.pin(tokens, namespace, len(result.block_ids), +1)
        self.pins.append(entry)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        entry = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        result, tokens, namespace = entry
        self.tree.unpin(result.node)
        self.model.pin(tokens, namespace, len(result.block_ids), -1)

    @rule(tokens=tokens_st, namespace=namespace_st)
    def insert(self, tokens: list[int], namespace: Hashable) -> None:
        need = len(tokens) // self.tree.block_size
        if need > len(self.free):
            self.evict(need - len(self.free))
        if need > len(self.free):
            return
        ids, self.free = self.free[len(self.free) - need :], self.free[: len(self.free) - need]
        free = self.free
        try:
            cached = self.tree.insert(tokens, ids, namespace)
        except TierOrderError:  # the path it extends was demoted: its new blocks go to the host
            self.free += ids
            if need > len(self.host_free):
                return
            free = self.host_free
            ids, self.host_free[:] = (
                self.host_free[len(self.host_free) - need :],
                self.host_free[: len(self.host_free) - need],
            )
            cached = self.tree.insert(tokens, ids, namespace, tier=HOST)
        assert cached == self.model.insert(tokens, ids, namespace)
        if need:
            self.inserted = [*self.inserted[-7:], (tokens, namespace)]
        free += ids[: cached // self.tree.block_size]  # our duplicates

    @rule()
    def demote(self) -> None:
        node = self.tree.demotion_candidate()
        if node is None or len(node.block_ids) > len(self.host_free):
            return
        n = len(node.block_ids)
        host_ids, self.host_free[:] = (
            self.host_free[len(self.host_free) - n :],
            self.host_free[: len(self.host_free) - n],
        )
        old = self.tree.demote(node, host_ids)
        for device_id, host_id in zip(old, host_ids):  # same prefixes, now in host blocks
            key = self.model.key_of.pop(device_id)
            self.model.blocks[key], self.model.key_of[host_id] = host_id, key
        self.free += old

    @rule(num_blocks=st.integers(0, 8))
    def evict_host(self, num_blocks: int) -> None:
        self._release(self.tree.evict_host(num_blocks), host=True)

    @precondition(lambda self: self.inserted and self.model.key_of)
    @rule(data=st.data())
    def insert_owned_id(self, data: st.DataObject) -> None:
        """An id the tree already owns, where the tree would take it: refused, nothing changes."""
        tokens, namespace = self._known(data)
        need = len(tokens) // self.tree.block_size
        if need <= len(self.model.longest(tokens, namespace)):
            return  # nothing new: the ids are not looked at
        owned = sorted(b for b in self.model.key_of if b < HOST_BASE)  # device ids
        if not owned:
            return
        ids = list(range(NUM_BLOCKS, NUM_BLOCKS + need))  # ids the model never hands out
        ids[-1] = data.draw(st.sampled_from(owned))
        with pytest.raises(ValueError, match="already in the tree|under host-resident"):
            self.tree.insert(tokens, ids, namespace)

    @rule(num_blocks=st.integers(0, 8))
    def evict(self, num_blocks: int) -> None:
        evictable = self.tree.num_evictable_blocks
        freed = self.tree.evict(num_blocks)
        if not self.tree.num_host_blocks:  # else host nodes and their parents wait for evict_host
            assert len(freed) >= min(num_blocks, evictable)
        self._release(freed)

    @precondition(lambda self: self.pins)
    @rule()
    def clear(self) -> None:
        freed, host = self.tree.clear_tiers()
        assert self.tree.num_evictable_blocks == 0
        self._release(host, host=True)  # host nodes hang below device ones: the model drops them first
        self._release(freed)

    @invariant()
    def consistent(self) -> None:
        self.tree.check_invariants()
        assert tree_contents(self.tree) == self.model.blocks
        assert self.tree.num_pinned_blocks == len(self.model.pins)
        every_id = list(range(NUM_BLOCKS)) + list(range(HOST_BASE, HOST_BASE + NUM_HOST))
        assert sorted(self.free + self.host_free + list(self.model.key_of)) == every_id

    def teardown(self) -> None:
        for result, _, _ in self.pins:
            self.tree.unpin(result.node)
        self.tree.clear_tiers()
        assert self.tree.num_cached_blocks == 0 and self.tree.num_nodes == 0


TreeMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tree_state_machine = TreeMachine.TestCase
