"""Sidecar calls under a deadline (radixkv.sidecar.connection, client.SidecarTier).

A call that runs out of time is a miss (or a write not made), never a dropped connection: its
reply is owed, read later and undone (a late lease released, a late write aborted), never taken
for another call's reply; a half-read reply or a half-sent request is finished, not cut. With a
real sidecar process paused (SIGSTOP) and with a socket that accepts and never answers: every
output equals stock generate(), the data in the sidecar stays right, and the warning names the
socket and the timeout. No timing assertions: deadlines are short, checks are on counters.
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
from radixkv.sidecar.connection import Connection, SidecarTimeout
from radixkv.sidecar.protocol import FrameBuffer, encode
from tests.hf_models import assert_same_as_stock, build, ids, tokens
from tests.sidecar_process import BS, DOC_LEN, QUESTION_LEN, document, sidecar_stats, start_sidecar

PROMPT_BLOCKS = (DOC_LEN + QUESTION_LEN) // BS
PROMPT_HIT = (DOC_LEN + QUESTION_LEN - 1) // BS * BS  # generate() computes a prompt's last token


# -- the wire, against a server the test drives by hand --------------------------------------
class Peer:
    """The server end of one connection: reads the client's frames, sends what it is told."""

    def __init__(self, listener: socket.socket) -> None:
        self.sock, _ = listener.accept()
        self.sock.settimeout(30)
        self.buffer = FrameBuffer()

    def frame(self) -> tuple[dict, bytes]:
        while True:
            for header, body in self.buffer.frames():
                return header, body
            data = self.sock.recv(1 << 20)
            assert data, "the client closed the connection"
            self.buffer.feed(data)


@pytest.fixture
def wire(tmp_path):
    path = str(tmp_path / "w.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    conn = Connection(path, 5.0)
    peer = Peer(listener)
    yield path, conn, peer
    conn.close()
    peer.sock.close()
    listener.close()


@pytest.mark.parametrize(
    "op, late, undo",
    [
        ("match", {"lease": 7, "num_tokens": 8, "slots": [3, 4]}, {"op": "release", "lease": 7}),
        ("alloc", {"txn": 9, "start": 0, "slots": [5]}, {"op": "abort", "txn": 9}),
        ("commit", {"inserted": 4}, None),
        ("match", {"lease": 0, "num_tokens": 0, "slots": []}, None),  # a miss: nothing to undo
    ],
)
def test_a_late_reply_half_read_is_finished_undone_and_never_taken_for_the_next(wire, op, late, undo):
    path, conn, peer = wire
    with pytest.raises(SidecarTimeout) as raised:
        conn.call({"op": op}, b"\0" * 8, deadline=time.monotonic() + 0.2, limit="0.2 s (the test's)")
    assert raised.value.waited and raised.value.op == op
    assert path in str(raised.value) and "0.2 s (the test's)" in str(raised.value)
    assert peer.frame()[0] == {"op": op}
    reply = encode(late)
    peer.sock.sendall(reply[:5])  # half a frame: the client's buffer keeps it
    with pytest.raises(SidecarTimeout) as raised:  # owed and not in: skipped, no wait
        conn.call({"op": "stats"}, deadline=time.monotonic() + 30)
    assert not raised.value.waited and conn.owed == 1
    peer.sock.sendall(reply[5:])

    seen = []

    def serve():
        while True:
            header, _ = peer.frame()
            seen.append(header)
            if header["op"] == "stats":
                peer.sock.sendall(encode({"stats": {"mine": 1}}))
                return

    server = threading.Thread(target=serve)
    server.start()
    assert conn.call({"op": "stats"}, deadline=time.monotonic() + 30) == {"stats": {"mine": 1}}
    server.join(30)
    assert seen == ([undo] if undo else []) + [{"op": "stats"}]
    assert conn.owed == 0 and conn.counters["late_replies"] == 1


def test_a_request_the_socket_cannot_take_in_time_is_finished_not_cut(wire):
    """The server reads nothing while a request larger than the socket buffers goes out: the
    call times out part-sent; the rest goes out later and arrives whole, then the next call."""
    _, conn, peer = wire
    body = bytes(range(256)) * (16 << 10)  # 4 MiB
    with pytest.raises(SidecarTimeout):
        conn.call({"op": "match"}, body, deadline=time.monotonic() + 0.2)
    got = {}

    def serve():
        got["big"] = peer.frame()
        peer.sock.sendall(encode({"lease": 0}))
        got["next"] = peer.frame()
        peer.sock.sendall(encode({"stats": {}}))

    server = threading.Thread(target=serve)
    server.start()
    deadline = time.monotonic() + 60
    while conn.owed:  # each catch-up sends what the socket takes and reads what came
        assert time.monotonic() < deadline, "the late reply never came"
        conn.catch_up()
        time.sleep(0.01)
    assert conn.call({"op": "stats"}, deadline=time.monotonic() + 30) == {"stats": {}}
    server.join(30)
    assert got["big"] == ({"op": "match"}, body) and got["next"][0] == {"op": "stats"}


def test_a_closed_connection_is_an_error_not_a_timeout(wire):
    _, conn, peer = wire
    peer.sock.close()
    with pytest.raises(ConnectionError) as raised:
        conn.call({"op": "stats"}, deadline=time.monotonic() + 30)
    assert not isinstance(raised.value, SidecarTimeout)


@pytest.mark.parametrize(
    "junk", [encode({"stats": {}}), b"\xff\xff\xff\x7f\0\0\0\0"], ids=["unasked", "oversized"]
)
def test_a_reply_nobody_asked_for_or_a_broken_frame_breaks_the_connection(wire, junk):
    from radixkv.sidecar.protocol import ProtocolError

    _, conn, peer = wire
    peer.sock.sendall(junk)
    with pytest.raises(ProtocolError):  # found before any request is sent
        for _ in range(1000):  # until the bytes have arrived (at once, on one machine)
            conn.catch_up()
            time.sleep(0.01)


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


def test_timeouts_from_the_environment_and_their_defaults(monkeypatch, tmp_path):
    model = build("llama-sdpa")
    tier = hf_patch.build_store(model, block_size=BS, budget_tokens=256, sidecar=tmp_path / "s").remote
    assert (tier.timeout_s, tier.connect_timeout_s) == (10.0, 5.0)
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "30")
    monkeypatch.setenv("RADIXKV_SIDECAR_CONNECT_TIMEOUT_S", "0.5")
    tier = hf_patch.build_store(model, block_size=BS, budget_tokens=256, sidecar=tmp_path / "s").remote
    assert (tier.timeout_s, tier.connect_timeout_s) == (30.0, 0.5)


# -- a real sidecar process, paused --------------------------------------------------------
def prompt_of(seed: int) -> list[int]:
    return document(seed) + tokens(QUESTION_LEN, 1000 + seed)


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
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "2")  # a live sidecar's calls: ~0.1 ms
    path = tmp_path / "s.sock"
    proc = start_sidecar(path)
    model = build("llama-sdpa")
    ns = (model_scope(model), None)
    try:
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
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


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


def test_a_timed_out_call_leaves_the_tier_usable_by_other_threads(tmp_path, monkeypatch):
    """Two threads share one tier's connection: while one waits on the paused sidecar, the
    other's call waits at most its own timeout for the connection (counted, never hung)."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "1")
    path = tmp_path / "s.sock"
    proc = start_sidecar(path)
    try:
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
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_release_never_waits_behind_a_call_to_a_paused_sidecar(tmp_path, monkeypatch):
    """A lease released (end of a request's prefill) while the writer's call waits on a paused
    sidecar returns at once; the release goes out after that call and reaches the sidecar."""
    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "3")
    path = tmp_path / "s.sock"
    proc = start_sidecar(path)
    model = build("llama-sdpa")
    try:
        a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        assert_same_as_stock(model, ids(prompt_of(70)), a, max_new_tokens=1, do_sample=False)
        assert a.remote.flush(30)
        held = b.acquire(prompt_of(70), (model_scope(model), None))
        assert held.remote is not None and sidecar_stats(path)["pinned_blocks"] == PROMPT_BLOCKS
        proc.send_signal(signal.SIGSTOP)
        waiting = threading.Thread(
            target=lambda: pytest.raises(SidecarTimeout, b.remote.call, {"op": "stats"})
        )
        waiting.start()
        deadline = time.monotonic() + 30
        while not b.remote._lock.locked():  # the call holds the connection, waiting
            assert time.monotonic() < deadline
            time.sleep(0.001)
        held.release()
        assert len(b.remote._tells) == 1  # queued behind the call, which still waits (3 s)
        waiting.join(60)
        proc.send_signal(signal.SIGCONT)
        until_stats(path, pinned_blocks=0)
        until_answered(b.remote)
        assert b.stats()["sidecar_disconnects"] == 0
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_the_stats_command_says_when_the_sidecar_does_not_answer(tmp_path, monkeypatch, capsys):
    from radixkv.sidecar import __main__ as cli

    monkeypatch.setattr(cli, "STATS_TIMEOUT_S", 0.2)
    path = str(tmp_path / "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        assert cli.stats_main(["--socket", path]) == 1
    assert f"the sidecar on {path} did not answer within 0.2 s" in capsys.readouterr().err


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


def test_reads_while_the_sidecar_pauses_and_resumes_are_right_or_misses(tmp_path, monkeypatch):
    """Three threads read documents through one tier while the sidecar is paused and resumed
    six times around a 0.3 s timeout: every read is bit-equal to the KV the writer computed, or
    a miss; at the end no pin, claim or write is left in the sidecar and the connection is the
    first one."""
    import random

    import torch

    monkeypatch.setenv("RADIXKV_SIDECAR_TIMEOUT_S", "0.3")
    path = tmp_path / "s.sock"
    proc = start_sidecar(path)
    model = build("llama-sdpa")
    ns = (model_scope(model), None)
    try:
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
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
