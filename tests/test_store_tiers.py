"""KVStore with a host tier: demotion, host hits read in place, host eviction, task pins, threads."""

from __future__ import annotations

import random

import pytest
import torch

from radixkv import BlockPool, KVStore
from radixkv.store.tier import HOST, copy_blocks, gather_into, host_pool_for
from radixkv.store.tier import _gather_staged as gather_staged
from tests.test_store import BS, SPECS, assert_kv_prefix, hammer, kv_for, read_back


def make_tiered(device_blocks: int, host_blocks: int) -> KVStore:
    device = BlockPool(SPECS, device_blocks, BS)
    return KVStore(device, host_pool_for(device, tokens=host_blocks * BS))


def assert_kv(store: KVStore, tokens: list[int], num: int) -> None:
    ks, vs = read_back(store, tokens, num)
    want_k, want_v = kv_for(tokens)
    assert all(torch.equal(a, b[:, :, :num]) for a, b in zip(ks + vs, want_k + want_v))


def test_eviction_demotes_and_host_hits_return_the_same_kv() -> None:
    store = make_tiered(device_blocks=4, host_blocks=12)
    prompts = [[p] * 8 + [99] for p in range(5)]  # 2 blocks each: 10 blocks, 4 fit the device
    for tokens in prompts:
        store.commit(tokens, *kv_for(tokens))
        store.check_invariants()
    stats = store.stats()
    assert stats["demoted_blocks"] == 6 and stats["evicted_blocks"] == 0
    assert stats["host_cached_blocks"] == 6 and stats["cached_blocks"] == 4
    assert stats["bytes_to_host"] == 6 * BS * store.pool.bytes_per_token
    for tokens in prompts:  # every prompt is still a full hit, three of them from the host
        with store.acquire(tokens) as lease:
            assert lease.num_tokens == 8
        assert_kv(store, tokens, 8)
        store.check_invariants()
    stats = store.stats()
    assert stats["host_hit_tokens"] == 3 * 8 and stats["bytes_from_host"] == 24 * store.pool.bytes_per_token
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]
    assert stats["host_free_blocks"] + stats["host_cached_blocks"] == stats["host_num_blocks"]


def test_a_batch_mixing_device_host_and_split_prefixes_reads_each_row_right() -> None:
    store = make_tiered(device_blocks=4, host_blocks=16)
    shared = [7] * 8
    long = shared + [8] * 8 + [1]
    store.commit(shared + [3], *kv_for(shared + [3]))
    store.commit(long, *kv_for(long))  # two nodes of 2 blocks: fills the device
    other = [5] * 8 + [1]
    store.commit(other, *kv_for(other))  # demotes long's tail [8]*8: long is half device, half host
    assert store.stats()["host_cached_blocks"] == 2
    rows = [long, other, shared + [3]]
    leases = [store.acquire(r, max_tokens=len(r) - 1) for r in rows]
    assert [lease.num_host_blocks for lease in leases] == [2, 0, 0]
    n = 8  # a batch reads a common count: rows 0 and 2 straight, row 1 from its own blocks
    ks = [torch.full((3, s.num_kv_heads, 12, s.k_head_dim), float("nan")) for s in SPECS]
    vs = [torch.full((3, s.num_kv_heads, 12, s.v_head_dim), float("nan")) for s in SPECS]
    store.read(leases, n, [k[:, :, 4:12] for k in ks], [v[:, :, 4:12] for v in vs])
    for i, row in enumerate(rows):
        want_k, want_v = kv_for(row)
        for got, want in zip(ks + vs, want_k + want_v):
            assert torch.equal(got[i, :, 4:12], want[0, :, :n])
    # The full 16 tokens of the split row: 8 from the device, 8 from the host, into one view.
    k16 = [torch.empty(1, s.num_kv_heads, 16, s.k_head_dim) for s in SPECS]
    v16 = [torch.empty(1, s.num_kv_heads, 16, s.v_head_dim) for s in SPECS]
    store.read([leases[0]], 16, k16, v16)
    want_k, want_v = kv_for(long)
    assert all(torch.equal(a, b[:, :, :16]) for a, b in zip(k16 + v16, want_k + want_v))
    assert store.stats()["host_hit_tokens"] == 8
    for lease in leases:
        lease.release()
    store.check_invariants()


def test_a_commit_under_a_demoted_prefix_goes_to_the_host_and_host_eviction_drops_lru() -> None:
    store = make_tiered(device_blocks=2, host_blocks=4)
    a = [1] * 8
    store.commit(a + [0], *kv_for(a + [0]))
    b = [2] * 8
    store.commit(b + [0], *kv_for(b + [0]))  # a demoted
    longer = a + [3] * 4 + [0]
    store.commit(longer, *kv_for(longer))  # its new block hangs under a host node: written to the host
    store.check_invariants()
    stats = store.stats()
    assert stats["host_cached_blocks"] == 3 and stats["cached_blocks"] == 2
    assert_kv(store, longer, 12)
    c = [4] * 8
    store.commit(c + [0], *kv_for(c + [0]))  # demotes b: the host drops its LRU leaves for room
    store.check_invariants()
    stats = store.stats()
    assert stats["evicted_blocks"] >= 1 and stats["host_cached_blocks"] <= 4
    assert_kv(store, b, 8)  # the most recent demotion survived
    with store.acquire(a + [3] * 4 + [0]) as lease:  # the LRU host leaf went first
        assert lease.num_tokens == 8
    store.check_invariants()


def test_a_demotion_whose_copy_fails_leaves_no_host_block_taken(monkeypatch) -> None:
    """Making room demotes a prefix to the host; if copying it there raises, the host blocks it
    took go back, the prefix stays on the device, and nothing is pinned."""
    import radixkv.store.kv_store as kv_store

    store = make_tiered(device_blocks=3, host_blocks=4)
    first, second = [1] * 8 + [99], [2] * 8 + [99]
    store.commit(first, *kv_for(first))

    def failing(*args, **kwargs):
        raise RuntimeError("copy to host failed (simulated)")

    monkeypatch.setattr(kv_store, "copy_blocks", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        store.commit(second, *kv_for(second))  # needs 2 blocks, 1 is free: demotes the first
    monkeypatch.undo()
    stats = store.stats()
    assert stats["host_free_blocks"] == 4 and stats["host_cached_blocks"] == 0
    assert stats["cached_blocks"] == 2 and stats["pinned_blocks"] == 0
    store.check_invariants()
    assert_kv(store, first, 8)
    store.commit(second, *kv_for(second))  # and the demotion works once copies do
    assert store.stats()["demoted_blocks"] == 2
    assert_kv(store, first, 8)  # read from the host now
    assert_kv(store, second, 8)
    store.check_invariants()


def test_host_pinned_full_falls_back_to_dropping_device_leaves() -> None:
    store = make_tiered(device_blocks=2, host_blocks=2)
    a = [1] * 8 + [0]
    store.commit(a, *kv_for(a))
    b = [2] * 8 + [0]
    store.commit(b, *kv_for(b))  # a demoted to the host, filling it
    with store.acquire(a) as lease:  # pins a on the host: nothing there can go
        assert lease.num_host_blocks == 2
        c = [3] * 8 + [0]
        store.commit(c, *kv_for(c))  # b cannot be demoted: dropped instead
        store.check_invariants()
        assert store.stats()["evicted_blocks"] == 2
        assert_kv(store, c, 8)
        assert_kv(store, a, 8)
    with store.acquire(b) as lease:
        assert lease.num_tokens == 0
    store.check_invariants()


def test_a_node_too_big_for_the_host_is_dropped_without_emptying_the_host() -> None:
    store = make_tiered(device_blocks=8, host_blocks=4)
    small = [[p] * 4 + [0] for p in (1, 2)]  # 1 block each
    for tokens in small:
        store.commit(tokens, *kv_for(tokens))
    big = [3] * 24 + [0]  # 6 blocks: more than the whole host tier
    store.commit(big, *kv_for(big))
    e = [4] * 8 + [0]
    store.commit(e, *kv_for(e))  # demotes the two small prompts
    assert store.stats()["host_cached_blocks"] == 2
    f = [5] * 8 + [0]
    store.commit(f, *kv_for(f))  # the LRU candidate (big) cannot fit in the host: dropped
    store.check_invariants()
    for tokens in small:  # ...and the host kept what it held: dropping it would free nothing usable
        with store.acquire(tokens) as lease:
            assert (lease.num_tokens, lease.num_host_blocks) == (4, 1)
        assert_kv(store, tokens, 4)
    assert_kv(store, f, 8)
    with store.acquire(big) as lease:
        assert lease.num_tokens == 0


def test_flush_frees_both_tiers_and_keeps_pinned_host_blocks_until_released() -> None:
    store = make_tiered(device_blocks=2, host_blocks=4)
    for p in (1, 2):
        store.commit([p] * 8 + [0], *kv_for([p] * 8 + [0]))
    lease = store.acquire([1] * 8 + [0])
    assert lease.num_host_blocks == 2
    assert store.flush() == 2  # b's device blocks; a's host blocks stay while read
    stats = store.stats()
    assert stats["host_retired_blocks"] == 2 and stats["retired_blocks"] == 0
    store.check_invariants()
    out_k = [torch.empty(1, s.num_kv_heads, 8, s.k_head_dim) for s in SPECS]
    out_v = [torch.empty(1, s.num_kv_heads, 8, s.v_head_dim) for s in SPECS]
    store.read([lease], 8, out_k, out_v)
    want_k, _ = kv_for([1] * 8)
    assert torch.equal(out_k[0], want_k[0])
    lease.release()
    store.check_invariants()
    assert store.stats()["host_free_blocks"] == 4


def test_threads_share_a_tiered_store_consistently() -> None:
    store = make_tiered(device_blocks=6, host_blocks=14)
    hammer(store, num_prefixes=8, rounds=120, vocab=50)
    stats = store.stats()
    assert stats["pinned_blocks"] == stats["host_pinned_blocks"] == 0
    assert stats["host_hit_tokens"] > 0 and stats["demoted_blocks"] > 0


# ---- task pins ------------------------------------------------------------------------------


def test_a_pinned_task_prompt_survives_a_flood_and_is_never_demoted() -> None:
    store = make_tiered(device_blocks=6, host_blocks=8)
    task = [9] * 12 + [1]
    assert store.tasks.pin("summarise", task, *kv_for(task)) == 12
    assert store.stats()["task_prompts"] == 1 and store.stats()["task_pinned_blocks"] == 3
    for p in range(20):  # a flood of unrelated prompts through both tiers
        tokens = [p + 20] * 8 + [0]
        store.commit(tokens, *kv_for(tokens))
    store.check_invariants()
    with store.acquire(task + [5]) as lease:
        assert lease.num_tokens == 12 and lease.num_host_blocks == 0
    assert_kv(store, task, 12)
    store.tasks.unpin("summarise")
    assert store.stats()["task_pinned_blocks"] == 0 and store.tasks.ids() == []
    with pytest.raises(KeyError, match="'summarise'"):
        store.tasks.unpin("summarise")
    store.check_invariants()


def test_a_task_prompt_whose_prefix_was_demoted_is_pinned_on_the_device() -> None:
    store = make_tiered(device_blocks=8, host_blocks=2)  # a host tier smaller than the prompt
    task = [1] * 16 + [0]  # 4 blocks
    head = task[:8] + [0]
    store.commit(head, *kv_for(head))
    for p in range(4):  # traffic demotes the prompt's first 2 blocks, filling the host
        tokens = [p + 10] * 8 + [0]
        store.commit(tokens, *kv_for(tokens))
    assert store.tree.match(head).node.tier == HOST
    # No request runs and the device pool holds 8 blocks: the 4-block prompt must pin there.
    assert store.tasks.pin("t", task, *kv_for(task)) == 16
    store.check_invariants()
    stats = store.stats()
    assert (stats["task_pinned_blocks"], stats["task_pinned_host_blocks"]) == (4, 0)
    assert stats["promoted_blocks"] == 2
    for p in range(10):  # pinned on the device: never demoted by the traffic that follows
        tokens = [p + 30] * 8 + [0]
        store.commit(tokens, *kv_for(tokens))
    with store.acquire(task) as lease:
        assert (lease.num_tokens, lease.num_host_blocks) == (16, 0)
    assert_kv(store, task, 16)
    store.check_invariants()


def test_a_demoted_prefix_a_reader_holds_stays_on_the_host_for_a_task_pin() -> None:
    store = make_tiered(device_blocks=4, host_blocks=8)
    task = [1] * 12 + [0]  # 3 blocks
    head = task[:8] + [0]
    store.commit(head, *kv_for(head))
    for p in range(2):
        tokens = [p + 10] * 8 + [0]
        store.commit(tokens, *kv_for(tokens))
    with store.acquire(head) as reader:  # a request reads the demoted blocks outside the lock
        assert reader.num_host_blocks == 2
        assert store.tasks.pin("t", task, *kv_for(task)) == 12  # pinned where the prefix is
        assert_kv(store, head, 8)
        store.check_invariants()
    assert_kv(store, task, 12)
    store.check_invariants()


def test_task_pins_are_refused_when_the_pool_cannot_hold_them() -> None:
    store = make_tiered(device_blocks=4, host_blocks=4)
    a = [1] * 12
    store.tasks.pin("a", a, *kv_for(a))
    b = [2] * 8
    with pytest.raises(ValueError, match=r"'b' needs 2 blocks .* pin 3 .* has only 4 blocks"):
        store.tasks.pin("b", b, *kv_for(b))
    with pytest.raises(ValueError, match="less than one block"):
        store.tasks.pin("c", [1, 2], *kv_for([1, 2]))
    shared = a[:8] + [5] * 4  # shares a's first two blocks: fits
    store.tasks.pin("b", shared, *kv_for(shared))
    assert store.stats()["task_pinned_blocks"] == 4
    store.check_invariants()
    assert store.tasks.ids() == ["a", "b"]


def test_replacing_a_task_prompt_unpins_the_old_one_and_flush_drops_them() -> None:
    store = make_tiered(device_blocks=4, host_blocks=4)
    old, new = [1] * 8, [2] * 8
    store.tasks.pin("t", old, *kv_for(old))
    store.tasks.pin("t", new, *kv_for(new))
    assert store.stats()["task_pinned_blocks"] == 2 and store.stats()["pinned_blocks"] == 2
    store.check_invariants()
    store.flush()
    assert store.tasks.ids() == [] and store.stats()["pinned_blocks"] == 0
    assert store.stats()["free_blocks"] == 4
    store.check_invariants()


def test_task_pins_work_without_a_host_tier() -> None:
    store = KVStore(BlockPool(SPECS, 3, BS))
    task = [4] * 8
    store.tasks.pin(7, task, *kv_for(task))
    for p in range(6):
        store.commit([p + 10] * 8, *kv_for([p + 10] * 8))
    with store.acquire(task + [1]) as lease:
        assert lease.num_tokens == 8
    store.check_invariants()


# ---- copies between tiers --------------------------------------------------------------------


def test_copy_blocks_moves_runs_and_scattered_ids_bit_exactly() -> None:
    src = BlockPool(SPECS, 8, BS)
    for t in src.k + src.v:
        t.copy_(torch.randn_like(t))
    dst = host_pool_for(src, tokens=8 * BS)
    assert not dst.k[0].is_pinned()  # plain memory without CUDA
    src_ids, dst_ids = [2, 3, 4, 7, 0], [5, 6, 0, 1, 2]
    moved = copy_blocks(src, src_ids, dst, dst_ids)
    assert moved == 5 * BS * src.bytes_per_token
    for a, b in zip(src.k + src.v, dst.k + dst.v):
        assert torch.equal(a[src_ids], b[dst_ids])
    with pytest.raises(ValueError, match="2 source ids for 1"):
        copy_blocks(src, [0, 1], dst, [0])
    runs_src, runs_dst = [0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7, 0, 1, 2, 3]  # two runs: slice copies
    copy_blocks(src, runs_src, dst, runs_dst)
    for a, b in zip(src.k + src.v, dst.k + dst.v):
        assert torch.equal(a[runs_src], b[runs_dst])


def test_staged_gather_equals_the_fused_gather() -> None:
    pool = BlockPool(SPECS, 6, BS)
    for t in pool.k + pool.v:
        t.copy_(torch.randn_like(t))
    ids = torch.tensor([[4, 1, 2], [0, 5, 3]])
    want = [torch.empty(2, s.num_kv_heads, 10, s.k_head_dim) for s in SPECS]
    want_v = [torch.empty(2, s.num_kv_heads, 10, s.v_head_dim) for s in SPECS]
    gather_into(pool, ids, 10, want, want_v)
    for i, s in enumerate(SPECS):  # the path a host pool takes into GPU buffers, run on CPU
        got = torch.empty(2, s.num_kv_heads, 10, s.k_head_dim)
        gather_staged(pool.k[i], ids, 10, got)
        assert torch.equal(got, want[i])


def test_host_pool_must_mirror_the_device_pool() -> None:
    device = BlockPool(SPECS, 4, BS)
    with pytest.raises(ValueError, match="block size"):
        KVStore(device, BlockPool(SPECS, 4, BS * 2))
    with pytest.raises(ValueError, match="layers differ"):
        KVStore(device, BlockPool(SPECS[:1], 4, BS))
    assert KVStore(device, host_pool_for(device, bytes=10**6)).tiers[1].index == HOST


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_random_traffic_reads_right_with_invariants_after_every_step(seed: int) -> None:
    rng = random.Random(seed)
    store = make_tiered(device_blocks=3, host_blocks=8)
    seen: list[list[int]] = []
    for _ in range(200):
        if seen and rng.random() < 0.5:
            assert_kv_prefix(store, rng.choice(seen))
        else:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 15))]
            store.commit(tokens, *kv_for(tokens))
            seen.append(tokens)
        store.check_invariants()
    stats = store.stats()
    assert stats["demoted_blocks"] and stats["host_hit_tokens"] and stats["evicted_blocks"]
