"""Cache files of stores with recurrent state (KVStore(states=), format 3): every node's snapshot is
saved with its KV, restored into the state pool of the node's tier, and checked before anything
reaches the store.

KV values encode (token, position) and snapshot values the whole prefix (tests/test_store_states.py's
kv_of / state_of), so ``served`` shows exactly which KV and which snapshot a prefix got back.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from radixkv import BlockPool, CacheFileMismatch, CorruptCacheFile, KVStore, StatePool, StateSpec
from radixkv.persist.checksum import tensor_digest
from radixkv.persist.manifest import from_metadata, to_metadata
from radixkv.tree.node import HOST
from tests.test_store_states import BS, LAYER, SPECS, commit, served, state_of, store_with

IDENTITY = {"model": "hybrid", "weights": "abc"}
DOCS = [[d * 100 + t for t in range(3, 3 + 16)] for d in range(1, 5)]  # 4 blocks each


def warm(store: KVStore, docs=DOCS) -> KVStore:
    """Each document plus a question: snapshots at 8, 16 (the document's end) and 20."""
    for doc in docs:
        commit(store, doc + [1, 2, 3, 4], positions=[8, 16, 20])
    return store


def served_all(store: KVStore, docs=DOCS) -> list[int]:
    return [served(store, doc + [1, 2, 3, 4, 5]) for doc in docs]


def state(store: KVStore) -> tuple:
    """What a refused restore must leave as it was: nodes (with tier and snapshot slot), stats,
    the free lists in their order, and the bytes of every block and state slot in use."""
    nodes = sorted(
        (repr(n.parent.key) if n.parent.is_root else "", n.data, tuple(n.block_ids), n.tier, n.snap)
        for n in store.tree.iter_nodes()
    )
    pools = [p for p in (store.states, store.host_states) if p is not None]
    slots = [sorted(p.used_slots()) for p in pools]
    data = [[t[s].clone() for s in used for t in p.tensors] for p, used in zip(pools, slots)]
    blocks = sorted(store.pool.used_blocks())
    held = torch.tensor(blocks, dtype=torch.int64)
    kv = [t.index_select(0, held).clone() for t in store.pool.k + store.pool.v]
    free = [p._free[: p.num_free].tolist() for p in pools]
    return nodes, store.stats(), slots, free, list(store.pool._free), [x for d in data for x in d] + kv


def assert_unchanged(before: tuple, store: KVStore) -> None:
    after = state(store)
    assert before[:5] == after[:5]
    assert all(torch.equal(a, b) for a, b in zip(before[5], after[5]))
    store.check_invariants()


@pytest.fixture
def saved(tmp_path):
    source = warm(store_with(num_blocks=12, num_slots=4, host_blocks=32, host_slots=8))
    assert source.stats()["host_snapshots"] > 0  # some snapshots were demoted with their nodes
    path = tmp_path / "states.safetensors"
    result = source.save(path, identity=IDENTITY)
    return source, path, result


def test_a_round_trip_with_a_host_tier_restores_every_snapshot_with_its_node(saved):
    source, path, result = saved
    stats = source.stats()
    assert result.num_snapshots == stats["snapshots"] + stats["host_snapshots"]
    assert result.state_bytes == result.num_snapshots * source.states.slot_bytes
    tensors = load_file(path)  # any safetensors reader: the tensors as docs/cache-files.md lists them
    assert tensors["state.1"].shape == (result.num_snapshots, *SPECS[1].shape)
    assert tensors["tree.snaps"].shape == (result.num_nodes,)
    assert sorted(r for r in tensors["tree.snaps"].tolist() if r >= 0) == list(range(result.num_snapshots))
    want = served_all(source)
    # A small device tier: the least recently used nodes and their snapshots land on the host.
    fresh = store_with(num_blocks=10, num_slots=6, host_blocks=16, host_slots=8)
    restored = fresh.restore(path, identity=IDENTITY)
    fresh.check_invariants()
    assert (restored.restored_snapshots, restored.dropped_snapshots) == (result.num_snapshots, 0)
    assert restored.host_snapshots > 0 and restored.host_blocks > 0 and restored.dropped_blocks == 0
    assert fresh.stats()["host_snapshots"] == restored.host_snapshots
    assert served_all(fresh) == want == [16, 16, 16, 20]  # the KV and the snapshots of each prefix


def snapshot_owners(store: KVStore) -> dict[int, tuple[int, int]]:
    """Device slot -> (first token, length) of its node's path: which prefix it belongs to."""
    out = {}
    for node in store.tree.iter_nodes():
        if node.snap >= 0 and node.tier != HOST:
            top, length = node, len(node.data)
            while not top.parent.is_root:
                top = top.parent
                length += len(top.data)
            out[node.snap] = (int.from_bytes(top.data[:8], "little", signed=True), length // 8)
    return out


def lru_order(store: KVStore) -> list[tuple[int, int]]:
    """The device snapshots' prefixes, least recently used first (evicts them all)."""
    owners = snapshot_owners(store)
    return [owners[slot] for _ in range(len(owners)) for slot in store.tree.evict_snapshots(1)]


def test_restored_snapshots_are_recent_in_the_files_order(tmp_path):
    source = warm(store_with(num_slots=16))
    served(source, DOCS[0] + [9])  # DOCS[0]'s path to 16 becomes the most recent in the file
    path = tmp_path / "s.safetensors"
    source.save(path, identity=IDENTITY)
    recency = {}  # prefix -> its node's recency in the file (nodes of one commit share one)
    owners = snapshot_owners(source)
    for node in source.tree.iter_nodes():
        recency[owners[node.snap]] = node.last_access
    store = store_with(num_slots=16)
    commit(store, [7] * 8, positions=[8])  # the store's own snapshot: older than the file's
    assert store.restore(path, identity=IDENTITY).restored_snapshots == 12
    order = lru_order(store)
    assert order[0] == (7, 8) and sorted(order[1:]) == sorted(recency)  # the store's own first
    assert [recency[p] for p in order[1:]] == sorted(recency.values())  # then the file's, oldest first
    assert order[1] == (DOCS[0][0], 20) and set(order[-2:]) == {(DOCS[0][0], 8), (DOCS[0][0], 16)}


def test_snapshots_without_a_free_slot_are_dropped_and_their_kv_kept(saved):
    _, path, result = saved
    store = store_with(num_blocks=64, num_slots=2)
    restored = store.restore(path, identity=IDENTITY)
    # Every block fits; the two most recent snapshots take the two slots, the rest are dropped.
    assert restored.dropped_blocks == 0 and restored.restored_blocks == result.num_blocks
    assert (restored.restored_snapshots, restored.dropped_snapshots) == (2, result.num_snapshots - 2)
    store.check_invariants()
    assert store.stats()["cached_blocks"] == result.num_blocks  # KV past the kept snapshots stays
    assert sum(served_all(store)) > 0


def test_evict_lets_the_files_snapshots_displace_the_stores_least_recently_used(saved):
    _, path, result = saved
    store = store_with(num_blocks=64, num_slots=4)
    own = [[7] * 8, [8] * 8, [9] * 8, [6] * 8]
    for tokens in own:
        commit(store, tokens, positions=[8])
    with store.acquire(own[0] + [1]):  # a pinned snapshot is never evicted
        before = state(store)
        assert store.restore(path, identity=IDENTITY).restored_snapshots == 0  # no free slot
        assert store.check_invariants() is None and state(store)[2] == before[2]  # same slots held
        restored = store.restore(path, identity=IDENTITY, evict=True)
    assert (restored.restored_snapshots, restored.evicted_snapshots) == (3, 3)
    assert restored.duplicate_snapshots + restored.dropped_snapshots == result.num_snapshots - 3
    store.check_invariants()
    assert served(store, own[0] + [1]) == 8 and [served(store, t + [1]) for t in own[1:]] == [0, 0, 0]
    assert sum(served_all(store)) > 0  # KV stays in every case: the store's too
    assert store.stats()["cached_blocks"] == result.num_blocks + 8


def test_a_snapshot_the_store_holds_is_a_duplicate_and_a_missing_one_is_filled_in(saved):
    source, path, result = saved
    again = source.restore(path, identity=IDENTITY)
    assert (again.duplicate_snapshots, again.restored_snapshots) == (result.num_snapshots, 0)
    assert again.restored_blocks == 0
    source.check_invariants()
    # The KV of a document whose snapshot was evicted, in one node: the file's snapshots make it
    # usable, each attached where its file node ends (the store's node split there).
    store = store_with(num_blocks=64, num_slots=8)
    commit(store, DOCS[3] + [1, 2, 3, 4], positions=[20])
    assert store.tree.num_nodes == 1
    store.states.free(store.tree.evict_snapshots(1))
    assert served(store, DOCS[3] + [1, 2, 3, 4, 5]) == 0
    restored = store.restore(path, identity=IDENTITY)
    assert restored.duplicate_tokens == 20 and restored.restored_snapshots == result.num_snapshots
    assert served_all(store) == served_all(source)
    store.check_invariants()


def test_max_bytes_counts_snapshot_bytes(tmp_path):
    store = warm(store_with(num_slots=16))
    served(store, DOCS[2] + [1, 2, 3, 4, 5])  # the most recent document
    per_doc = 5 * BS * store.pool.bytes_per_token + 3 * store.states.slot_bytes
    path = tmp_path / "m.safetensors"
    result = store.save(path, identity=IDENTITY, max_bytes=per_doc)
    assert (result.num_blocks, result.num_snapshots) == (5, 3)
    assert (result.skipped_blocks, result.skipped_snapshots) == (15, 9)
    assert result.kv_bytes + result.state_bytes == per_doc
    short = store.save(path, identity=IDENTITY, max_bytes=per_doc - 1)  # not the last snapshot's node
    assert (short.num_blocks, short.num_snapshots) == (4, 2)
    fresh = store_with()
    fresh.restore(path, identity=IDENTITY)
    assert served(fresh, DOCS[2] + [1, 2, 3, 4, 5]) == 16


def test_a_store_without_kv_layers_saves_and_restores_its_snapshots(tmp_path):
    """A pure recurrent model (Mamba): blocks hold no bytes, the file holds tokens and snapshots."""
    store = KVStore(BlockPool([], 32, BS), states=StatePool(SPECS, 8))
    tokens = list(range(3, 15))
    store.commit(tokens, [], [], snapshots={8: state_of(tokens[:8]), 12: state_of(tokens)})
    path = tmp_path / "mamba.safetensors"
    result = store.save(path, identity=IDENTITY, max_bytes=1 << 20)
    assert (result.num_snapshots, result.kv_bytes) == (2, 0)
    assert sorted(load_file(path)) == ["state.0", "state.1", "tree.nodes", "tree.snaps", "tree.tokens"]
    fresh = KVStore(BlockPool([], 32, BS), states=StatePool(SPECS, 8))
    assert fresh.restore(path, identity=IDENTITY).restored_snapshots == 2
    with fresh.acquire(tokens + [1]) as lease:
        out = [torch.empty(s.shape) for s in SPECS]
        assert lease.num_tokens == 12 and fresh.read_state(lease, out)
        assert all(torch.equal(x, y) for x, y in zip(out, state_of(tokens)))
    fresh.check_invariants()


def test_a_stateful_store_whose_snapshots_were_all_evicted_saves_its_kv(tmp_path):
    store = warm(store_with(num_slots=16), DOCS[:2])
    store.states.free(store.tree.evict_snapshots(16))
    path = tmp_path / "kv-only.safetensors"
    result = store.save(path, identity=IDENTITY)
    assert (result.num_snapshots, result.num_blocks) == (0, 10)
    assert load_file(path)["state.0"].shape == (0, *SPECS[0].shape)
    fresh = warm(store_with(num_slots=16), DOCS[:1])
    restored = fresh.restore(path, identity=IDENTITY)
    assert (restored.num_snapshots, restored.duplicate_tokens, restored.restored_blocks) == (0, 20, 5)
    assert served_all(fresh, DOCS[:2]) == [20, 0]  # the KV is back; usable once a snapshot is
    fresh.check_invariants()


# -- refusals: the store is left exactly as it was ---------------------------------------------
def rewritten(path, out, edit) -> None:
    """``path``'s tensors and manifest after ``edit(tensors, manifest)``, checksums made right
    again (a forged file, not a bit flip: the structure checks must catch it)."""
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        manifest = from_metadata(f.metadata())
    edit(tensors, manifest)
    for name, t in tensors.items():
        manifest["checksums"][name] = tensor_digest(t)
    save_file(tensors, out, metadata=to_metadata(manifest))


def _flip(path, out, offset_from_end: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[-offset_from_end] ^= 0x04
    out.write_bytes(bytes(data))


def _other_states(tensors, manifest) -> None:
    manifest["layout"]["states"][0]["shape"] = [3, 3]


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (lambda p, o: _flip(p, o, 3), CorruptCacheFile, "state.1 does not match its checksum"),
        (lambda p, o: o.write_bytes(open(p, "rb").read()[:-40]), CorruptCacheFile, "truncated"),
        (
            lambda p, o: rewritten(p, o, lambda t, m: t["tree.snaps"].copy_(t["tree.snaps"].flip(0))),
            CorruptCacheFile,
            "snapshot rows",
        ),
        (
            lambda p, o: rewritten(p, o, lambda t, m: m["counts"].update(snapshots=-1)),
            CorruptCacheFile,
            "counts.snapshots",
        ),
    ],
    ids=["flipped state bit", "truncated", "snapshot rows", "snapshot count"],
)
def test_a_damaged_file_changes_nothing(saved, tmp_path, damage, error, message):
    _, path, _ = saved
    bad = tmp_path / "bad.safetensors"
    damage(path, bad)
    store = warm(store_with(num_blocks=12, num_slots=4, host_blocks=32, host_slots=8), DOCS[:2])
    before = state(store)
    for evict in (False, True):
        with pytest.raises(error, match=message):
            store.restore(bad, identity=IDENTITY, evict=evict)
        assert_unchanged(before, store)


def test_a_file_of_another_state_layout_is_refused(saved, tmp_path):
    _, path, _ = saved
    store = warm(store_with(), DOCS[:1])
    before = state(store)
    other = tmp_path / "other.safetensors"
    rewritten(path, other, lambda t, m: m["layout"]["states"][0].update(dtype="bfloat16"))
    with pytest.raises(CacheFileMismatch, match=r"layout.states\[0\].dtype: the file has 'bfloat16'"):
        store.restore(other, identity=IDENTITY)
    shaped = KVStore(
        BlockPool([LAYER], 16, BS),
        states=StatePool([SPECS[0], StateSpec((2, 2, 3), torch.float32, "cpu")], 4),
    )
    with pytest.raises(CacheFileMismatch, match=r"layout.states\[1\].shape"):
        shaped.restore(path, identity=IDENTITY)
    fewer = KVStore(BlockPool([LAYER], 16, BS), states=StatePool(SPECS[:1], 4))
    with pytest.raises(CacheFileMismatch, match="layout.states"):
        fewer.restore(path, identity=IDENTITY)
    with pytest.raises(CacheFileMismatch, match="identity.weights"):
        store.restore(path, identity={**IDENTITY, "weights": "other"})
    assert_unchanged(before, store)


def test_a_plain_file_into_a_stateful_store_and_the_reverse_are_refused(saved, tmp_path):
    _, path, _ = saved
    plain = KVStore(BlockPool([LAYER], 16, BS))
    tokens = list(range(3, 11))
    plain.commit(tokens, *_kv(tokens))
    plain_path = tmp_path / "plain.safetensors"
    plain.save(plain_path, identity=IDENTITY)
    stateful = warm(store_with(), DOCS[:1])
    before = state(stateful)
    with pytest.raises(CacheFileMismatch, match="holds no recurrent-state snapshots .* recurrent layers"):
        stateful.restore(plain_path, identity=IDENTITY)
    assert_unchanged(before, stateful)
    plain_before = plain.stats()
    with pytest.raises(CacheFileMismatch, match="holds recurrent-state snapshots .* no state pool"):
        plain.restore(path, identity=IDENTITY)
    assert plain.stats() == plain_before
    plain.check_invariants()


def _kv(tokens):
    from tests.test_store_states import kv_of

    return kv_of(tokens)
