"""KVStore.save / restore: round trips, merges, a pool too small, and every fault a file can have.

A refused file must leave the store exactly as it was: same tree, same pool bytes, same
stats, invariants intact. KV values encode (token, position, layer), so a read shows
exactly which block a prefix got.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import radixkv.persist.cache_file as cache_file
import radixkv.persist.cache_write as cache_write
import radixkv.persist.save as persist
from radixkv import BlockPool, CacheFileError, CacheFileMismatch, CorruptCacheFile, KVStore, LayerSpec
from radixkv.persist.manifest import MANIFEST_KEY

BS = 4
CPU = torch.device("cpu")
SPECS = (
    LayerSpec(2, 8, 8, torch.float32, CPU),
    LayerSpec(1, 4, 6, torch.bfloat16, CPU),  # another dtype and a V head dim of its own
)
IDENTITY = {"model": "test", "weights": "abc"}


def kv_for(tokens: list[int], specs=SPECS):
    t = torch.tensor(tokens, dtype=torch.float32)
    base = (t * 16 + torch.arange(len(tokens)) % 16).view(1, 1, -1, 1)
    ks = [
        (base + i).expand(1, s.num_kv_heads, -1, s.k_head_dim).to(s.dtype).contiguous()
        for i, s in enumerate(specs)
    ]
    vs = [
        (-base - i).expand(1, s.num_kv_heads, -1, s.v_head_dim).to(s.dtype).contiguous()
        for i, s in enumerate(specs)
    ]
    return ks, vs


def make_store(num_blocks: int = 64, specs=SPECS, block_size: int = BS) -> KVStore:
    return KVStore(BlockPool(specs, num_blocks, block_size))


def put(store: KVStore, tokens: list[int], namespace=None) -> None:
    store.commit(tokens, *kv_for(tokens, store.pool.layers), namespace=namespace)


def cached_prefix(store: KVStore, tokens: list[int], namespace=None) -> int:
    """Tokens of ``tokens`` the store serves, after checking their KV is exactly right."""
    with store.acquire(tokens, namespace) as lease:
        n = lease.num_tokens
        if n:
            ks = [torch.empty(1, s.num_kv_heads, n, s.k_head_dim, dtype=s.dtype) for s in store.pool.layers]
            vs = [torch.empty(1, s.num_kv_heads, n, s.v_head_dim, dtype=s.dtype) for s in store.pool.layers]
            store.read([lease], n, ks, vs)
            want_k, want_v = kv_for(tokens[:n], store.pool.layers)
            for a, b in zip(ks + vs, want_k + want_v):
                assert torch.equal(a, b)
    return n


def state(store: KVStore) -> tuple:
    """Everything a failed restore must leave unchanged: the tree, the stats, the blocks in use
    and the free list in its order, and every byte of the blocks the store holds. (A restore
    reads the file straight into free blocks it holds privately until every byte is checked:
    the bytes of free blocks, which nothing reads before writing them, may change.)"""
    nodes = sorted(
        (repr(n.parent.key) if n.parent.is_root else "", n.data, tuple(n.block_ids), n.last_access)
        for n in store.tree.iter_nodes()
    )
    used = sorted(store.pool.used_blocks())
    held = torch.tensor(used, dtype=torch.int64)
    pool_bytes = [t.index_select(0, held).view(torch.uint8).clone() for t in store.pool.k + store.pool.v]
    return nodes, store.stats(), used, list(store.pool._free), pool_bytes


def assert_same_state(a: tuple, b: tuple) -> None:
    assert a[:4] == b[:4]
    assert all(torch.equal(x, y) for x, y in zip(a[4], b[4]))


SEQS = {
    None: [list(range(10, 30)), list(range(10, 22)) + [99] * 8, list(range(40, 47))],
    "tenant:a": [list(range(10, 30))],  # same tokens, other namespace
    b"\x00salt": [list(range(50, 62))],
    7: [list(range(70, 78))],
    (3, ("x", None)): [list(range(80, 96))],
}


@pytest.fixture
def full_store() -> KVStore:
    store = make_store()
    for ns, seqs in SEQS.items():
        for seq in seqs:
            put(store, seq, ns)
    return store


@pytest.fixture
def saved(full_store, tmp_path) -> str:
    path = str(tmp_path / "cache.safetensors")
    full_store.save(path, identity=IDENTITY)
    return path


def test_round_trip_restores_every_prefix_with_its_kv(full_store, tmp_path):
    path = tmp_path / "c.safetensors"
    result = full_store.save(path, identity=IDENTITY)
    kv_bytes = full_store.stats()["cached_blocks"] * BS * full_store.pool.bytes_per_token
    assert result.num_blocks == full_store.stats()["cached_blocks"] and result.kv_bytes == kv_bytes
    assert kv_bytes < result.file_bytes < kv_bytes + 8192  # KV plus a small header and token ids
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary file left
    # Any safetensors reader opens it: names, shapes and dtypes as documented in radixkv.persist.
    plain = load_file(path)
    assert plain["kv.1.k"].dtype == torch.bfloat16 and plain["kv.1.k"].shape[1:] == (BS, 1, 4)
    assert plain["tree.tokens"].numel() == result.num_tokens
    fresh = make_store()
    restored = fresh.restore(path, identity=IDENTITY)
    assert restored.restored_blocks == result.num_blocks and restored.dropped_tokens == 0
    fresh.check_invariants()
    for ns, seqs in SEQS.items():
        for seq in seqs:
            assert cached_prefix(fresh, seq + [1], ns) == len(seq) // BS * BS
    assert cached_prefix(fresh, list(range(50, 62)), "other") == 0  # namespaces stay apart
    assert fresh.stats()["cached_blocks"] == full_store.stats()["cached_blocks"]


def test_save_a_subset_of_namespaces_and_rename(full_store, tmp_path):
    path = tmp_path / "sub.safetensors"
    result = full_store.save(path, ["tenant:a", 7], rename=lambda ns: ("moved", ns))
    assert result.num_tokens == 20 + 8
    fresh = make_store()
    fresh.restore(path, rename=lambda ns: ns[1])  # the inverse mapping
    assert cached_prefix(fresh, list(range(10, 31)), "tenant:a") == 20
    assert cached_prefix(fresh, list(range(70, 79)), 7) == 8
    assert cached_prefix(fresh, list(range(10, 31))) == 0  # namespace None was not saved
    with pytest.raises(TypeError, match="list/set"):
        full_store.save(path, "tenant:a")  # a str is not a collection of namespaces


@pytest.mark.parametrize("bad", [1.5, frozenset({1}), True, ("ok", 2.0)])
def test_a_namespace_without_a_file_form_is_refused_at_save(tmp_path, bad):
    store = make_store()
    put(store, list(range(8)), bad)
    with pytest.raises(ValueError, match="cannot be saved"):
        store.save(tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []
    store.check_invariants()


def test_empty_store_round_trips(tmp_path):
    make_store().save(tmp_path / "e.safetensors")
    store = make_store()
    assert store.restore(tmp_path / "e.safetensors").restored_tokens == 0
    store.check_invariants()


def test_restore_merges_into_a_warm_store(saved):
    store = make_store()
    put(store, list(range(10, 26)))  # a prefix of a saved sequence, already cached
    put(store, list(range(200, 212)))  # not in the file
    before = {b for n in store.tree.iter_nodes() for b in n.block_ids}
    result = store.restore(saved, identity=IDENTITY)
    store.check_invariants()
    assert result.duplicate_tokens == 16 and result.dropped_tokens == 0
    assert before <= {b for n in store.tree.iter_nodes() for b in n.block_ids}  # nothing replaced
    assert cached_prefix(store, list(range(200, 213))) == 12
    assert cached_prefix(store, list(range(10, 31))) == 20
    assert cached_prefix(store, list(range(10, 22)) + [99] * 9) == 20
    # Restoring the same file again adds nothing and leaks nothing.
    again = store.restore(saved, identity=IDENTITY)
    assert again.restored_tokens == 0 and again.duplicate_tokens == result.restored_tokens + 16
    store.check_invariants()
    stats = store.stats()
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]


def test_a_file_larger_than_the_free_pool_keeps_its_most_recent_part(tmp_path):
    big = make_store(64)
    seqs = [[1000 * i + j for j in range(8)] for i in range(1, 9)]  # 8 prefixes of 2 blocks
    for seq in seqs:
        put(big, seq)
    cached_prefix(big, seqs[0] + [0])  # now the most recently used
    path = tmp_path / "big.safetensors"
    big.save(path)
    small = make_store(7)
    result = small.restore(path)
    small.check_invariants()
    assert (result.restored_blocks, result.dropped_blocks, result.dropped_tokens) == (6, 10, 40)
    # The saved recency order survives: eviction takes seqs[6] first, seqs[0] (touched last) last.
    evicted = small.tree.evict(2)
    small.pool.free(evicted)
    hits = [cached_prefix(small, seq + [0]) for seq in seqs]
    assert hits == [8, 0, 0, 0, 0, 0, 0, 8]  # kept: seqs[0], then the newest two; seqs[6] evicted


def test_prefixes_the_store_holds_already_take_no_free_blocks_from_the_file(tmp_path):
    # The file's most recent prefix is cached already; its older one fits in the free blocks
    # and must be restored, not dropped as if the cached copy needed room again.
    recent = [1000 + t for t in range(4 * BS)]
    older = [2000 + t for t in range(4 * BS)]
    source = make_store()
    put(source, older)
    put(source, recent)
    path = tmp_path / "kv.safetensors"
    source.save(path, identity=IDENTITY)
    store = make_store(num_blocks=8)
    put(store, recent)  # 4 blocks cached, 4 free
    result = store.restore(path, identity=IDENTITY)
    store.check_invariants()
    assert (result.restored_blocks, result.duplicate_tokens, result.dropped_blocks) == (4, 4 * BS, 0)
    assert cached_prefix(store, older) == len(older) and cached_prefix(store, recent) == len(recent)
    stats = store.stats()
    assert stats["free_blocks"] == 0 and stats["cached_blocks"] == 8


def test_a_prefix_the_store_holds_needs_no_free_room(tmp_path):
    """A saved node whose whole path is cached already is a duplicate before any copy: it takes
    no free block, and its children still fit (task prompts pinned before a start-up restore)."""
    big = make_store(64)
    parent = list(range(500, 508))  # its own node: 2 blocks
    child = parent + list(range(600, 608))  # 2 more below it
    put(big, parent)
    put(big, child)
    path = tmp_path / "nested.safetensors"
    big.save(path)
    small = make_store(4)
    put(small, parent)  # 2 blocks cached, 2 free: room for the child only
    result = small.restore(path)
    small.check_invariants()
    assert (result.restored_blocks, result.duplicate_tokens, result.dropped_blocks) == (2, 8, 0)
    assert cached_prefix(small, child + [0]) == 16
    stats = small.stats()
    assert stats["free_blocks"] == 0 and stats["cached_blocks"] == 4


def test_nothing_cached_is_evicted_to_make_room(saved):
    store = make_store(6)
    put(store, list(range(300, 320)))  # 5 of the 6 blocks
    result = store.restore(saved, identity=IDENTITY)
    assert result.restored_blocks == 1 and cached_prefix(store, list(range(300, 321))) == 20
    store.check_invariants()


# -- faults: every one refused, nothing changed ----------------------------------------------
def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _header_len(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


FAULTS = {
    "empty": (lambda p: _truncate(p, 0), CorruptCacheFile, "empty"),
    "header only": (lambda p: _truncate(p, 8 + _header_len(p)), CorruptCacheFile, "safetensors"),
    "truncated by one byte": (
        lambda p: _truncate(p, os.path.getsize(p) - 1),
        CorruptCacheFile,
        "safetensors",
    ),
    "four bytes": (lambda p: _truncate(p, 4), CorruptCacheFile, "safetensors"),
    "bytes appended": (lambda p: open(p, "ab").write(b"\0" * 8), CorruptCacheFile, "extended"),
    "last KV byte flipped": (lambda p: _flip(p, os.path.getsize(p) - 1), CorruptCacheFile, "checksum"),
    "first data byte flipped": (lambda p: _flip(p, 8 + _header_len(p)), CorruptCacheFile, "checksum"),
    "middle byte flipped": (
        lambda p: _flip(p, (8 + _header_len(p) + os.path.getsize(p)) // 2),
        CorruptCacheFile,
        "checksum",
    ),
    "manifest bit flipped": (lambda p: _flip_in_manifest(p), CorruptCacheFile, "manifest"),
}


def _flip_in_manifest(path: str) -> None:
    with open(path, "rb") as f:
        raw = f.read()
    at = raw.index(b"tenant:a")  # a namespace: a flip here must not move a tenant's prefixes
    _flip(path, at + 7)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_file_is_refused_and_changes_nothing(full_store, saved, fault):
    damage, error, message = FAULTS[fault]
    damage(saved)
    store = make_store()
    put(store, list(range(10, 18)))
    before = state(store)
    with pytest.raises(error, match=message):
        store.restore(saved, identity=IDENTITY)
    assert_same_state(before, state(store))
    store.check_invariants()
    assert cached_prefix(store, list(range(10, 30))) == 8


def _store_with(specs=SPECS, block_size=BS) -> KVStore:
    return make_store(specs=specs, block_size=block_size)


MISMATCHES = {
    "identity": (lambda: make_store(), {"model": "test", "weights": "abd"}, "identity.weights"),
    "identity key missing": (lambda: make_store(), {"model": "test"}, "identity.weights"),
    "block size": (lambda: _store_with(block_size=8), IDENTITY, "layout.block_size"),
    "dtype": (
        lambda: _store_with((SPECS[0], LayerSpec(1, 4, 6, torch.float16, CPU))),
        IDENTITY,
        r"layout.layers\[1\].dtype",
    ),
    "layer count": (lambda: _store_with(SPECS[:1]), IDENTITY, "layout.layers"),
    "head dim": (
        lambda: _store_with((SPECS[0], LayerSpec(1, 4, 8, torch.bfloat16, CPU))),
        IDENTITY,
        "v_head_dim",
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_a_file_for_another_model_or_layout_is_refused(saved, case):
    build, identity, message = MISMATCHES[case]
    store = build()
    put(store, list(range(10, 18)))
    before = state(store)
    with pytest.raises(CacheFileMismatch, match=message):
        store.restore(saved, identity=identity)
    assert_same_state(before, state(store))
    store.check_invariants()


def test_another_format_version_is_refused(full_store, tmp_path, monkeypatch):
    path = tmp_path / "v4.safetensors"
    monkeypatch.setattr(persist, "FORMAT_VERSION", 4)
    full_store.save(path, identity=IDENTITY)
    monkeypatch.undo()
    store = make_store()
    with pytest.raises(CacheFileMismatch, match="format version 4; this radixkv reads versions 1, 2, 3"):
        store.restore(path, identity=IDENTITY)
    assert store.stats()["cached_blocks"] == 0
    store.check_invariants()


def test_a_format_2_file_still_restores(full_store, tmp_path, monkeypatch):
    """A store without states writes what format 2 wrote, but for the version number: a file
    written before format 3 (snapshots) restores into a plain store as it did."""
    path = tmp_path / "v2.safetensors"
    full_store.save(path, identity=IDENTITY)
    monkeypatch.setattr(persist, "FORMAT_VERSION", 2)
    old = tmp_path / "old.safetensors"
    full_store.save(old, identity=IDENTITY)
    monkeypatch.undo()
    new_manifest, old_manifest = cache_file.read_manifest(path), cache_file.read_manifest(old)
    assert (new_manifest.pop("version"), old_manifest.pop("version")) == (3, 2)
    assert new_manifest == old_manifest  # same layout, counts and checksums: the same tensors
    store = make_store()
    result = store.restore(old, identity=IDENTITY)
    assert result.restored_blocks == full_store.stats()["cached_blocks"] and result.num_snapshots == 0
    for ns, seqs in SEQS.items():
        for seq in seqs:
            assert cached_prefix(store, seq + [1], ns) == len(seq) // BS * BS
    store.check_invariants()


def test_other_files_are_refused(tmp_path):
    store = make_store()
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, plain)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(os.urandom(4096))
    for path, message in ((plain, "without a radixkv manifest"), (garbage, "safetensors")):
        with pytest.raises(CorruptCacheFile, match=message):
            store.restore(path)
    with pytest.raises(FileNotFoundError):
        store.restore(tmp_path / "missing")
    assert store.stats()["cached_blocks"] == 0


def test_a_forged_structure_with_valid_checksums_is_refused(full_store, tmp_path):
    """Tensors rewritten with matching checksums (a bug, not a bit flip): the tree checks catch it."""
    path = str(tmp_path / "f.safetensors")
    full_store.save(path)
    from safetensors import safe_open

    from radixkv.persist.checksum import tensor_digest
    from radixkv.persist.manifest import from_metadata, to_metadata

    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        manifest = from_metadata(f.metadata())
    tensors["tree.nodes"][1, 0] = 5  # a parent that comes later
    manifest["checksums"]["tree.nodes"] = tensor_digest(tensors["tree.nodes"])
    save_file(tensors, path, metadata=to_metadata(manifest))
    store = make_store()
    with pytest.raises(CorruptCacheFile, match="parent"):
        store.restore(path)
    store.check_invariants()
    assert MANIFEST_KEY in to_metadata(manifest)


# -- atomic saves ----------------------------------------------------------------------------
def test_a_crash_mid_save_leaves_the_previous_file(full_store, saved, monkeypatch):
    before = open(saved, "rb").read()

    def half_write(tensors, metadata, path, *args):
        with open(path, "wb") as f:
            f.write(before[: len(before) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_write, "_write_tensors", half_write)
    put(full_store, list(range(500, 520)))
    with pytest.raises(OSError, match="No space"):
        full_store.save(saved, identity=IDENTITY)
    monkeypatch.undo()
    assert open(saved, "rb").read() == before
    assert os.listdir(os.path.dirname(saved)) == [os.path.basename(saved)]
    store = make_store()
    store.restore(saved, identity=IDENTITY)
    assert cached_prefix(store, list(range(10, 31))) == 20


def test_a_failed_fsync_leaves_the_previous_file(full_store, saved, monkeypatch):
    before = open(saved, "rb").read()

    def fail(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(cache_write.os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output"):
        full_store.save(saved)
    monkeypatch.undo()
    assert open(saved, "rb").read() == before
    assert os.listdir(os.path.dirname(saved)) == [os.path.basename(saved)]


def test_identity_must_be_json(full_store, tmp_path):
    with pytest.raises(ValueError, match="JSON"):
        full_store.save(tmp_path / "x", identity={"w": object()})
    assert list(tmp_path.iterdir()) == []


def test_errors_are_value_errors():
    assert issubclass(CacheFileError, ValueError) and issubclass(CorruptCacheFile, CacheFileError)


def test_a_file_cut_short_while_it_is_read_is_refused(full_store, saved, monkeypatch):
    """Someone copies another file over the cache file in place during a restore."""
    read_header = cache_file._read_header

    def then_truncate(f, size, path):
        header = read_header(f, size, path)
        _truncate(path, size // 2)
        return header

    monkeypatch.setattr(cache_file, "_read_header", then_truncate)
    store = make_store()
    with pytest.raises(CorruptCacheFile, match="ended inside a tensor"):
        store.restore(saved, identity=IDENTITY)
    assert store.stats()["cached_blocks"] == 0 and store.stats()["free_blocks"] == 64
    store.check_invariants()


def test_an_interrupted_insert_leaks_no_block(saved, monkeypatch):
    store = make_store()
    calls = []
    insert = store.tree.insert

    def interrupted(tokens, block_ids, namespace=None, *tier):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(namespace)
        return insert(tokens, block_ids, namespace, *tier)

    monkeypatch.setattr(store.tree, "insert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.restore(saved, identity=IDENTITY)
    monkeypatch.undo()
    store.check_invariants()  # the two paths inserted own their blocks; the rest are free again
    stats = store.stats()
    assert stats["cached_blocks"] > 0 and stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]


@pytest.mark.parametrize("meanwhile", ["flush", "pressure"])
def test_the_store_changing_during_a_save_neither_corrupts_the_file_nor_leaks(
    full_store, tmp_path, monkeypatch, meanwhile
):
    """The blocks are written after the lock is released: pins must keep them as they were."""
    write = cache_write._write_tensors
    before = {b for n in full_store.tree.iter_nodes() for b in n.block_ids}

    def busy_write(tensors, manifest, path, *args):
        if meanwhile == "flush":
            full_store.flush()
        for i in range(40):  # new prefixes want every free block and then some
            put(full_store, [5000 + 100 * i + j for j in range(12)])
        assert before <= full_store.pool.used_blocks()  # nothing saved was evicted or reused
        write(tensors, manifest, path, *args)

    monkeypatch.setattr(cache_write, "_write_tensors", busy_write)
    path = tmp_path / "busy.safetensors"
    full_store.save(path, identity=IDENTITY)
    monkeypatch.undo()
    full_store.check_invariants()
    stats = full_store.stats()
    assert stats["pinned_blocks"] == 0 and stats["retired_blocks"] == 0
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"]
    fresh = make_store()
    fresh.restore(path, identity=IDENTITY)
    for ns, seqs in SEQS.items():
        for seq in seqs:
            assert cached_prefix(fresh, seq + [1], ns) == len(seq) // BS * BS
