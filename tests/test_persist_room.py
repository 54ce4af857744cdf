"""Restores that make room: ``evict=True`` and the host tier, against the default that never evicts.

KV values encode (token, position, layer) (tests/test_persist.py's kv_for), so ``cached_prefix``
shows exactly which blocks a prefix got, from whichever tier. The tree's and pools'
invariants are checked after every step.
"""

from __future__ import annotations

import pytest

import radixkv.persist.cache_read as cache_read
import radixkv.persist.restore as restore
from radixkv import BlockPool, CorruptCacheFile, KVStore
from radixkv.store.tier import host_pool_for
from radixkv.tree import HOST
from tests.test_persist import (
    BS,
    FAULTS,
    IDENTITY,
    SPECS,
    assert_same_state,
    cached_prefix,
    make_store,
    put,
    state,
)


def doc(i: int, blocks: int = 4) -> list[int]:
    return [1000 * i + t for t in range(blocks * BS)]


def make_tiered(device_blocks: int, host_blocks: int) -> KVStore:
    device = BlockPool(SPECS, device_blocks, BS)
    return KVStore(device, host_pool_for(device, tokens=host_blocks * BS))


def saved_docs(tmp_path, docs: list[list[int]]) -> str:
    """A file holding ``docs``, the last one the most recently used."""
    source = make_store(64)
    for d in docs:
        put(source, d)
    path = str(tmp_path / "file.safetensors")
    source.save(path, identity=IDENTITY)
    return path


def tier_of(store: KVStore, tokens: list[int]) -> int:
    return store.tree.cached_prefix(tokens)[1]


FILE = [doc(i) for i in (1, 2, 3, 4)]  # 4 blocks each; doc 4 is the file's most recent
OLD = [doc(i) for i in (11, 12, 13, 14)]  # what the store held before the restore


def full_store(num_blocks: int = 16) -> KVStore:
    store = make_store(num_blocks)
    for d in OLD[: num_blocks // 4]:
        put(store, d)
    assert store.stats()["free_blocks"] == 0
    return store


def test_the_default_never_evicts_and_evict_true_makes_room(tmp_path):
    path = saved_docs(tmp_path, FILE)
    store = full_store()
    result = store.restore(path, identity=IDENTITY)
    store.check_invariants()
    assert (result.restored_blocks, result.dropped_blocks, result.evicted_blocks) == (0, 16, 0)
    assert [cached_prefix(store, d) for d in OLD] == [16] * 4

    with store.acquire(OLD[0]):  # a running request pins OLD[0]: it must survive
        result = store.restore(path, identity=IDENTITY, evict=True)
        store.check_invariants()
    # 12 unpinned blocks: the file's three most recent documents; its oldest is dropped.
    assert (result.restored_blocks, result.dropped_blocks, result.evicted_blocks) == (12, 4, 12)
    assert [cached_prefix(store, d) for d in FILE] == [0, 16, 16, 16]
    assert [cached_prefix(store, d) for d in OLD] == [16, 0, 0, 0]
    store.check_invariants()


def test_a_namespace_filter_leaves_prefixes_out_before_they_take_room(tmp_path):
    # The file: two documents of "keep" (the older), then two of "gone" (the most recent).
    source = make_store(64)
    for ns, d in (("keep", FILE[0]), ("keep", FILE[1]), ("gone", FILE[2]), ("gone", FILE[3])):
        put(source, d, namespace=ns)
    path = str(tmp_path / "file.safetensors")
    source.save(path, identity=IDENTITY)
    store = full_store()
    result = store.restore(path, identity=IDENTITY, evict=True, namespaces=lambda ns: ns != "gone")
    store.check_invariants()
    # Only "keep" takes room: 8 blocks evicted for it, none for the filtered (more recent) ones.
    assert (result.restored_blocks, result.dropped_blocks, result.evicted_blocks) == (8, 8, 8)
    assert [cached_prefix(store, d, "keep") for d in FILE[:2]] == [16, 16]
    assert [cached_prefix(store, d, "gone") for d in FILE[2:]] == [0, 0]
    assert [cached_prefix(store, d) for d in OLD] == [0, 0, 16, 16]
    store.check_invariants()


def test_restored_prefixes_are_the_most_recent_in_the_files_order(tmp_path):
    path = saved_docs(tmp_path, FILE)
    store = full_store()
    store.restore(path, identity=IDENTITY, evict=True)
    put(store, doc(20))  # needs 4 blocks: the least recently used restored document goes
    store.check_invariants()
    assert [cached_prefix(store, d) for d in FILE] == [0, 16, 16, 16]
    assert cached_prefix(store, doc(20)) == 16


def test_without_evict_what_the_device_cannot_take_lands_on_the_free_host_tier(tmp_path):
    system = doc(7, 2)
    file_docs = [system + doc(i, 2) for i in (1, 2)] + [doc(3)]  # a shared prefix and a plain doc
    path = saved_docs(tmp_path, file_docs)
    store = make_tiered(device_blocks=5, host_blocks=16)
    result = store.restore(path, identity=IDENTITY)
    store.check_invariants()
    # Most recent first: doc 3 (4 blocks) on the device; system (2) does not fit the 1 left,
    # so it and both tails go to the host: nothing dropped, nothing evicted.
    assert (result.restored_blocks, result.host_blocks, result.dropped_blocks) == (10, 6, 0)
    assert result.evicted_blocks == result.demoted_blocks == 0
    assert [cached_prefix(store, d) for d in file_docs] == [16, 16, 16]
    assert tier_of(store, doc(3)) != HOST and tier_of(store, file_docs[0]) == HOST
    store.check_invariants()


def test_a_tail_below_a_host_prefix_lands_on_the_host_too(tmp_path):
    system = doc(7, 2)
    longer = system + doc(8, 2)
    path = saved_docs(tmp_path, [longer])
    store = make_tiered(device_blocks=4, host_blocks=16)
    put(store, system)
    put(store, doc(9))  # demotes system to the host
    assert tier_of(store, system) == HOST and store.stats()["free_blocks"] == 0
    result = store.restore(path, identity=IDENTITY)
    store.check_invariants()
    assert (result.restored_blocks, result.host_blocks, result.duplicate_tokens) == (2, 2, 2 * BS)
    assert cached_prefix(store, longer) == 16 and tier_of(store, longer) == HOST


def test_evict_with_a_host_tier_demotes_the_store_and_places_the_file_on_both_tiers(tmp_path):
    path = saved_docs(tmp_path, FILE)
    store = make_tiered(device_blocks=8, host_blocks=8)
    for d in OLD:  # the device holds OLD[2:], the host OLD[:2]: both full
        put(store, d)
    assert store.stats()["free_blocks"] == 0 and store.stats()["host_free_blocks"] == 0
    assert store.restore(path, identity=IDENTITY).restored_blocks == 0  # the default: no room
    store.check_invariants()

    result = store.restore(path, identity=IDENTITY, evict=True)
    store.check_invariants()
    # The file's two most recent documents on the device, the next two on the host; the store's
    # device documents were demoted to the host, then evicted from it with the host's own.
    assert (result.restored_blocks, result.host_blocks, result.dropped_blocks) == (16, 8, 0)
    assert result.demoted_blocks == 8 and result.evicted_blocks == 16
    assert [cached_prefix(store, d) for d in FILE] == [16] * 4
    assert [tier_of(store, d) for d in FILE] == [HOST, HOST, 0, 0]
    assert [cached_prefix(store, d) for d in OLD] == [0] * 4
    store.check_invariants()


def test_free_blocks_are_read_into_directly_and_the_rest_after_room_is_made(tmp_path):
    """Evict with some free room: the most recent documents are read straight into free blocks,
    the others staged until room is made; both end up with exactly their KV."""
    path = saved_docs(tmp_path, FILE)
    store = make_store(16)
    for d in OLD[:2]:
        put(store, d)  # 8 blocks cached, 8 free
    staged = []
    claim = restore._claim

    def spy(*args):
        got = claim(*args)
        staged.append(len(got.staged))
        return got

    restore._claim = spy
    try:
        result = store.restore(path, identity=IDENTITY, evict=True)
    finally:
        restore._claim = claim
    store.check_invariants()
    assert staged == [2] and (result.restored_blocks, result.evicted_blocks) == (16, 8)
    assert [cached_prefix(store, d) for d in FILE] == [16] * 4


@pytest.mark.parametrize("fault", ["last KV byte flipped", "middle byte flipped", "truncated by one byte"])
def test_a_damaged_file_evicts_nothing(tmp_path, fault):
    path = saved_docs(tmp_path, FILE)
    damage, error, message = FAULTS[fault]
    damage(path)
    store = make_tiered(device_blocks=8, host_blocks=8)
    for d in OLD:
        put(store, d)
    before = state(store)
    host_before = [t.clone() for t in store.host_pool.k + store.host_pool.v]
    with pytest.raises(error, match=message):
        store.restore(path, identity=IDENTITY, evict=True)
    assert_same_state(before, state(store))
    assert all((a == b).all() for a, b in zip(host_before, store.host_pool.k + store.host_pool.v))
    assert store.stats()["pinned_blocks"] == 0
    store.check_invariants()


@pytest.mark.parametrize("meanwhile", ["pressure", "flush"])
def test_the_store_changing_while_the_file_is_read(tmp_path, monkeypatch, meanwhile):
    """The KV is read without the lock. The prefix the file found cached is pinned meanwhile
    (commits cannot evict it); after a flush, the paths go into the new tree."""
    shared = doc(5, 2)
    path = saved_docs(tmp_path, [shared + doc(6, 2), doc(1)])
    store = make_store(16)
    put(store, shared)  # the file's first node is cached already: a duplicate
    read = restore.read_kv

    def busy_read(*args):
        if meanwhile == "flush":
            store.flush()
        for i in range(30):  # every free block and more: evictions
            put(store, [90000 + 100 * i + t for t in range(2 * BS)])
        read(*args)

    monkeypatch.setattr(restore, "read_kv", busy_read)
    result = store.restore(path, identity=IDENTITY)
    store.check_invariants()
    stats = store.stats()
    assert (
        stats["pinned_blocks"] == 0 and stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]
    )
    if meanwhile == "pressure":  # the shared prefix survived the pressure: its tail was restored
        assert cached_prefix(store, shared + doc(6, 2)) == 16
    else:  # flushed: the tail's prefix is gone from the new tree, so the tail is dropped
        assert cached_prefix(store, shared + doc(6, 2)) == 0
        assert result.dropped_blocks >= 2
    assert cached_prefix(store, doc(1)) in (0, 16)  # whole or nothing, never wrong KV


def test_blocks_for_a_gpu_pool_go_through_a_bounce_buffer(tmp_path, monkeypatch):
    """Where the pool is not CPU memory the checked bytes are copied on from a small buffer;
    forced here on CPU pools, the KV must be exactly the same."""
    monkeypatch.setattr(cache_read, "_in_place", lambda into: False)
    monkeypatch.setattr(cache_read, "CHUNK", 3 * 256)  # several pieces per tensor
    path = saved_docs(tmp_path, FILE)
    store = make_tiered(device_blocks=8, host_blocks=8)
    result = store.restore(path, identity=IDENTITY)
    assert (result.restored_blocks, result.host_blocks) == (16, 8)
    assert [cached_prefix(store, d) for d in FILE] == [16] * 4
    store.check_invariants()
    damaged = saved_docs(tmp_path, FILE)
    FAULTS["last KV byte flipped"][0](damaged)
    with pytest.raises(CorruptCacheFile, match="checksum"):
        make_store().restore(damaged, identity=IDENTITY)


def test_prefixes_left_out_by_the_namespace_filter_are_not_reported_as_not_fitting(tmp_path, caplog):
    """Left out on purpose (hf_patch leaves out unloaded adapters' prefixes): the warning that
    blocks did not fit, and that evict=True would make room for them, would send a user after
    room that is there already."""
    source = make_store(64)
    for ns, d in (("keep", FILE[0]), ("gone", FILE[1])):
        put(source, d, namespace=ns)
    path = str(tmp_path / "file.safetensors")
    source.save(path, identity=IDENTITY)
    store = make_store(64)  # room for all of it
    with caplog.at_level("INFO", logger="radixkv.persist.restore"):
        result = store.restore(path, identity=IDENTITY, namespaces=lambda ns: ns != "gone")
    assert (result.restored_blocks, result.dropped_blocks) == (4, 4)
    assert "did not fit" not in caplog.text and "evict=True" not in caplog.text
    assert "left out 4 blocks" in caplog.text
    # Both reasons at once: only the blocks that lacked room are said not to fit.
    caplog.clear()
    with caplog.at_level("INFO", logger="radixkv.persist.restore"):
        result = make_store(2).restore(path, identity=IDENTITY, namespaces=lambda ns: ns != "gone")
    assert (result.restored_blocks, result.dropped_blocks) == (0, 8)
    assert "4 blocks did not fit" in caplog.text and "left out 4 blocks" in caplog.text
