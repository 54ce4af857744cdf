"""The save at shutdown (--cache-save-timeout): the most recent prefixes that fit the time,
the previous file when the time is too short, a periodic save cancelled for it; the admin
restore's evict option; temporary files of killed saves removed at start.

A "restart" is a new engine and app on the same cache file (tests/test_demo_restart.py does it
with real processes and SIGTERM); hits are checked as exact cached_tokens.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

import demo.cache_files as cache_files
import demo.shutdown_save as shutdown_save
import radixkv.persist.cache_write as cache_write
from demo.config import from_args
from tests.test_demo_cache_files import ADMIN, BLOCK, app, cached, chat, doc, engine

QUESTION = "Who is Bruno 3?"


def files_of(client) -> cache_files.CacheFiles:
    return client.application.extensions["radixkv"]["cache_files"]


def expected_hit(eng, saved_text: str) -> int:
    """cached_tokens of ``saved_text + QUESTION`` when ``saved_text``'s chat is in the store."""
    first = eng.chat_ids([{"role": "user", "content": saved_text}])
    second = eng.chat_ids([{"role": "user", "content": saved_text + QUESTION}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    return shared // BLOCK * BLOCK


def blocks_of(eng, text: str) -> int:
    """Blocks a 4-token chat about ``text`` commits (prompt and the 3 reply tokens fed back)."""
    return (len(eng.chat_ids([{"role": "user", "content": text}])) + 3) // BLOCK


def rate_for(max_bytes: float, seconds_left: float, share: float) -> float:
    """The throughput that makes a save of ``seconds_left`` plan ``max_bytes``."""
    return max_bytes / ((seconds_left - shutdown_save.EXIT_MARGIN) * share)


def test_the_shutdown_save_keeps_the_most_recent_prefixes_that_fit(tmp_path, caplog):
    path = str(tmp_path / "kv.safetensors")
    eng = engine()
    c = app(eng, cache_file=path)
    texts = [doc() for _ in range(3)]
    for text in texts:  # the last one is the most recent
        chat(c, text)
    files = files_of(c)
    block = eng.store.pool.bytes_per_token * BLOCK
    budget = (blocks_of(eng, texts[2]) + blocks_of(eng, texts[1]) // 2) * block  # one chat and a half
    files.rate = rate_for(budget, 100, shutdown_save.SAFETY)
    with caplog.at_level(logging.INFO, logger="demo.shutdown_save"):
        files.save_at_exit(time.monotonic() + 100)
    line = next(r.getMessage() for r in caplog.records if "shutdown save to" in r.getMessage())
    assert f"saved {blocks_of(eng, texts[2]) * BLOCK} tokens" in line and "skipped 0 " not in line, line

    restarted = engine()
    c2 = app(restarted, cache_file=path)
    hits = [cached(chat(c2, text + QUESTION)) for text in reversed(texts)]
    assert hits == [expected_hit(restarted, texts[2]), 0, 0]


def test_a_save_that_cannot_finish_in_time_leaves_the_previous_file(tmp_path, monkeypatch, caplog):
    path = tmp_path / "kv.safetensors"
    eng = engine()
    c = app(eng, cache_file=str(path))
    old, new = doc(), doc()
    chat(c, old)
    files = files_of(c)
    files.save()
    before = path.read_bytes()
    chat(c, new)
    write = cache_write._write_tensors

    def slow_disk(tensors, manifest, tmp, times, stop, *pace):
        while stop() is None:  # the disk is slower than estimated: the deadline passes
            time.sleep(0.01)
        write(tensors, manifest, tmp, times, stop, *pace)

    monkeypatch.setattr(cache_write, "_write_tensors", slow_disk)
    started = time.monotonic()
    deadline = started + shutdown_save.EXIT_MARGIN + 0.3
    with caplog.at_level(logging.INFO, logger="demo.shutdown_save"):
        files.save_at_exit(deadline)
    assert time.monotonic() < deadline  # done before the deadline, with the exit margin left
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["kv.safetensors"]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "deadline passed" in messages and "nothing saved" in messages

    restarted = engine()
    c2 = app(restarted, cache_file=str(path))
    assert cached(chat(c2, new + QUESTION)) == 0
    assert cached(chat(c2, old + QUESTION)) == expected_hit(restarted, old)


def test_with_no_throughput_measured_a_first_save_measures_it(tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "kv.safetensors")
    eng = engine()
    c = app(eng, cache_file=path)
    texts = [doc() for _ in range(3)]
    for text in texts:
        chat(c, text)
    files = files_of(c)
    assert files.rate is None
    block = eng.store.pool.bytes_per_token * BLOCK
    probe = blocks_of(eng, texts[2]) * block  # the first save holds the most recent chat only
    monkeypatch.setattr(shutdown_save, "PROBE_RATE", rate_for(probe * 1.2, 100, shutdown_save.PROBE_SHARE))
    saves = []
    save = files.save
    monkeypatch.setattr(files, "save", lambda *a, **k: saves.append(save(*a, **k)) or saves[-1])
    with caplog.at_level(logging.INFO, logger="demo.shutdown_save"):
        files.save_at_exit(time.monotonic() + 100)
    assert [s["skipped_blocks"] > 0 for s in saves] == [True, False]  # then all of it
    restarted = engine()
    c2 = app(restarted, cache_file=path)
    assert [cached(chat(c2, t + QUESTION)) for t in texts] == [expected_hit(restarted, t) for t in texts]


def test_a_periodic_save_running_at_shutdown_is_cancelled(tmp_path, monkeypatch):
    path = tmp_path / "kv.safetensors"
    c = app(engine(), cache_file=str(path), cache_save_every=0.05)
    text = doc()
    files = files_of(c)
    write = cache_write._write_tensors
    running = threading.Event()
    calls = []

    def stuck(tensors, manifest, tmp, times, stop, *pace):
        calls.append(stop)
        if len(calls) == 1:  # the periodic save: stuck on a slow disk until cancelled
            running.set()
            while stop() is None:
                time.sleep(0.01)
        write(tensors, manifest, tmp, times, stop, *pace)

    monkeypatch.setattr(cache_write, "_write_tensors", stuck)
    chat(c, text)
    assert running.wait(20)
    started = time.monotonic()
    files.save_at_exit(started + 30)
    assert time.monotonic() - started < 10  # the periodic save stopped at once
    assert not files._thread.is_alive() and len(calls) == 2  # cancelled, then the final save
    restarted = engine()
    c2 = app(restarted, cache_file=str(path))
    assert cached(chat(c2, text + QUESTION)) == expected_hit(restarted, text)


def test_the_admin_restore_never_evicts_unless_asked(tmp_path):
    def small():
        from demo.api.app import build_engine
        from demo.config import Config

        return build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=48 * BLOCK))

    texts = [doc() for _ in range(2)]
    first = small()
    c = app(first, cache_dir=str(tmp_path))
    for text in texts:
        chat(c, text)
    assert c.post("/v1/cache/save", json={"name": "a"}, headers=ADMIN).status_code == 200
    other = small()
    c2 = app(other, cache_dir=str(tmp_path))
    for _ in range(2):
        chat(c2, doc())  # fills the pool with other chats
    for body in ({"name": "a", "evict": "yes"}, {"name": "a", "evict": 1}, {"name": "a", "other": True}):
        r = c2.post("/v1/cache/restore", json=body, headers=ADMIN)
        assert r.status_code == 400, r.get_json()
    default = c2.post("/v1/cache/restore", json={"name": "a"}, headers=ADMIN).get_json()
    assert default["evicted_blocks"] == 0 and default["dropped_blocks"] > 0
    made_room = c2.post("/v1/cache/restore", json={"name": "a", "evict": True}, headers=ADMIN).get_json()
    assert made_room["evicted_blocks"] > 0 and made_room["dropped_blocks"] == 0, made_room
    other.check_invariants()
    assert cached(chat(c2, texts[1] + QUESTION)) == expected_hit(other, texts[1])


def test_temporary_files_of_killed_saves_are_removed_at_start(tmp_path):
    path = tmp_path / "kv.safetensors"
    stale = tmp_path / ".kv.safetensors.k2j4_x.tmp"
    kept = [tmp_path / ".other.safetensors.abc.tmp", tmp_path / "kv.safetensors.tmp"]
    for p in (stale, *kept):
        p.write_bytes(b"partial")
    app(engine(), cache_file=str(path))
    assert not stale.exists() and all(p.exists() for p in kept)


def test_save_timeout_flag_and_environment():
    assert from_args([], {}).cache_save_timeout == 25.0
    assert from_args([], {"RADIXKV_CACHE_SAVE_TIMEOUT": "7.5"}).cache_save_timeout == 7.5
    assert (
        from_args(["--cache-save-timeout", "10"], {"RADIXKV_CACHE_SAVE_TIMEOUT": "7"}).cache_save_timeout
        == 10
    )
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ValueError, match="cache_save_timeout must be > 0"):
            from_args(["--cache-save-timeout", bad], {})
