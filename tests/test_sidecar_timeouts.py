"""Sidecar calls under a deadline (client.SidecarTier; the wire itself: test_sidecar_connection.py).

A call that runs out of time is a miss (or a write not made), never a dropped connection: its
reply is owed, read later and undone (a late lease released, a late write aborted). With a real
sidecar process paused (SIGSTOP) and with a socket that accepts and never answers: every output
equals stock generate(), every read is the KV that was written or a miss, nothing is left pinned
in the sidecar, and the warning names the socket and the timeout. No timing assertions:
deadlines are short, checks are on counters.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import threading
import time

import pytest

import hf_patch
from hf_patch.keys.weights import model_scope
from radixkv import pack_tokens
from radixkv.sidecar.connection import SidecarTimeout
from tests.hf_models import assert_same_as_stock, build, ids
from tests.sidecar_process import (
    BS,
    DOC_LEN,
    PROMPT_HIT,
    QUESTION_LEN,
    after_copy,
    prompt_of,
    sidecar_stats,
    start_sidecar,
)

PROMPT_BLOCKS = (DOC_LEN + QUESTION_LEN) // BS


@pytest.fixture
def sidecar(tmp_path):
    """A real sidecar process on ``tmp_path/s.sock``: (path, process); resumed and killed after
    the test, whatever the test did to it (SIGSTOP, SIGKILL)."""
    path = tmp_path / "s.sock"
    proc = start_sidecar(path)
    yield path, proc
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "variable, value",
    [
        ("RADIXKV_SIDECAR_TIMEOUT_S", "0"),
        ("RADIXKV_SIDECAR_TIMEOUT_S", "-1"),
        ("RADIXKV_SIDECAR_TIMEOUT_S", "soon"),
        ("RADIXKV_SIDECAR_TIMEOUT_S", "nan"),
        ("RADIXKV_SIDECAR_CONNECT_TIMEOUT_S", "3601"),
        ("RADIXKV_SIDECAR_WAIT_S", "61"),
    ],
)
def test_bad_timeouts_name_the_variable(monkeypatch, tmp_path, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable):
        hf_patch.build_store(build("llama-sdpa"), block_size=BS, budget_tokens=256, sidecar=tmp_path / "s")


@pytest.mark.parametrize("name", ["timeout_s", "connect_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "10"])
def test_a_tier_refuses_bad_timeouts_naming_them(tmp_path, name, value):
    from radixkv.sidecar.client import SidecarTier

    pool = hf_patch.build_store(build("llama-sdpa"), block_size=BS, budget_tokens=64).pool
    with pytest.raises(ValueError, match=f"{name} must be seconds"):
        SidecarTier(str(tmp_path / "s"), pool, lambda ns: None, **{name: value})


def test_timeouts_from_the_environment_and_their_defaults(monkeypatch, tmp_path):
    model = build("llama-sdpa")
    tier = hf_patch.build_store(model, block_size=BS, budget_tokens=256, sidecar=tmp_path / "s").remote
    assert (tier.timeout_s, tier.connect_timeout_s) == (10.0, 5.0)
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "30")
    monkeypatch.setenv("RADIXKV_SIDECAR_CONNECT_TIMEOUT_S", "0.5")
    tier = hf_patch.build_store(model, block_size=BS, budget_tokens=256, sidecar=tmp_path / "s").remote
    assert (tier.timeout_s, tier.connect_timeout_s) == (30.0, 0.5)


# -- a real sidecar process, paused --------------------------------------------------------
def until_answered(tier, deadline_s: float = 60) -> None:
    """Until the tier's calls are answered again (its late replies read), bounded."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            tier.call({"op": "stats"})
            return
        except SidecarTimeout:
            assert time.monotonic() < deadline, "the sidecar never answered again"
            time.sleep(0.05)


def until_stats(path, **want) -> dict:
    deadline = time.monotonic() + 60
    while True:
        stats = sidecar_stats(path)
        if all(stats[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            assert {k: stats[k] for k in want} == want, stats
            return stats
        time.sleep(0.05)


def test_a_paused_sidecar_costs_misses_never_the_connection_its_pins_or_its_data(
    sidecar, monkeypatch, caplog
):
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "2")  # a live sidecar's calls: ~0.1 ms
    path, proc = sidecar
    model = build("llama-sdpa")
    ns = (model_scope(model), None)
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    assert_same_as_stock(model, ids(prompt_of(50)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30) and a.stats()["sidecar_written_commits"] == 1
    b.remote.call({"op": "stats"})  # B attached
    clients = sidecar_stats(path)["clients"]

    # Paused: B's look-up of the document A wrote waits out 2 s, then B computes it (the
    # sidecar's late answer pins the document for B); the next call skips it at once.
    proc.send_signal(signal.SIGSTOP)
    with caplog.at_level(logging.WARNING, logger="radixkv.sidecar.client"):
        cache, _ = assert_same_as_stock(model, ids(prompt_of(50)), b, max_new_tokens=2, do_sample=False)
        assert cache.cached_tokens == [0]
        assert b.stats()["sidecar_timeouts"] == 1
        cache, _ = assert_same_as_stock(model, ids(prompt_of(51)), b, max_new_tokens=2, do_sample=False)
        assert cache.cached_tokens == [0]
        assert b.remote.flush(30)
    warned = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(warned) == 1 and str(path) in warned[0] and "RADIXKV_SIDECAR_TIMEOUT_S" in warned[0]
    assert "within 2 s" in warned[0]
    stats = b.stats()
    assert stats["sidecar_timeouts"] == 1 and stats["sidecar_skipped_calls"] >= 2  # look-up, writes
    assert stats["sidecar_failed_writes"] == 2

    # Resumed: B's next call reads the late reply and releases its lease; same connection.
    proc.send_signal(signal.SIGCONT)
    until_answered(b.remote)
    stats = b.stats()
    assert stats["sidecar_late_replies"] >= 1 and stats["sidecar_connects"] == 1
    assert stats["sidecar_disconnects"] == 0 and stats["sidecar_connected"] == 1
    until_stats(path, pinned_blocks=0, clients=clients)
    assert_same_as_stock(model, ids(prompt_of(52)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30)
    cache, _ = assert_same_as_stock(model, ids(prompt_of(52)), b, max_new_tokens=2, do_sample=False)
    assert cache.cached_tokens == [PROMPT_HIT] and b.stats()["remote_hit_tokens"] == PROMPT_HIT

    # A write whose alloc times out: its late answer's private blocks are aborted, and the
    # same write made again lands whole; a fresh store reads it equal to stock.
    proc.send_signal(signal.SIGSTOP)
    b.remote.push(pack_tokens(prompt_of(51)), ns)  # B holds it (its write failed above)
    assert b.remote.flush(30) and b.stats()["sidecar_timeouts"] == 2
    proc.send_signal(signal.SIGCONT)
    until_answered(b.remote)
    stats = until_stats(path, open_txns=0, private_blocks=0)
    assert stats["aborted_blocks"] == PROMPT_BLOCKS
    b.remote.push(pack_tokens(prompt_of(51)), ns)
    assert b.remote.flush(30) and b.stats()["sidecar_disconnects"] == 0
    c = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    cache, _ = assert_same_as_stock(model, ids(prompt_of(51)), c, max_new_tokens=2, do_sample=False)
    assert cache.cached_tokens == [PROMPT_HIT]


def test_a_socket_that_accepts_and_never_answers_costs_one_connect_timeout(tmp_path, monkeypatch, caplog):
    """Something listens on the path and never says hello: one call waits out the connect
    timeout, later ones skip it at once (no reconnect storm); when it goes away, the client
    sees the connection fail and carries on."""
    monkeypatch.setenv("RADIXKV_SIDECAR_CONNECT_TIMEOUT_S", "0.5")
    path = str(tmp_path / "mute.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    model = build("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    with caplog.at_level(logging.WARNING, logger="radixkv.sidecar.client"):
        for seed in (60, 61):
            cache, _ = assert_same_as_stock(
                model, ids(prompt_of(seed)), store, max_new_tokens=2, do_sample=False
            )
            assert cache.cached_tokens == [0]
        assert store.remote.flush(30)
    stats = store.stats()
    assert stats["sidecar_timeouts"] == 1 and stats["sidecar_skipped_calls"] >= 3
    assert stats.get("sidecar_connects", 0) == 0 and stats["sidecar_connected"] == 0
    warned = [r.getMessage() for r in caplog.records if "did not answer 'hello'" in r.getMessage()]
    assert len(warned) == 1 and path in warned[0] and "RADIXKV_SIDECAR_CONNECT_TIMEOUT_S" in warned[0]
    listener.close()  # the pending connection is reset; then nothing listens (refused)
    os.unlink(path)
    for seed in (60, 62):
        assert_same_as_stock(model, ids(prompt_of(seed)), store, max_new_tokens=2, do_sample=False)
    assert store.stats()["sidecar_connected"] == 0


def test_a_timed_out_call_leaves_the_tier_usable_by_other_threads(sidecar, monkeypatch):
    """Two threads share one tier's connection: while one waits on the paused sidecar, the
    other's call waits at most its own timeout for the connection (counted, never hung)."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "1")
    path, proc = sidecar
    store = hf_patch.build_store(build("llama-sdpa"), block_size=BS, budget_tokens=256, sidecar=path)
    tier = store.remote
    tier.call({"op": "stats"})
    proc.send_signal(signal.SIGSTOP)
    outcomes = collections.Counter()

    def one():
        try:
            tier.call({"op": "stats"})
            outcomes["answered"] += 1
        except SidecarTimeout as e:
            outcomes["waited" if e.waited else "skipped"] += 1

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert outcomes["answered"] == 0 and outcomes["waited"] >= 1 and sum(outcomes.values()) == 3
    proc.send_signal(signal.SIGCONT)
    until_answered(tier)
    assert store.stats()["sidecar_disconnects"] == 0


def test_a_release_never_waits_behind_a_call_to_a_paused_sidecar(sidecar, monkeypatch):
    """A lease released (end of a request's prefill) while the writer's call waits on a paused
    sidecar returns at once; the release goes out after that call and reaches the sidecar."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "3")
    path, proc = sidecar
    model = build("llama-sdpa")
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    assert_same_as_stock(model, ids(prompt_of(70)), a, max_new_tokens=1, do_sample=False)
    assert a.remote.flush(30)
    held = b.acquire(prompt_of(70), (model_scope(model), None))
    assert held.remote is not None and sidecar_stats(path)["pinned_blocks"] == PROMPT_BLOCKS
    proc.send_signal(signal.SIGSTOP)
    outcome = []

    def wait_on_paused():
        try:
            outcome.append(b.remote.call({"op": "stats"}))
        except Exception as e:  # asserted in the test's thread below
            outcome.append(e)

    waiting = threading.Thread(target=wait_on_paused)
    waiting.start()
    deadline = time.monotonic() + 30
    while not b.remote._lock.locked():  # the call holds the connection, waiting
        assert time.monotonic() < deadline
        time.sleep(0.001)
    held.release()
    assert len(b.remote._tells) == 1  # queued behind the call, which still waits (3 s)
    waiting.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], SidecarTimeout), outcome
    assert outcome[0].waited
    proc.send_signal(signal.SIGCONT)
    until_stats(path, pinned_blocks=0)
    until_answered(b.remote)
    assert b.stats()["sidecar_disconnects"] == 0


def read_kv(store, prompt, ns):
    """(tokens read, K, V) of ``prompt``'s cached prefix in ``store`` (local or sidecar), and
    whether the sidecar served it."""
    import torch

    lease = store.acquire(prompt, ns, count=False)
    try:
        n, remote = lease.num_tokens, lease.remote is not None
        specs = store.pool.layers
        k = [torch.zeros(1, s.num_kv_heads, n, s.k_head_dim, dtype=s.dtype) for s in specs]
        v = [torch.zeros(1, s.num_kv_heads, n, s.v_head_dim, dtype=s.dtype) for s in specs]
        store.read([lease], n, k, v, count=False)
    finally:
        lease.release()
    return n, k, v, remote


def test_reads_while_the_sidecar_pauses_and_resumes_are_right_or_misses(sidecar, monkeypatch):
    """Three threads read documents through one tier while the sidecar is paused and resumed
    six times around a 0.3 s timeout: every read is bit-equal to the KV the writer computed, or
    a miss; at the end no pin, claim or write is left in the sidecar and the connection is the
    first one."""
    import random

    import torch

    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "0.3")
    path, proc = sidecar
    model = build("llama-sdpa")
    ns = (model_scope(model), None)
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    prompts = [prompt_of(seed) for seed in range(80, 84)]
    for prompt in prompts:
        assert_same_as_stock(model, ids(prompt), a, max_new_tokens=1, do_sample=False)
    assert a.remote.flush(30)
    reference = [read_kv(a, p, ns) for p in prompts]
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    stop = threading.Event()
    seen = collections.Counter()
    errors = []

    def reader(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(len(prompts))
            try:
                n, k, v, remote = read_kv(b, prompts[i], ns)
                seen["hit" if remote else "miss"] += 1
                _, rk, rv, _ = reference[i]
                for got, want in zip(k + v, rk + rv):
                    assert torch.equal(got, want[:, :, :n]), f"prompt {i}: {n} tokens differ"
            except Exception as e:  # reported below, with the thread's first failure
                errors.append(e)
                return

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for _ in range(6):
        time.sleep(0.3)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        proc.send_signal(signal.SIGCONT)
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]
    assert seen["hit"] > 0 and seen["miss"] > 0, seen
    until_answered(b.remote)
    until_stats(path, pinned_blocks=0, open_txns=0, claims=0)
    stats = b.stats()
    assert stats["sidecar_timeouts"] > 0 and stats["sidecar_disconnects"] == 0, stats
    assert stats["sidecar_connects"] == 1


def test_a_connection_lost_right_after_a_lookup_is_a_miss_not_a_hit_without_a_pool(sidecar, monkeypatch):
    """The sidecar dies just after answering a match, while a release from another thread is
    queued: the call's own tells (after it lets the lock go) find the connection broken and drop
    it. The lookup is then a miss (or a hit with its pool), never a hit whose pool is None."""
    import torch

    import radixkv.sidecar.connection as connmod

    path, proc = sidecar
    model = build("llama-sdpa")
    ns = (model_scope(model), None)
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    assert_same_as_stock(model, ids(prompt_of(50)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30)
    b.remote.call({"op": "stats"})
    orig = connmod.Connection.call

    def call(self, header, *args, **kw):
        out = orig(self, header, *args, **kw)
        if header.get("op") == "match" and self.counters is b.remote.counters:
            b.remote._tells.append(({"op": "release", "lease": 999}, b.remote._generation))
            proc.kill()
            proc.wait()
        return out

    monkeypatch.setattr(connmod.Connection, "call", call)
    n, k, v, remote = read_kv(b, prompt_of(50), ns)
    assert b.stats()["sidecar_connected"] == 0
    if remote:  # read from the pool the hit was pinned in (still mapped): a's KV
        _, rk, rv, _ = read_kv(a, prompt_of(50), ns)
        for got, want in zip(k + v, rk + rv):
            assert torch.equal(got, want[:, :, :n])
    else:
        assert n == 0


@pytest.mark.parametrize("why", ["owed", "lock", "sent"])
def test_a_commit_never_sent_aborts_its_write(sidecar, monkeypatch, why):
    """The writer's commit is never sent: another thread's reply is owed (the call is refused at
    once), or another thread holds the connection past the timeout. The write is aborted (queued
    with the connection's generation): once the sidecar reads again it holds no open transaction
    and no private block, on the same connection. A commit sent and answered late ("sent": the
    sidecar paused while it waits) still lands; the abort after it does nothing."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "0.5")
    path, proc = sidecar
    model = build("llama-sdpa")
    try:
        a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        release = threading.Event()

        def stall() -> None:
            if why == "sent":  # the commit itself waits out its timeout
                proc.send_signal(signal.SIGSTOP)
            elif why == "owed":  # another thread's call waits out its timeout: its reply is owed
                proc.send_signal(signal.SIGSTOP)
                with pytest.raises(SidecarTimeout):
                    a.remote.call({"op": "stats"})
            else:  # another thread holds the connection past the writer's lock wait
                held = threading.Event()

                def hold():
                    with a.remote._lock:
                        held.set()
                        release.wait(30)

                threading.Thread(target=hold, daemon=True).start()
                held.wait(30)

        after_copy(monkeypatch, stall, once=True)
        assert_same_as_stock(model, ids(prompt_of(50)), a, max_new_tokens=2, do_sample=False)
        assert a.remote.flush(30)
        sent = why == "sent"
        # A commit sent and unanswered is neither written nor failed until its reply is read;
        # a process draining now counts it lost (it may not land).
        counts = ("sidecar_failed_writes", "sidecar_unsettled_writes", "sidecar_written_commits")
        assert tuple(a.stats()[k] for k in counts) == ((0, 1, 0) if sent else (1, 0, 0))
        assert a.remote.drain(0.1) == (0, int(sent))
        release.set()
        proc.send_signal(signal.SIGCONT)
        until_answered(a.remote)
        stats = until_stats(path, open_txns=0, private_blocks=0, pinned_blocks=0)
        assert (stats["cached_blocks"] > 0) == sent, stats
        # It landed late: written (and late), not failed.
        counts += ("sidecar_late_writes",)
        assert tuple(a.stats()[k] for k in counts) == ((0, 0, 1, 1) if sent else (1, 0, 0, 0))
        assert a.stats()["sidecar_written_blocks"] == stats["cached_blocks"]
        assert a.stats()["sidecar_disconnects"] == 0
    finally:
        release.set()


def test_a_commit_unsettled_when_the_sidecar_dies_counts_failed(sidecar, monkeypatch):
    """A commit sent to a paused sidecar is unsettled (neither written nor failed); the sidecar
    is then killed before answering: once the client sees the connection end (the background
    settler, no call needed) the commit counts failed, never written or late."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "0.5")
    path, proc = sidecar
    model = build("llama-sdpa")
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    # the commit after this copy waits out its timeout
    after_copy(monkeypatch, lambda: proc.send_signal(signal.SIGSTOP))
    assert_same_as_stock(model, ids(prompt_of(60)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30)
    counts = ("sidecar_unsettled_writes", "sidecar_failed_writes", "sidecar_written_commits")
    assert tuple(a.stats()[k] for k in counts) == (1, 0, 0)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while a.stats()["sidecar_unsettled_writes"]:
        assert time.monotonic() < deadline, "the settler never saw the connection end"
        time.sleep(0.05)
    stats = a.stats()
    assert tuple(stats[k] for k in counts) == (0, 1, 0)
    assert stats["sidecar_late_writes"] == 0 and stats["sidecar_disconnects"] == 1


def test_a_commit_whose_sidecar_dies_before_its_timeout_counts_failed_once(sidecar, monkeypatch):
    """The sidecar dies while a commit waits for its reply, before the timeout: the call gets a
    broken connection (no late reply owed), so the commit counts failed once and nothing stays
    unsettled (the late-reply callback was registered at send time and counted it twice)."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "20")
    path, proc = sidecar
    model = build("llama-sdpa")
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)

    def stall_then_die() -> None:
        proc.send_signal(signal.SIGSTOP)  # the commit after this copy is sent, not answered
        threading.Timer(0.5, proc.kill).start()  # and the sidecar dies well before 20 s

    after_copy(monkeypatch, stall_then_die)
    assert_same_as_stock(model, ids(prompt_of(61)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(60)
    stats = a.stats()
    assert stats["sidecar_timeouts"] == 0 and stats["sidecar_disconnects"] == 1
    counts = ("sidecar_unsettled_writes", "sidecar_failed_writes", "sidecar_written_commits")
    assert tuple(stats[k] for k in counts) == (0, 1, 0)
    assert stats["sidecar_late_writes"] == 0


@pytest.mark.parametrize("then", ["resume", "close", "no thread"])
def test_an_idle_client_settles_its_late_replies_in_the_background(sidecar, monkeypatch, then):
    """A look-up times out on a paused sidecar; the client makes no other call. Once the sidecar
    reads again, the late reply is read and its lease released in the background (its pins go
    without a next call); a tier closed meanwhile stops that settling. Where no thread can start
    (interpreter shutdown on Python 3.12+), the call is still a miss, the connection's lock is
    let go, and the next call settles."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "0.5")
    path, proc = sidecar
    model = build("llama-sdpa")
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    assert_same_as_stock(model, ids(prompt_of(50)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30)
    b.remote.call({"op": "stats"})
    proc.send_signal(signal.SIGSTOP)
    if then == "no thread":
        start = threading.Thread.start

        def refuse(thread):
            if thread.name == "radixkv-sidecar-settler":
                raise RuntimeError("can't create new thread at interpreter shutdown")
            return start(thread)

        monkeypatch.setattr(threading.Thread, "start", refuse)
    lease = b.acquire(prompt_of(50), (model_scope(model), None))
    assert lease.remote is None and b.stats()["sidecar_timeouts"] == 1
    lease.release()
    if then == "no thread":
        assert b.remote._settler is None and b.remote._lock.acquire(blocking=False)
        b.remote._lock.release()
        monkeypatch.setattr(threading.Thread, "start", start)
        proc.send_signal(signal.SIGCONT)
        until_answered(b.remote)  # the next call reads the late reply and releases its lease
        until_stats(path, pinned_blocks=0)
        assert b.stats()["sidecar_late_replies"] == 1
        return
    settler = b.remote._settler
    assert settler is not None and settler.is_alive()
    if then == "close":
        b.remote.close()
        settler.join(30)
        assert not settler.is_alive()
        proc.send_signal(signal.SIGCONT)  # closing dropped the connection: the sidecar frees it
        until_stats(path, pinned_blocks=0)
        return
    proc.send_signal(signal.SIGCONT)
    until_stats(path, pinned_blocks=0)  # no call from b meanwhile
    settler.join(30)
    assert not settler.is_alive() and b.remote._conn.owed == 0
    stats = b.stats()
    assert stats["sidecar_late_replies"] == 1 and stats["sidecar_disconnects"] == 0, stats


def test_a_call_that_waited_for_the_lock_gets_time_of_its_own_and_owes_nothing(sidecar, monkeypatch):
    """A call whose wait for another thread's call used up its deadline still gets a short
    time of its own on the connection (not a spurious timeout); a call that never got the
    connection owes no reply, so it does not make later calls skip the sidecar."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "1")
    path, proc = sidecar
    model = build("llama-sdpa")
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    tier = b.remote
    tier.call({"op": "stats"})
    real = tier._lock

    class SlowLock:  # the wait ends just as the call's whole timeout has gone
        def acquire(self, blocking=True, timeout=-1):
            if timeout > 0:
                time.sleep(timeout)
            return real.acquire(blocking, timeout)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(tier, "_lock", SlowLock())
    assert "stats" in tier.call({"op": "stats"})[0]
    monkeypatch.setattr(tier, "_lock", real)
    assert b.stats()["sidecar_timeouts"] == 0

    held, done = threading.Event(), threading.Event()

    def hold():
        with real:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(30)
    try:
        with pytest.raises(SidecarTimeout) as raised:
            tier.call({"op": "stats"})
        assert "another call held it" in str(raised.value)
    finally:
        done.set()
        holder.join(30)
    assert not tier._late and tier._conn.owed == 0
    assert "stats" in tier.call({"op": "stats"})[0]  # not skipped: nothing was owed
    stats = b.stats()
    assert stats["sidecar_timeouts"] == 1 and stats["sidecar_skipped_calls"] == 0, stats
