"""The cache file's I/O paths: runs written in place or gathered, small chunks, a failing writer,
deadlines and cancels, the most recent prefixes that fit ``max_bytes``, the checksum named in
the manifest.

Each path is checked by what a fresh store restores from the file (tests/test_persist.py's
``cached_prefix`` reads the KV back and compares it with the values committed), and files
written by different paths must be byte for byte the same.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

import radixkv.persist.cache_read as cache_read
import radixkv.persist.cache_write as cache_write
import radixkv.persist.file_io as file_io
from radixkv import CacheFileMismatch, CorruptCacheFile, SaveAborted
from radixkv.persist.cache_file import read_manifest
from radixkv.persist.manifest import to_metadata
from tests.test_persist import BS, IDENTITY, cached_prefix, make_store, put
from tests.test_persist_room import make_tiered

DOCS = [[1000 * i + t for t in range((i % 3 + 2) * BS)] for i in range(1, 13)]


def fragmented_store():
    """Documents whose blocks are scattered over the pool and over two tiers (evictions and
    demotions between commits), with runs of consecutive ids of several lengths."""
    store = make_tiered(device_blocks=24, host_blocks=32)
    for i, d in enumerate(DOCS):
        put(store, d)
        if i % 4 == 3:
            cached_prefix(store, DOCS[i - 2])  # touched: the LRU order differs from the commit order
    assert store.stats()["demoted_blocks"] > 0
    return store


def restored_hits(path) -> list[int]:
    fresh = make_store(64)
    fresh.restore(path, identity=IDENTITY)
    fresh.check_invariants()
    return [cached_prefix(fresh, d) for d in DOCS]


@pytest.mark.parametrize("chunk", [cache_write.CHUNK, 1000])
def test_runs_in_place_and_gathered_blocks_write_the_same_file(tmp_path, monkeypatch, chunk):
    store = fragmented_store()
    expected = [store.tree.cached_prefix(d)[0] for d in DOCS]
    files = []
    monkeypatch.setattr(cache_write, "CHUNK", chunk)
    # Every run written in place / every block gathered / runs and blocks copied out as from a
    # GPU pool (forced here on CPU pools).
    for min_run, host in ((1, True), (10**9, True), (1, False), (10**9, False)):
        monkeypatch.setattr(cache_write, "MIN_RUN_BYTES", min_run)
        monkeypatch.setattr(cache_write, "_host_memory", lambda storage, host=host: host)
        files.append(tmp_path / f"{min_run}-{host}.safetensors")
        store.save(files[-1], identity=IDENTITY)
    assert all(f.read_bytes() == files[0].read_bytes() for f in files[1:])
    monkeypatch.setattr(cache_read, "CHUNK", 700)  # pieces that are no multiple of a block
    assert restored_hits(files[0]) == expected
    store.check_invariants()
    assert store.stats()["pinned_blocks"] == 0


def test_the_manifest_names_the_checksum_and_another_one_is_refused(tmp_path):
    store = make_store()
    put(store, DOCS[0])
    path = str(tmp_path / "kv.safetensors")
    store.save(path, identity=IDENTITY)
    manifest = read_manifest(path)
    assert (manifest["version"], manifest["checksum"]) == (3, "blake3")
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for algorithm, error, message in (
        ("md5", CacheFileMismatch, "checksums use 'md5'; this radixkv checks blake3, sha256"),
        (None, CorruptCacheFile, "names no checksum"),
    ):
        manifest["checksum"] = algorithm
        save_file(tensors, path, metadata=to_metadata(manifest))
        target = make_store()
        with pytest.raises(error, match=message):
            target.restore(path, identity=IDENTITY)
        assert target.stats()["cached_blocks"] == 0 and target.stats()["free_blocks"] == 64


class _FailingFile:
    """A file whose third write fails, as on a full disk."""

    def __init__(self, f) -> None:
        self._f, self.writes = f, 0

    def write(self, data):
        self.writes += 1
        if self.writes == 3:
            raise OSError(28, "No space left on device")
        return self._f.write(data)


def test_a_write_failing_in_the_writer_thread_leaves_the_previous_file(tmp_path, monkeypatch):
    store = fragmented_store()
    path = tmp_path / "kv.safetensors"
    store.save(path, identity=IDENTITY)
    before = path.read_bytes()
    put(store, [5, 6, 7, 8] * 4)
    monkeypatch.setattr(cache_write, "CHUNK", 512)  # many chunks: the failure is mid-file
    writer = file_io.Writer
    monkeypatch.setattr(cache_write, "Writer", lambda f, *a, **k: writer(_FailingFile(f), *a, **k))
    with pytest.raises(OSError, match="No space"):
        store.save(path, identity=IDENTITY)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors"]
    assert store.stats()["pinned_blocks"] == 0
    store.check_invariants()


def test_a_save_past_its_deadline_or_cancelled_leaves_the_previous_file(tmp_path, monkeypatch):
    store = fragmented_store()
    path = tmp_path / "kv.safetensors"
    store.save(path, identity=IDENTITY, deadline=time.monotonic() + 3600)  # in time: a whole file
    assert restored_hits(path) == [store.tree.cached_prefix(d)[0] for d in DOCS]
    before = path.read_bytes()
    with pytest.raises(SaveAborted, match="deadline passed"):
        store.save(path, identity=IDENTITY, deadline=time.monotonic())
    assert path.read_bytes() == before

    # Cancelled in the middle of the KV, as a shutdown cancels a periodic save.
    cancel = threading.Event()
    monkeypatch.setattr(cache_write, "CHUNK", 512)
    put_chunk = file_io.Writer.put
    chunks = []

    def put(self, view, buffer=None):
        chunks.append(len(view))
        if len(chunks) == 5:
            cancel.set()
        put_chunk(self, view, buffer)

    monkeypatch.setattr(file_io.Writer, "put", put)
    with pytest.raises(SaveAborted, match="cancelled"):
        store.save(path, identity=IDENTITY, cancel=cancel)
    assert len(chunks) == 5
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["kv.safetensors"]
    assert store.stats()["pinned_blocks"] == 0
    store.check_invariants()


def test_max_bytes_keeps_the_most_recently_used_prefixes_with_their_parents(tmp_path):
    store = make_store(64)
    system = [7] * (2 * BS)
    a, b, c = system + [1] * BS, system + [2] * (3 * BS), [3] * (2 * BS)
    for seq in (c, a, b):  # b is the most recent, then a (and system, their parent), then c
        put(store, seq)
    block = BS * store.pool.bytes_per_token
    path = tmp_path / "kv.safetensors"
    cases = {
        0: (0, 0, 0),
        4 * block: (len(system), len(a), 0),  # b's tail (3) does not fit after system (2); a's (1) does
        5 * block: (len(b), len(system), 0),  # system + b's tail
        6 * block: (len(b), len(a), 0),  # + a's tail
        7 * block: (len(b), len(a), 0),  # c (2 blocks) does not fit in the 1 left
        8 * block: (len(b), len(a), len(c)),
    }
    for max_bytes, hits in cases.items():
        result = store.save(path, identity=IDENTITY, max_bytes=max_bytes)
        assert result.num_blocks + result.skipped_blocks == 8
        assert result.skipped_tokens == result.skipped_blocks * BS and result.kv_bytes <= max_bytes
        fresh = make_store(64)
        fresh.restore(path, identity=IDENTITY)
        fresh.check_invariants()
        assert (cached_prefix(fresh, b), cached_prefix(fresh, a), cached_prefix(fresh, c)) == hits, max_bytes
    assert store.stats()["pinned_blocks"] == 0


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"max_bytes": -1}, "max_bytes"),
        ({"max_bytes": True}, "max_bytes"),
        ({"max_bytes": 1.5e6}, "max_bytes"),
        ({"max_rate": 0}, "max_rate"),
        ({"max_rate": -5.0}, "max_rate"),
        ({"max_rate": "fast"}, "max_rate"),
    ],
)
def test_a_bad_budget_or_rate_is_refused_and_the_previous_file_kept(tmp_path, kwargs, named):
    # max_bytes=-1 once saved an empty file over the previous one: a typo that lost the cache.
    store = make_store(64)
    seq = [5] * (3 * BS)
    put(store, seq)
    path = tmp_path / "kv.safetensors"
    store.save(path, identity=IDENTITY)
    before = path.read_bytes()
    with pytest.raises(ValueError, match=named):
        store.save(path, identity=IDENTITY, **kwargs)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["kv.safetensors"]
    assert store.stats()["pinned_blocks"] == 0


def test_save_and_restore_say_where_the_time_went(tmp_path):
    store = fragmented_store()
    path = tmp_path / "kv.safetensors"
    saved = store.save(path, identity=IDENTITY)
    assert saved.seconds >= saved.times.total > 0 and saved.times.write > 0 and saved.times.fsync > 0
    restored = make_store(64).restore(path, identity=IDENTITY)
    assert restored.seconds > 0 and restored.times.read > 0 and restored.times.hash > 0
    assert saved.times.hash > 0 and saved.times.gather > 0


@pytest.mark.parametrize("chunk", [cache_read.CHUNK, 2000])
def test_a_restore_into_a_fragmented_pool(tmp_path, monkeypatch, chunk):
    """Free blocks scattered between cached ones (and a free list in no order): short runs are
    read through a buffer and copied on, long ones in place; every block gets exactly its KV."""
    store = fragmented_store()
    path = tmp_path / "kv.safetensors"
    store.save(path, identity=IDENTITY)
    target = make_store(96)
    others = [[90000 + 1000 * i + t for t in range(BS)] for i in range(48)]  # one block each
    for seq in others:
        put(target, seq)
    for seq in others[::2]:
        cached_prefix(target, seq)  # now the more recent half
    target.pool.free(target.tree.evict(24))  # the other half: every other block is free
    target.check_invariants()
    free = target.pool._free[-24:]
    assert all(abs(a - b) > 1 for a, b in zip(sorted(free), sorted(free)[1:]))  # no two adjacent
    monkeypatch.setattr(cache_read, "CHUNK", chunk)
    result = target.restore(path, identity=IDENTITY)
    target.check_invariants()
    expected = [store.tree.cached_prefix(d)[0] for d in DOCS]
    hits = [cached_prefix(target, d) for d in DOCS]
    assert result.dropped_blocks == 0 and hits == expected


def test_max_rate_paces_a_save(tmp_path):
    """A background save at ``max_rate`` takes at least its bytes over that rate (a lower bound:
    it sleeps between chunks), and writes the same file as an unpaced save."""
    store = fragmented_store()
    fast, slow = tmp_path / "fast.safetensors", tmp_path / "slow.safetensors"
    kv = store.save(fast, identity=IDENTITY).kv_bytes
    started = time.monotonic()
    store.save(slow, identity=IDENTITY, max_rate=kv / 0.3)
    assert time.monotonic() - started >= 0.3 * 0.9
    assert fast.read_bytes() == slow.read_bytes()


def test_a_paced_save_stops_at_its_deadline_not_after_its_pause(tmp_path):
    """``max_rate`` sleeps between chunks; a deadline that falls inside such a pause ends the
    save then (a shutdown's deadline), not after the pause."""
    store = make_store(64)
    for d in DOCS[:6]:
        put(store, d)
    path = tmp_path / "kv.safetensors"
    kv = store.save(path, identity=IDENTITY).kv_bytes
    before = path.read_bytes()
    started = time.monotonic()
    with pytest.raises(SaveAborted, match="deadline passed"):
        # Paced to take 300 s: the pause after the first chunk (the node table, ~2% of the
        # bytes) alone would run 5 s past the deadline.
        store.save(path, identity=IDENTITY, max_rate=kv / 300, deadline=started + 0.2)
    assert time.monotonic() - started < 2.0
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["kv.safetensors"]
    assert store.stats()["pinned_blocks"] == 0


@pytest.mark.parametrize("readers", [1, 2, 3])
def test_read_overlapped_consumes_every_piece_in_order(tmp_path, readers):
    """Pieces read in place and through buffers, by one reader or several (each its own
    buffers, reused once consumed): consumed in order, each with its bytes."""
    data = bytes(range(256)) * 64
    path = tmp_path / "data"
    path.write_bytes(data)
    into = bytearray(len(data))
    pieces = []
    for i, at in enumerate(range(0, len(data), 1000)):
        n = min(1000, len(data) - at)
        pieces.append((at, n, memoryview(into)[at : at + n] if i % 3 == 0 else None))
    seen, buffers = [], set()

    def consume(index, view, buffer):
        assert (buffer is None) == (pieces[index][2] is not None)
        if buffer is not None:
            buffers.add(id(buffer))
        seen.append((index, bytes(view)))

    times = file_io.IoTimes()
    with open(path, "rb", buffering=0) as f:
        file_io.read_overlapped(f, pieces, consume, times, 1000, num_buffers=2, readers=readers)
    assert [i for i, _ in seen] == list(range(len(pieces)))
    assert b"".join(b for _, b in seen) == data
    assert all(into[at : at + n] == data[at : at + n] for at, n, v in pieces if v is not None)
    assert times.read > 0 and len(buffers) <= 2 * readers  # each reader's own two buffers, reused


@pytest.mark.parametrize("readers", [1, 2])
def test_read_overlapped_reports_the_first_piece_past_the_end_and_what_consume_raised(tmp_path, readers):
    path = tmp_path / "data"
    path.write_bytes(b"x" * 5000)
    pieces = [(at, 1000, None) for at in range(0, 8000, 1000)]
    consumed = []
    with open(path, "rb", buffering=0) as f, pytest.raises(EOFError, match="byte 5000"):
        file_io.read_overlapped(
            f, pieces, lambda i, v, b: consumed.append(i), file_io.IoTimes(), 1000, readers=readers
        )
    assert consumed == [0, 1, 2, 3, 4]

    def fail(i, view, buffer):
        if i == 2:
            raise ValueError("consume failed")

    with open(path, "rb", buffering=0) as f, pytest.raises(ValueError, match="consume failed"):
        file_io.read_overlapped(f, pieces[:5], fail, file_io.IoTimes(), 1000, readers=readers)
    assert {t.name for t in threading.enumerate()}.isdisjoint(
        {f"radixkv-cache-read-{k}" for k in range(readers)}
    )
