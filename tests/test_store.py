"""KVStore and BlockPool: sizing, copies, degradation, flush with live pins, threads."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from radixkv import BlockPool, KVStore, LayerSpec, OutOfBlocks

BS = 4
SPECS = (
    LayerSpec(2, 8, 8, torch.float32, torch.device("cpu")),
    LayerSpec(2, 8, 6, torch.float32, torch.device("cpu")),  # V head dim differs (MLA-like)
)


def kv_for(tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Deterministic KV per (position, token): lets a test check what a read returns."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 1000 + pos).view(1, 1, -1, 1)
    ks = [base.expand(1, s.num_kv_heads, -1, s.k_head_dim) + layer for layer, s in enumerate(SPECS)]
    vs = [-base.expand(1, s.num_kv_heads, -1, s.v_head_dim) - layer for layer, s in enumerate(SPECS)]
    return [k.contiguous() for k in ks], [v.contiguous() for v in vs]


def read_back(store: KVStore, tokens: list[int], num: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ks = [torch.empty(1, s.num_kv_heads, num, s.k_head_dim) for s in SPECS]
    vs = [torch.empty(1, s.num_kv_heads, num, s.v_head_dim) for s in SPECS]
    with store.acquire(tokens) as lease:
        assert lease.num_tokens >= num
        store.read([lease], num, ks, vs)
    return ks, vs


def make_store(num_blocks: int) -> KVStore:
    return KVStore(BlockPool(SPECS, num_blocks, BS))


def test_pool_budget_in_tokens_and_bytes_is_exact():
    per_token = sum(s.bytes_per_token for s in SPECS)
    assert per_token == 2 * (8 + 8) * 4 + 2 * (8 + 6) * 4
    by_tokens = BlockPool.from_budget(SPECS, BS, tokens=100)
    assert by_tokens.num_blocks == 25 and by_tokens.nbytes == 100 * per_token
    by_bytes = BlockPool.from_budget(SPECS, BS, bytes=10 * BS * per_token + 7)
    assert by_bytes.num_blocks == 10
    actual = sum(t.numel() * t.element_size() for t in by_bytes.k + by_bytes.v)
    assert actual == by_bytes.nbytes


@pytest.mark.parametrize(
    "kwargs, message",
    [({}, "exactly one"), ({"tokens": 1, "bytes": 1}, "exactly one"), ({"tokens": 2}, "too small")],
)
def test_pool_budget_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockPool.from_budget(SPECS, BS, **kwargs)


def test_pool_rejects_bad_block_size_and_reports_exhaustion():
    with pytest.raises(ValueError, match="power of two"):
        BlockPool(SPECS, 4, 3)
    pool = BlockPool(SPECS, 3, BS)
    ids = pool.allocate(2)
    assert ids == [0, 1]  # ascending runs: copies move one contiguous slice
    with pytest.raises(OutOfBlocks, match="2 blocks needed, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocate takes nothing
    pool.free(ids)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([0])
    pool.check_invariants()


def test_commit_then_read_returns_the_same_kv():
    store = make_store(16)
    tokens = list(range(10, 23))  # 13 tokens: 3 whole blocks
    ks, vs = kv_for(tokens)
    assert store.commit(tokens, ks, vs) == 12
    assert store.commit(tokens, ks, vs) == 0  # already cached
    got_k, got_v = read_back(store, tokens, 12)
    for a, b in zip(got_k + got_v, ks + vs):
        assert torch.equal(a, b[:, :, :12])
    stats = store.stats()
    assert stats["inserted_tokens"] == 12 and stats["hit_tokens"] == 12 and stats["cached_blocks"] == 3
    store.check_invariants()


def test_extension_copies_only_new_blocks_and_namespaces_do_not_share():
    store = make_store(16)
    first = list(range(8))
    store.commit(first, *kv_for(first))
    longer = first + [50, 51, 52, 53]
    assert store.commit(longer, *kv_for(longer)) == 4
    assert store.commit(longer, *kv_for(longer), namespace="tenant-b") == 12
    with store.acquire(longer, namespace="tenant-c") as lease:
        assert lease.num_tokens == 0
    assert store.stats()["cached_blocks"] == 6
    store.check_invariants()


def test_every_block_pinned_degrades_to_no_caching():
    store = make_store(2)
    a = [1] * 8
    store.commit(a, *kv_for(a))
    with store.acquire(a + [9]) as lease:  # pins both blocks
        assert lease.num_tokens == 8
        b = [2] * 8
        assert store.commit(b, *kv_for(b)) == 0
        assert store.stats()["uncached_tokens"] == 8
        store.check_invariants()
    assert store.commit(b, *kv_for(b)) == 8  # after release, LRU makes room
    assert store.stats()["evicted_blocks"] == 2
    store.check_invariants()


def test_sequence_longer_than_pool_caches_its_prefix():
    store = make_store(3)
    tokens = list(range(40))
    assert store.commit(tokens, *kv_for(tokens)) == 12
    got_k, _ = read_back(store, tokens, 12)
    assert torch.equal(got_k[0], kv_for(tokens)[0][0][:, :, :12])
    store.check_invariants()


def test_flush_keeps_pinned_blocks_until_released_and_drops_stale_commits():
    store = make_store(8)
    tokens = list(range(12))
    store.commit(tokens, *kv_for(tokens))
    lease = store.acquire(tokens + [99])
    epoch = lease.epoch
    store.flush()
    assert store.stats()["free_blocks"] == 5  # pinned blocks still held for the reader
    ks = [torch.empty(1, s.num_kv_heads, 12, s.k_head_dim) for s in SPECS]
    vs = [torch.empty(1, s.num_kv_heads, 12, s.v_head_dim) for s in SPECS]
    store.read([lease], 12, ks, vs)
    assert torch.equal(ks[1], kv_for(tokens)[0][1])
    store.check_invariants()
    lease.release()
    lease.release()  # idempotent
    assert store.stats()["free_blocks"] == 8
    assert store.commit(tokens, *kv_for(tokens), epoch=epoch) == 0  # computed before the flush
    with store.acquire(tokens) as fresh:
        assert fresh.num_tokens == 0
    store.check_invariants()


def test_read_checks_its_lease():
    store = make_store(4)
    tokens = list(range(8))
    store.commit(tokens, *kv_for(tokens))
    lease = store.acquire(tokens)
    out = [torch.empty(1, s.num_kv_heads, 8, s.k_head_dim) for s in SPECS]
    with pytest.raises(ValueError, match="holds 8 tokens, 12 requested"):
        store.read([lease], 12, out, out)
    lease.release()
    with pytest.raises(RuntimeError, match="released lease"):
        store.read([lease], 8, out, out)


def assert_kv_prefix(store: KVStore, tokens: list[int], max_tokens: int | None = None) -> None:
    """Whatever prefix of ``tokens[:max_tokens]`` is cached reads back as ``kv_for(tokens)``."""
    with store.acquire(tokens, max_tokens=max_tokens) as lease:
        n = lease.num_tokens
        if n:
            ks = [torch.empty(1, s.num_kv_heads, n, s.k_head_dim) for s in SPECS]
            vs = [torch.empty(1, s.num_kv_heads, n, s.v_head_dim) for s in SPECS]
            store.read([lease], n, ks, vs)
            want_k, want_v = kv_for(tokens)
            assert all(torch.equal(a, b[:, :, :n]) for a, b in zip(ks + vs, want_k + want_v))


def hammer(store: KVStore, num_prefixes: int, rounds: int, vocab: int) -> None:
    """4 threads of random requests (read + check, commit, rare flushes, full recounts) on
    ``store``; re-raises any thread's failure, then recounts."""
    prefixes = [[p] * 8 for p in range(num_prefixes)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(rounds):
                tokens = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
                assert_kv_prefix(store, tokens, max_tokens=len(tokens) - 1)
                store.commit(tokens, *kv_for(tokens))
                if rng.random() < 0.02:
                    store.flush()
                if rng.random() < 0.1:  # a full recount while the other threads are mid-request
                    store.check_invariants()
        except BaseException as exc:  # surfaced below: a thread's failure must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store.check_invariants()


def test_threads_share_one_store_consistently():
    store = make_store(24)
    hammer(store, num_prefixes=6, rounds=150, vocab=100)
    stats = store.stats()
    assert stats["pinned_blocks"] == 0 and stats["hit_tokens"] > 0
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]


# ---- bad input: a clear error, nothing cached, nothing leaked -----------------------------------


def test_pool_free_and_incref_check_ids_all_or_nothing():
    pool = BlockPool(SPECS, 4, BS)
    ids = pool.allocate(2)
    for bad in ([-1], [4], [ids[0], 99], [ids[0], 1.0]):
        with pytest.raises(ValueError, match=r"not an int in \[0, 4\)"):
            pool.free(bad)  # -1 used to index the refcounts from the end and join the free list
        with pytest.raises(ValueError, match=r"not an int in \[0, 4\)"):
            pool.incref(bad)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([ids[1], ids[0], ids[0]])  # refcount 1, freed twice in one call
    with pytest.raises(RuntimeError, match="incref of"):
        pool.incref([3])  # a free block
    assert pool.num_free == 2 and pool.used_blocks() == set(ids)
    pool.check_invariants()


def test_pool_check_invariants_catches_a_bad_free_list():
    pool = BlockPool(SPECS, 4, BS)
    pool._free.append(-1)
    with pytest.raises(AssertionError, match="out of range"):
        pool.check_invariants()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: BlockPool.from_budget(SPECS, 0, tokens=64), "power of two"),
        (lambda: BlockPool.from_budget(SPECS, BS, tokens=-8), "int >= 0"),
        (lambda: BlockPool.from_budget(SPECS, BS, tokens=64.0), "int >= 0"),
        (lambda: BlockPool(SPECS, True, BS), "num_blocks must be a positive int"),
        (lambda: LayerSpec(True, 8, 8, torch.float32, "cpu"), "num_kv_heads must be a positive int"),
        (lambda: LayerSpec(2, 8, 8, torch.int8, "cpu"), "dtype must be one of"),
        (lambda: BlockPool(SPECS, 4, BS).allocate(1.5), "int >= 0"),
    ],
)
def test_pool_configuration_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_commit_refuses_kv_that_does_not_cover_the_tokens():
    store = make_store(8)
    tokens = list(range(16))
    ks, vs = kv_for(tokens)
    short = [k[:, :, :8] for k in ks]  # used to cache blocks 2-3 with whatever the pool held
    cases = [(short, vs), (ks[:1], vs), (ks, vs + vs), ([k.expand(2, -1, -1, -1) for k in ks], vs)]
    for k_src, v_src in cases:
        with pytest.raises(ValueError, match="commit: "):
            store.commit(tokens, k_src, v_src)
    assert store.stats()["cached_blocks"] == 0 and store.stats()["free_blocks"] == 8
    store.check_invariants()


def test_a_commit_failing_to_make_room_leaves_nothing_pinned(monkeypatch):
    """Extending a cached prefix pins it for the copy; if making room for the new blocks fails
    (a demotion to a tier that raises, say), the pin goes with the error."""
    store = make_store(3)
    tokens = list(range(16))
    ks, vs = kv_for(tokens)
    assert store.commit(tokens[:8], [k[:, :, :8] for k in ks], [v[:, :, :8] for v in vs]) == 8

    def failing(*args, **kwargs):
        raise RuntimeError("making room failed (simulated)")

    monkeypatch.setattr(store, "_make_room_locked", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        store.commit(tokens, ks, vs)  # needs 2 more blocks, 1 is free
    monkeypatch.undo()
    assert store.stats()["pinned_blocks"] == 0 and store.stats()["cached_blocks"] == 2
    store.check_invariants()
    assert store.commit(tokens, ks, vs) == 4  # the one free block, as without the failure
    store.check_invariants()


def test_tensors_as_tokens_are_refused():
    store = make_store(8)
    tokens = list(range(8))
    store.commit(tokens, *kv_for(tokens))
    batch = torch.tensor([tokens])  # [1, n]: len() 1, so it used to match and cache nothing
    with pytest.raises(ValueError, match="tokens must be a sequence of ints"):
        store.acquire(batch)
    with pytest.raises(ValueError, match="tokens must be a sequence of ints"):
        store.commit(batch, *kv_for(tokens))
    assert store.stats()["pinned_blocks"] == 0
    store.check_invariants()


def test_read_refuses_a_lease_of_another_store():
    first, second = make_store(4), make_store(4)
    tokens = list(range(8))
    first.commit(tokens, *kv_for(tokens))
    out_k = [torch.empty(1, s.num_kv_heads, 8, s.k_head_dim) for s in SPECS]
    out_v = [torch.empty(1, s.num_kv_heads, 8, s.v_head_dim) for s in SPECS]
    with first.acquire(tokens) as lease, pytest.raises(ValueError, match="another KVStore"):
        second.read([lease], 8, out_k, out_v)  # its ids would index second's pool
    with first.acquire(tokens) as lease, pytest.raises(ValueError, match="the pool has 2 layers"):
        first.read([lease], 8, out_k[:1], out_v[:1])


def test_stats_account_for_blocks_kept_by_leases_across_a_flush():
    store = make_store(8)
    tokens = list(range(12))
    store.commit(tokens, *kv_for(tokens))
    with store.acquire(tokens):
        store.flush()
        stats = store.stats()
        assert (stats["free_blocks"], stats["cached_blocks"], stats["retired_blocks"]) == (5, 0, 3)
    stats = store.stats()
    assert (stats["free_blocks"], stats["retired_blocks"]) == (8, 0)


class _CountingLock:
    """The store's lock, counting threads that reached it (to line up a race deterministically)."""

    def __init__(self) -> None:
        self.lock, self.arrived = threading.Lock(), 0

    def __enter__(self):
        self.arrived += 1
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_two_threads_releasing_one_lease_unpin_it_once():
    store = make_store(4)
    tokens = list(range(8))
    store.commit(tokens, *kv_for(tokens))
    other, shared = store.acquire(tokens), store.acquire(tokens)  # two pins on one node
    store._lock = lock = _CountingLock()
    errors: list[BaseException] = []

    def release() -> None:
        try:
            shared.release()
        except BaseException as exc:
            errors.append(exc)

    with lock.lock:  # both threads get past `if active` before either may unpin
        threads = [threading.Thread(target=release) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while lock.arrived < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
    for t in threads:
        t.join()
    assert lock.arrived == 2, "a release did not take the store's lock"
    assert not errors, errors
    assert other._match.node.own_pins == 1  # the other lease's pin survived
    other.release()
    store.check_invariants()


def test_a_dropped_store_frees_its_pool_without_waiting_for_the_gc():
    # A server that replaces its store (another model, another budget) must get the old pool's
    # memory back at once: the store's task pins and their leases must not hold it in a cycle.
    import gc
    import weakref

    store = make_store(8)
    tokens = list(range(2 * BS))
    store.tasks.pin("task", tokens, *kv_for(tokens))
    with store.acquire(tokens) as lease:
        assert lease.num_tokens == 2 * BS  # the pinned prompt is served
    del lease  # a lease held by its user keeps its store alive, as it should
    dead = weakref.ref(store.pool)
    gc.disable()
    try:
        del store
        assert dead() is None
    finally:
        gc.enable()
