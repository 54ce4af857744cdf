"""radixkv.l2's file: backend (a shared directory): round trip, two clients, refused values,
atomic replacement under concurrent readers, a directory that goes away, a full disk."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time

import pytest

from radixkv.l2 import HEADER_BYTES, block_keys, open_l2
from radixkv.l2.value_format import digest16, pack

ID_A, ID_B = b"model-a", b"model-b"


def test_round_trip_two_clients_and_misses(tmp_path):
    a = open_l2(f"file:{tmp_path}", identity=ID_A)
    b = open_l2(f"file://{tmp_path}", identity=ID_A)  # another machine mounting the same directory
    keys = block_keys(ID_A, b"doc", list(range(64)), 16)
    payloads = [os.urandom(10_000 + i) for i in range(4)]
    assert a.put_many(list(zip(keys, payloads))) == 4
    got = b.get_many(keys + block_keys(ID_A, b"nothing", list(range(16)), 16))
    assert [bytes(g) for g in got[:4]] == payloads and got[4] is None
    assert b.get_many(block_keys(ID_B, b"doc", list(range(64)), 16), identity=ID_B) == [None] * 4
    assert a.put_many(list(zip(keys, payloads))) == 4  # rewriting a key replaces it whole
    assert b.stats()["hits"] == 4 and a.stats()["writes"] == 8
    files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) == 4 and not [f for f in files if f.endswith(".tmp")]
    assert oct(os.stat(a.path_of(keys[0])).st_mode & 0o777) == "0o600"
    pieces = [os.urandom(100) for _ in range(700)]  # more buffers than one writev takes
    assert a.put_many([(keys[0], pieces)]) == 1 and bytes(b.get_many([keys[0]])[0]) == b"".join(pieces)
    long_key = b"k" * 500  # any key up to 1 KiB: named by its digest
    assert a.put_many([(long_key, b"long")]) == 1 and bytes(b.get_many([long_key])[0]) == b"long"


def test_damaged_and_foreign_files_are_refused(tmp_path, caplog):
    s = open_l2(f"file:{tmp_path}", identity=ID_A)
    keys = block_keys(ID_A, b"damage", list(range(16 * 5)), 16)
    payloads = [os.urandom(3000) for _ in keys]
    assert s.put_many(list(zip(keys, payloads))) == 5
    paths = [s.path_of(k) for k in keys]
    with open(paths[0], "r+b") as f:  # one flipped byte
        f.seek(HEADER_BYTES + 7)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 7)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(paths[1], 2000)  # truncated
    shutil.copy(paths[3], paths[2])  # another key's sound value
    other = open_l2(f"file:{tmp_path}", identity=ID_B)
    with pytest.raises(ValueError, match="another identity"):
        other.put_many([(keys[4], b"model b")])
    with open(paths[4], "wb") as f:  # model B's value under A's key, written behind our back
        f.write(pack(digest16(ID_B), keys[4], memoryview(b"model b")))
    with caplog.at_level(logging.WARNING, logger="radixkv.l2.health"):
        got = s.get_many(keys)
    assert got == [None, None, None, payloads[3], None]
    assert s.stats()["refused"] == 4 and s.stats()["errors"] == 0
    assert sum("refused" in r.getMessage() for r in caplog.records) == 4  # four kinds, once each


def test_readers_never_see_a_partial_file(tmp_path):
    """Writers keep replacing one key with 1 MiB values while readers read it: every read is a
    whole value of one writer (never refused, never mixed)."""
    s = open_l2(f"file:{tmp_path}", identity=ID_A)
    key = block_keys(ID_A, b"atomic", list(range(16)), 16)[0]
    values = [bytes([i]) * (1024 * 1024) for i in range(1, 5)]
    stop, failures, seen = threading.Event(), [], set()

    def writer(v):
        while not stop.is_set():
            s.put_many([(key, v)])

    def reader():
        try:
            for _ in range(150):
                (got,) = s.get_many([key])
                if got is not None:
                    data = bytes(got)
                    assert data in values
                    seen.add(data[0])
        except BaseException as exc:
            failures.append(exc)

    writers = [threading.Thread(target=writer, args=(v,)) for v in values]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in readers:
        t.join()
    stop.set()
    for t in writers:
        t.join()
    assert not failures, failures
    assert s.stats()["refused"] == 0 and seen
    # a writer killed mid-write leaves only a temp file, which no read ever opens
    with open(os.path.join(os.path.dirname(s.path_of(key)), ".crashed.tmp"), "wb") as f:
        f.write(b"half")
    assert bytes(s.get_many([key])[0]) in values


def test_directory_gone_is_an_outage(tmp_path, caplog):
    root = tmp_path / "mnt"
    root.mkdir()
    s = open_l2(f"file:{root}", identity=ID_A, backoff_s=0.05, backoff_max_s=0.1)
    keys = block_keys(ID_A, b"gone", list(range(32)), 16)
    assert s.put_many([(keys[0], b"v")]) == 1
    shutil.rmtree(root)  # unmounted
    with caplog.at_level(logging.WARNING, logger="radixkv.l2.health"):
        assert s.get_many(keys) == [None, None]
        assert s.put_many([(keys[1], b"w")]) == 0
    assert not root.exists()  # a write never creates the directory itself
    assert s.stats()["down"] == 1 and s.stats()["outages"] == 1
    root.mkdir()  # mounted again
    time.sleep(0.15)
    assert s.put_many([(keys[1], b"w")]) == 1 and bytes(s.get_many([keys[1]])[0]) == b"w"
    assert s.stats()["down"] == 0
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1


def test_full_filesystem_is_counted(tmp_path, monkeypatch, caplog):
    s = open_l2(f"file:{tmp_path}", identity=ID_A)
    keys = block_keys(ID_A, b"full", list(range(48)), 16)
    real_writev = os.writev
    calls = []

    def writev_until_full(fd, parts):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_writev(fd, parts)

    monkeypatch.setattr(os, "writev", writev_until_full)
    with caplog.at_level(logging.WARNING, logger="radixkv.l2.health"):
        assert s.put_many([(k, b"x" * 100) for k in keys]) == 1
    monkeypatch.undo()
    assert s.stats()["errors"] == 2 and s.stats()["down"] == 0
    assert [g is not None for g in s.get_many(keys)] == [True, False, False]
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]  # cleaned up
    assert sum("rejects writes" in r.getMessage() for r in caplog.records) == 1


def test_hostile_paths_are_refused_without_blocking(tmp_path):
    """A FIFO, a symlink, a directory or an oversized file where a block should be: refused
    (never followed, never blocked on, never read whole); the reader goes on."""
    s = open_l2(f"file:{tmp_path}", identity=ID_A, max_value_bytes=1 << 20)
    keys = block_keys(ID_A, b"hostile", list(range(16 * 5)), 16)
    assert s.put_many([(keys[0], b"sound")]) == 1
    sound = s.path_of(keys[0])
    paths = [s.path_of(k) for k in keys]
    for p in paths[1:]:
        os.makedirs(os.path.dirname(p), exist_ok=True)
    os.mkfifo(paths[1])  # opening it to read would block without O_NONBLOCK
    os.symlink(sound, paths[2])  # a sound value, but through a link someone planted
    os.mkdir(paths[3])
    with open(paths[4], "wb") as f:
        f.truncate(2 << 20)  # over max_value_bytes: not read
    got = s.get_many(keys)
    assert bytes(got[0]) == b"sound" and got[1:] == [None] * 4
    assert s.stats()["refused"] == 4 and s.stats()["errors"] == 0
    assert s.put_many([(keys[4], bytes(2 << 20))]) == 0 and s.stats()["errors"] == 1  # not written either
    assert s.put_many([(keys[2], b"replaced")]) == 1  # a write replaces the planted link itself
    assert os.path.islink(paths[2]) is False and bytes(s.get_many([keys[2]])[0]) == b"replaced"
    assert open(sound, "rb").read().endswith(b"sound")  # the link's target was not written through


def test_a_planted_directory_link_is_not_followed(tmp_path):
    """A fan-out directory replaced by a symlink to somewhere else: reads refuse it, writes
    never land outside DIR."""
    root, elsewhere = tmp_path / "l2", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    s = open_l2(f"file:{root}", identity=ID_A)
    key = block_keys(ID_A, b"link", list(range(16)), 16)[0]
    assert s.put_many([(key, b"v")]) == 1
    top = os.path.dirname(os.path.dirname(s.path_of(key)))
    shutil.move(top, elsewhere / "moved")
    os.symlink(elsewhere / "moved", top)  # DIR/ab -> elsewhere/moved (which holds a sound value)
    assert s.get_many([key]) == [None] and s.stats()["refused"] == 1
    assert s.put_many([(key, b"w")]) == 0 and s.stats()["errors"] == 1
    moved = [os.path.join(d, f) for d, _, fs in os.walk(elsewhere) for f in fs]
    assert len(moved) == 1 and open(moved[0], "rb").read().endswith(b"v")  # untouched
