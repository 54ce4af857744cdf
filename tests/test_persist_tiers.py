"""Save / restore with a host tier: host-resident blocks are written from the host pool, and a
restore never hangs device blocks below a prefix the store holds on its host tier.

KV values encode (token, position, layer) (tests/test_persist.py's kv_for), so a read shows
exactly which block a prefix got, whichever tier it came from.
"""

from __future__ import annotations

from radixkv import BlockPool, KVStore
from radixkv.store.tier import host_pool_for
from radixkv.tree.node import HOST
from tests.test_persist import BS, IDENTITY, SPECS, cached_prefix, make_store, put


def make_tiered(device_blocks: int, host_blocks: int) -> KVStore:
    device = BlockPool(SPECS, device_blocks, BS)
    return KVStore(device, host_pool_for(device, tokens=host_blocks * BS))


def host_nodes(store: KVStore) -> int:
    return sum(1 for node in store.tree.iter_nodes() if node.tier == HOST)


def test_a_save_writes_host_resident_blocks_with_their_own_kv(tmp_path) -> None:
    store = make_tiered(device_blocks=4, host_blocks=16)
    docs = [[d * 100 + t for t in range(4 * BS)] for d in range(3)]  # 4 blocks each
    for doc in docs:
        put(store, doc)
    assert host_nodes(store) >= 2  # the older documents were demoted, not dropped
    path = tmp_path / "kv.safetensors"
    assert store.save(path, identity=IDENTITY).num_blocks == 12

    fresh = make_store(num_blocks=16)
    result = fresh.restore(path, identity=IDENTITY)
    assert result.restored_blocks == 12 and result.dropped_blocks == 0
    for doc in docs:  # every block came from the tier it lived in: the KV is exactly right
        assert cached_prefix(fresh, doc) == len(doc)
    fresh.check_invariants()
    store.check_invariants()


def test_a_restore_keeps_the_stores_host_copy_and_drops_the_files_part_below_it(tmp_path) -> None:
    doc = list(range(2 * BS))
    longer = doc + [7] * (2 * BS)
    source = make_store()
    put(source, longer)
    path = tmp_path / "kv.safetensors"
    source.save(path, identity=IDENTITY)

    store = make_tiered(device_blocks=6, host_blocks=8)
    put(store, doc)  # 2 blocks
    put(store, [9000 + t for t in range(6 * BS)])  # demotes doc
    put(store, [8000 + t for t in range(2 * BS)])  # demotes the 6 blocks: 4 device blocks free
    assert store.stats()["free_blocks"] == 4
    assert store.tree.match(doc).node.tier == HOST
    result = store.restore(path, identity=IDENTITY)
    # The file's first 2 blocks are cached already (on the host); its 2 others would hang below
    # that host-resident prefix: dropped and reported, the store's copy kept.
    assert (result.restored_blocks, result.dropped_blocks, result.duplicate_tokens) == (0, 2, 2 * BS)
    store.check_invariants()
    assert cached_prefix(store, longer) == len(doc)
    assert store.stats()["free_blocks"] == 4  # nothing leaked


def test_file_parts_below_a_host_prefix_take_no_free_blocks_from_parts_that_fit(tmp_path) -> None:
    doc = list(range(2 * BS))
    longer = doc + [7] * (4 * BS)  # its last 4 blocks would hang below the store's host copy of doc
    older = [5000 + t for t in range(4 * BS)]
    source = make_store()
    put(source, older)
    put(source, longer)  # the most recent: chosen first
    path = tmp_path / "kv.safetensors"
    source.save(path, identity=IDENTITY)

    store = make_tiered(device_blocks=6, host_blocks=8)
    put(store, doc)
    put(store, [9000 + t for t in range(6 * BS)])  # demotes doc
    put(store, [8000 + t for t in range(2 * BS)])  # demotes the 6 blocks: 4 device blocks free
    assert store.tree.match(doc).node.tier == HOST and store.stats()["free_blocks"] == 4
    result = store.restore(path, identity=IDENTITY)
    store.check_invariants()
    # doc: cached (on the host); longer's tail: dropped (below it); older: fits in the 4 free blocks.
    assert (result.restored_blocks, result.duplicate_tokens, result.dropped_blocks) == (4, 2 * BS, 4)
    assert cached_prefix(store, older) == len(older)
    assert cached_prefix(store, longer) == len(doc)
