"""Hypothesis state machine over a KVStore with a tiny device pool and a host tier.

Random commits (which demote and drop host leaves), held and released leases, batched reads,
task pins, unpins, flushes, saves and restores (merging a file into the live store). After every step: the store's full recount of both tiers
(``check_invariants``), per-tier block accounting, every pinned task prompt a full match,
and every read equal to the KV that was committed for those tokens (``kv_for`` is a function
of token and position, so a block served from the wrong tier or slot shows).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv import BlockPool, KVStore, Lease
from radixkv.persist.cache_file import read_manifest
from radixkv.store.tier import host_pool_for
from tests.test_store import BS, SPECS, kv_for

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class TieredStoreMachine(RuleBasedStateMachine):
    @initialize(device_blocks=st.integers(2, 4), host_blocks=st.integers(2, 10))
    def setup(self, device_blocks: int, host_blocks: int) -> None:
        device = BlockPool(SPECS, device_blocks, BS)
        self.store = KVStore(device, host_pool_for(device, tokens=host_blocks * BS))
        self.held: list[tuple[Lease, list[int]]] = []
        self.tasks: dict[str, list[int]] = {}
        self.seen: list[list[int]] = []
        self.dir = tempfile.mkdtemp(prefix="radixkv-stateful-")
        self.path = os.path.join(self.dir, "kv.safetensors")
        self.saved = False

    def _tokens(self, data: st.DataObject) -> list[int]:
        if self.seen and data.draw(st.booleans()):  # extend or cut a committed sequence
            base = data.draw(st.sampled_from(self.seen))
            cut = len(base) - data.draw(st.integers(0, len(base)))  # hypothesis favours small draws
            return base[:cut] + data.draw(st.lists(st.integers(0, 2), max_size=6))
        return data.draw(tokens_st)

    @rule(data=st.data(), reread_oldest=st.booleans())
    def commit(self, data: st.DataObject, reread_oldest: bool) -> None:
        tokens = self._tokens(data)
        self.store.commit(tokens, *kv_for(tokens))
        self.seen = [*self.seen[-7:], tokens]
        if reread_oldest:  # the least recent sequence: the one most likely demoted by now
            self._check_read(self.seen[0])

    def _check_read(self, row: list[int]) -> None:
        with self.store.acquire(row) as lease:
            n = lease.num_tokens
            if n:
                ks = [torch.empty(1, s.num_kv_heads, n, s.k_head_dim) for s in SPECS]
                vs = [torch.empty(1, s.num_kv_heads, n, s.v_head_dim) for s in SPECS]
                self.store.read([lease], n, ks, vs)
                want_k, want_v = kv_for(row)
                assert all(torch.equal(a, b[:, :, :n]) for a, b in zip(ks + vs, want_k + want_v))

    @rule(data=st.data(), keep=st.booleans())
    def acquire_and_read(self, data: st.DataObject, keep: bool) -> None:
        rows = [self._tokens(data) for _ in range(data.draw(st.integers(1, 3)))]
        leases = [self.store.acquire(r) for r in rows]
        n = min(lease.num_tokens for lease in leases)
        if n:
            ks = [torch.empty(len(rows), s.num_kv_heads, n, s.k_head_dim) for s in SPECS]
            vs = [torch.empty(len(rows), s.num_kv_heads, n, s.v_head_dim) for s in SPECS]
            self.store.read(leases, n, ks, vs)
            for i, row in enumerate(rows):
                want_k, want_v = kv_for(row)
                assert all(torch.equal(a[i], b[0, :, :n]) for a, b in zip(ks + vs, want_k + want_v))
        for lease, row in zip(leases, rows):
            if keep and len(self.held) < 4:
                self.held.append((lease, row))
            else:
                lease.release()

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def read_seen(self, data: st.DataObject) -> None:
        """Re-read a committed sequence: after a few commits its blocks are on the host."""
        self._check_read(data.draw(st.sampled_from(self.seen)))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease, row = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        if lease.active and lease.num_tokens:  # a held lease still reads right after demotions
            n = lease.num_tokens
            ks = [torch.empty(1, s.num_kv_heads, n, s.k_head_dim) for s in SPECS]
            vs = [torch.empty(1, s.num_kv_heads, n, s.v_head_dim) for s in SPECS]
            self.store.read([lease], n, ks, vs)
            want_k, want_v = kv_for(row)
            assert all(torch.equal(a, b[:, :, :n]) for a, b in zip(ks + vs, want_k + want_v))
        lease.release()

    @rule(name=st.sampled_from(["a", "b"]), data=st.data())
    def pin_task(self, name: str, data: st.DataObject) -> None:
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=BS, max_size=3 * BS))
        try:
            self.store.tasks.pin(name, tokens, *kv_for(tokens))
        except ValueError as exc:  # too big beside the other task / held leases
            assert "device pool has only" in str(exc)
            return
        except RuntimeError as exc:
            assert "could be cached" in str(exc)
            return
        self.tasks[name] = tokens[: len(tokens) // BS * BS]

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def unpin_task(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.tasks)))
        self.store.tasks.unpin(name)
        del self.tasks[name]

    @rule(really=st.integers(0, 3))
    def flush(self, really: int) -> None:
        if really:  # rarely: a flush empties both tiers, and the rest needs them full
            return
        self.store.flush()
        self.tasks.clear()

    @rule()
    def save(self) -> None:
        """Write both tiers' blocks (held leases and task pins stay as they are)."""
        result = self.store.save(self.path)
        assert result.num_blocks == read_manifest(self.path)["counts"]["blocks"]
        self.saved = True

    @precondition(lambda self: self.saved)
    @rule()
    def restore(self) -> None:
        """Merge the last file into the live store: every saved block counted once, exactly
        the restored ones added, and every sequence still reads its own KV (read_seen)."""
        tree = self.store.tree
        before, total = tree.num_cached_blocks, read_manifest(self.path)["counts"]["blocks"]
        result = self.store.restore(self.path)
        assert result.restored_tokens + result.duplicate_tokens + result.dropped_tokens == total * BS
        assert tree.num_cached_blocks - before == result.restored_blocks
        for row in self.seen:
            self._check_read(row)

    @invariant()
    def consistent(self) -> None:
        store = self.store
        store.check_invariants()
        stats = store.stats()
        assert stats["free_blocks"] + stats["cached_blocks"] + stats["retired_blocks"] == stats["num_blocks"]
        assert (
            stats["host_free_blocks"] + stats["host_cached_blocks"] + stats["host_retired_blocks"]
            == stats["host_num_blocks"]
        )
        assert sorted(store.tasks.ids()) == sorted(self.tasks)
        for tokens in self.tasks.values():
            match = store.tree.match(tokens, None)
            assert match.num_tokens == len(tokens)

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        for lease, _ in self.held:
            lease.release()
        for name in list(self.tasks):
            self.store.tasks.unpin(name)
        self.store.check_invariants()
        stats = self.store.stats()
        assert stats["pinned_blocks"] == stats["host_pinned_blocks"] == 0


TieredStoreMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tiered_store_state_machine = TieredStoreMachine.TestCase
