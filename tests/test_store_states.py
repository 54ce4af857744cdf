"""KVStore with a state pool: recurrent-state snapshots at tree nodes (radixkv.store.state_pool).

A match is usable up to its deepest snapshot; snapshots have a budget and an LRU order of their
own (state pressure never evicts KV); they move to the host with their nodes, and every removal
frees them. A seeded random run is checked against a brute-force model of what is cached.
"""

from __future__ import annotations

import random

import pytest
import torch

from radixkv import BlockPool, KVStore, LayerSpec, RadixTree, StatePool, StateSpec, host_pool_for
from radixkv.store.state_pool import OutOfSlots, host_states_for

BS = 4
LAYER = LayerSpec(num_kv_heads=1, k_head_dim=2, v_head_dim=2, dtype=torch.float32, device="cpu")
SPECS = (
    StateSpec((3, 2), torch.float32, "cpu"),  # a conv state
    StateSpec((2, 2, 2), torch.float32, "cpu"),  # a recurrent state
)


def kv_of(tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """KV whose every entry names its token and position: a wrong block shows."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    k = torch.stack([t, pos], dim=-1).view(1, 1, len(tokens), 2)
    return [k], [k + 0.5]


def state_of(tokens: list[int]) -> list[torch.Tensor]:
    """A state that depends on the whole prefix (and its length), as a recurrent state does."""
    h = float(sum((i + 1) * t for i, t in enumerate(tokens)) % 9973) + len(tokens) / 1000
    return [torch.full(s.shape, h) + torch.arange(torch.Size(s.shape).numel()).view(s.shape) for s in SPECS]


def store_with(
    num_blocks: int = 64, num_slots: int = 8, host_blocks: int = 0, host_slots: int = 0
) -> KVStore:
    pool = BlockPool([LAYER], num_blocks, BS)
    states = StatePool(SPECS, num_slots)
    host = host_pool_for(pool, tokens=host_blocks * BS) if host_blocks else None
    host_states = host_states_for(states, host_slots * states.slot_bytes) if host_slots else None
    return KVStore(pool, host, states=states, host_states=host_states)


def commit(store: KVStore, tokens: list[int], positions, ns=None) -> int:
    k, v = kv_of(tokens)
    return store.commit(tokens, k, v, ns, snapshots={p: state_of(tokens[:p]) for p in positions})


def served(store: KVStore, tokens: list[int], ns=None) -> int:
    """Tokens served for ``tokens``, after checking the KV and the snapshot read are right."""
    with store.acquire(tokens, ns) as lease:
        n = lease.num_tokens
        if n:
            k = torch.empty(1, 1, n, 2)
            v = torch.empty(1, 1, n, 2)
            store.read([lease], n, [k], [v])
            want_k, want_v = kv_of(tokens[:n])
            assert torch.equal(k, want_k[0]) and torch.equal(v, want_v[0])
        out = [torch.empty(s.shape) for s in SPECS]
        assert store.read_state(lease, out) == (n > 0)
        if n:
            for got, want in zip(out, state_of(tokens[:n])):
                assert torch.equal(got, want)
    store.check_invariants()
    return n


def test_a_match_stops_at_the_deepest_snapshot_and_reports_the_junction():
    store = store_with()
    doc = list(range(10, 34))  # 24 tokens = 6 blocks
    commit(store, doc + [1, 2, 3, 4], positions=[8, 16, 28])
    question = doc + [7, 7, 7, 7, 7]
    with store.acquire(question) as lease:
        assert (lease.num_tokens, lease.kv_tokens) == (16, 24)  # KV to 24, snapshots at 8 and 16
    assert served(store, question) == 16
    # The junction's snapshot, taken by the request that computed past it, makes it all usable.
    commit(store, question, positions=[24])
    assert served(store, doc + [9, 9, 9, 9, 9]) == 24
    assert served(store, doc + [1, 2, 3, 4, 5]) == 28
    assert store.stats()["junction_tokens"] == 16  # two lookups stopped 8 tokens short


def test_nothing_usable_without_a_snapshot_and_kv_past_the_deepest_is_not_cached():
    store = store_with()
    tokens = list(range(3, 23))
    assert commit(store, tokens, positions=[]) == 0
    assert store.stats()["cached_blocks"] == 0
    assert commit(store, tokens, positions=[8]) == 8  # KV to 8 only: nothing past it could serve
    assert store.stats()["cached_blocks"] == 2
    assert served(store, tokens) == 8


def test_bad_snapshot_positions_and_shapes_are_refused_caching_nothing():
    store = store_with()
    tokens = list(range(3, 23))
    k, v = kv_of(tokens)
    for pos in (0, 6, 24, -4, 8.0, True):
        with pytest.raises(ValueError, match="snapshot position"):
            store.commit(tokens, k, v, snapshots={pos: state_of(tokens[:8])})
    with pytest.raises(ValueError, match="shape"):
        store.commit(tokens, k, v, snapshots={8: [torch.zeros(3, 2), torch.zeros(2, 2)]})
    plain = KVStore(BlockPool([LAYER], 8, BS))
    with pytest.raises(ValueError, match="without a state pool"):
        plain.commit(tokens, k, v, snapshots={8: state_of(tokens[:8])})
    assert store.stats()["cached_blocks"] == 0
    store.check_invariants()


def test_state_pressure_evicts_snapshots_lru_never_kv():
    store = store_with(num_blocks=64, num_slots=2)
    a, b, c = ([t] * 8 for t in (3, 4, 5))
    commit(store, a, positions=[8])
    commit(store, b, positions=[8])
    assert served(store, a + [9]) == 8  # a is now more recent than b
    commit(store, c, positions=[8])  # takes b's slot (least recently used)
    stats = store.stats()
    assert stats["evicted_snapshots"] == 1 and stats["snapshots"] == 2
    assert stats["cached_blocks"] == 6  # b's KV stayed
    assert served(store, b + [1]) == 0 and served(store, a + [1]) == 8 and served(store, c + [1]) == 8


def test_a_pinned_snapshot_is_never_evicted_and_a_full_pool_skips_the_new_one():
    store = store_with(num_slots=1)
    a, b = [3] * 8, [4] * 8
    commit(store, a, positions=[8])
    with store.acquire(a + [1]) as lease:
        assert lease.num_tokens == 8
        commit(store, b, positions=[8])
        assert store.stats()["uncached_snapshots"] == 1
        out = [torch.empty(s.shape) for s in SPECS]
        assert store.read_state(lease, out)
        assert all(torch.equal(x, y) for x, y in zip(out, state_of(a)))
    assert served(store, b + [1]) == 0
    store.check_invariants()


def test_eviction_drop_and_flush_free_the_snapshots_of_what_they_remove():
    store = store_with(num_blocks=3, num_slots=8)
    commit(store, [3] * 8, positions=[4, 8])
    commit(store, [4] * 8, positions=[8])  # evicts the LRU leaf, and with it its snapshot
    assert store.stats()["snapshots"] == 2
    store.check_invariants()
    commit(store, [5] * 4, positions=[4], ns="x")
    assert store.drop(lambda ns: ns == "x") == 1
    store.check_invariants()
    store.flush()
    assert store.stats()["free_state_slots"] == 8
    store.check_invariants()


def test_demotion_moves_the_snapshot_to_the_host_and_host_hits_read_it():
    store = store_with(num_blocks=3, num_slots=4, host_blocks=16, host_slots=4)
    a = [3] * 8
    commit(store, a, positions=[4, 8])
    commit(store, [4] * 8, positions=[8])  # demotes a's blocks (and snapshots) to the host
    stats = store.stats()
    assert stats["demoted_blocks"] >= 1 and stats["host_snapshots"] >= 1
    assert served(store, a + [1]) == 8
    store.check_invariants()


def test_a_full_host_state_pool_demotes_kv_without_its_snapshot():
    store = store_with(num_blocks=2, num_slots=4, host_blocks=16, host_slots=1)
    commit(store, [3] * 8, positions=[8])
    commit(store, [4] * 8, positions=[8])  # [3]*8 -> host with its snapshot (1 host slot)
    with store.acquire([3] * 8 + [1]) as lease:  # pins the host snapshot
        assert lease.num_tokens == 8
        commit(store, [5] * 8, positions=[8])  # [4]*8 -> host, its snapshot dropped
        store.check_invariants()
    assert served(store, [4] * 8 + [1]) == 0
    assert served(store, [3] * 8 + [1]) == 8


def test_a_pool_without_layers_serves_pure_recurrent_models():
    pool = BlockPool([], 32, BS)
    store = KVStore(pool, states=StatePool(SPECS, 4))
    tokens = list(range(3, 15))
    assert store.commit(tokens, [], [], snapshots={8: state_of(tokens[:8]), 12: state_of(tokens)}) == 12
    with store.acquire(tokens + [1]) as lease:
        out = [torch.empty(s.shape) for s in SPECS]
        assert lease.num_tokens == 12 and store.read_state(lease, out)
        assert all(torch.equal(x, y) for x, y in zip(out, state_of(tokens)))
    with pytest.raises(ValueError, match="tokens="):
        BlockPool.from_budget([], BS, bytes=1 << 20)
    store.check_invariants()


def test_state_pool_bookkeeping():
    pool = StatePool(SPECS, 3)
    a = pool.allocate(2)
    with pytest.raises(OutOfSlots):
        pool.allocate(2)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0], a[0]])
    pool.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])
    with pytest.raises(ValueError, match="not an int"):
        pool.free([3])
    pool.check_invariants()
    assert pool.num_free == 3 and pool.nbytes == 3 * (6 + 8) * 4
    with pytest.raises(ValueError, match="holds no snapshot"):
        StatePool.from_budget(SPECS, 10)


def test_tree_snapshots_follow_splits_pins_and_lru():
    tree = RadixTree(2, stateful=True)
    tree.insert([1, 2, 3, 4, 5, 6], [0, 1, 2])
    tree.set_snapshot(tree.node_at([1, 2, 3, 4, 5, 6]), 7)
    tree.set_snapshot(tree.node_at([1, 2]), 8)  # splits the edge: the deeper part keeps slot 7
    tree.check_invariants()
    r = tree.match([1, 2, 3, 4, 9, 9])
    assert (r.num_tokens, r.snap, r.kv_tokens) == (2, 8, 4)
    with tree.pinned(r.node):
        assert tree.evict_snapshots(5) == [7]  # slot 8 is pinned with its node
        tree.check_invariants()
    with pytest.raises(ValueError, match="already"):
        tree.set_snapshot(r.node, 9)
    with pytest.raises(ValueError, match="without recurrent state"):
        RadixTree(2).set_snapshot(r.node, 1)
    assert tree.evict(10) and sorted(tree.freed_snapshots) == [(0, 8)]
    tree.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_random_commits_and_lookups_serve_exactly_what_was_stored(seed):
    """Whatever is served is the KV and the snapshot of exactly that prefix; a commit that
    needed no eviction is served to its deepest snapshot at once; invariants hold throughout."""
    rng = random.Random(seed)
    tiered = seed % 2 == 1
    store = store_with(
        num_blocks=24, num_slots=5, host_blocks=12 if tiered else 0, host_slots=3 if tiered else 0
    )
    docs = [[rng.randrange(3, 9) for _ in range(rng.randrange(4, 28))] for _ in range(6)]
    for _ in range(120):
        tokens = rng.choice(docs) + [rng.randrange(3, 9) for _ in range(rng.randrange(0, 9))]
        whole = len(tokens) // BS * BS
        if rng.random() < 0.5 and whole:
            positions = sorted(rng.sample(range(BS, whole + 1, BS), rng.randrange(1, whole // BS + 1)))
            before = store.stats()
            commit(store, tokens, positions)
            after = store.stats()
            moved = [k for k in ("evicted_blocks", "demoted_blocks", "evicted_snapshots", "uncached_snapshots",
                                 "uncached_tokens") if after[k] != before[k]]  # fmt: skip
            if not moved:
                assert served(store, tokens + [1]) >= positions[-1]  # an earlier commit may reach deeper
        else:
            n = served(store, tokens)
            assert n % BS == 0 and n <= whole
        store.check_invariants()
