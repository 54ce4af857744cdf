"""Hostile input against a real sidecar process: frames no client library sends. A frame that
breaks the format drops its client; a request with a bad field gets an error reply (or, for the
ops that get no reply, nothing); the sidecar serves on, and a correct client beside gets the KV
it wrote. (The random version: tests/test_sidecar_fuzz.py.)"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import threading

import pytest

from radixkv.sidecar.__main__ import main
from radixkv.sidecar.protocol import encode
from radixkv.sidecar.server import Server
from radixkv.sidecar.state import Sidecar
from tests.sidecar_process import ROOT, WIRE_KEY, WIRE_LAYOUT, SidecarLog, Wire, kv_round_trip, start_sidecar


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """One sidecar for the tests that hurt it (each checks that it still serves, and a correct
    client's KV); its log is read as it goes (``proc.log``)."""
    path = tmp_path_factory.mktemp("sc") / "s.sock"  # short: AF_UNIX paths are limited to 107 bytes
    proc = start_sidecar(path)
    proc.log = SidecarLog(proc)
    yield path, proc
    proc.kill()
    proc.wait()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_header_nesting_100000_deep_drops_its_client_and_the_others_are_served(sidecar):
    path, proc = sidecar
    beside = Wire(path)
    assert "error" not in beside.call({"op": "hello", "layout": WIRE_LAYOUT})
    for head in (
        b'{"op":"stats","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"[" * 100_000,  # not even closed
        b'{"op":"stats","x":"'
        + b"[" * 1000
        + b'",'
        + b'"y":'
        + b"{" * 1000,  # brackets in a string, then not
    ):
        hostile = Wire(path)
        hostile.send_raw(Wire.frame(head))
        assert hostile.hung_up()
        hostile.close()
    assert proc.poll() is None
    assert "stats" in beside.call({"op": "stats"})  # its connection is untouched
    assert proc.log.wait_for("nests deeper").count("nests deeper than 16 levels") >= 1
    kv_round_trip(path, seed=1)
    # Brackets inside strings are not nesting: a header deep only in its strings is parsed (and
    # refused for its unknown field by an error reply), its client kept.
    assert "unknown field `x`" in beside.call({"op": "stats", "x": "[" * 100_000})["error"]
    assert "stats" in beside.call({"op": "stats"})
    beside.close()


# (raw header, what the reply's error names; None: an op that gets no reply)
NUMBERS = [
    (b'{"op":"release","lease":1e400}', None),
    (b'{"op":"release","lease":-1e400}', None),
    (b'{"op":"release","lease":' + b"9" * 5000 + b"}", None),  # int() of >4,300 digits raises
    (b'{"op":"abort","txn":NaN}', None),
    (b'{"op":"commit","txn":Infinity}', "commit: txn: expected `int`, got `float`"),
    (b'{"op":"commit","txn":-1}', "commit: txn: expected `int` >= 0"),
    (b'{"op":"commit","txn":9223372036854775808}', "commit: txn: expected `int` <= 9223372036854775807"),
    (b'{"op":"commit","txn":true}', "commit: txn: expected `int`, got `bool`"),
    (b'{"op":"commit","txn":"1"}', "commit: txn: expected `int`, got `str`"),
    (b'{"op":"commit"}', "commit: object missing required field `txn`"),
    (b'{"op":"commit","txn":1,"tnx":2}', "commit: object contains unknown field `tnx`"),
    (b'{"op":"match","ident":"ab","ns":"x","have":1e400}', "match: have: expected `int`, got `float`"),
    (b'{"op":"match","ident":"ab","ns":"x","claim":-Infinity}', "match: claim: expected `float` >= 0.0"),
    (b'{"op":"match","ident":"ab","ns":"x","claim":NaN}', "match: claim: expected `float`"),
    (b'{"op":"match","ident":"ab","ns":["x"]}', "match: ns: expected `str`, got `array`"),
    (b'{"op":"match","ident":"abc","ns":"x"}', "match: ident must be 1..64 bytes as hex"),
    (b'{"op":"match","ident":"ab","ns":"\\ud800"}', "match: ns: a string holds a lone surrogate"),
    (b'{"op":"hello","layout":{"block_size":1e400,"layers":[]}}', "hello: layout.block_size: expected `int`"),
    # lone surrogates where msgspec wants no string, or in a field name: it raised UnicodeEncodeError
    (b'{"op":"release","lease":"\\ud800"}', None),
    (b'{"op":"stats","\\udfff":1}', "stats: a string holds a lone surrogate"),
    (
        b'{"op":"hello","layout":{"block_size":2,"layers":[{"dtype":"\\ud800"}]}}',
        "hello: a string holds a lone",
    ),
    (b'{"op":1e400}', "unknown op inf"),
    (b'{"op":null}', "unknown op None"),
]


def test_numbers_out_of_range_and_bad_fields_get_an_error_reply_and_change_nothing(sidecar):
    path, proc = sidecar
    client = Wire(path)
    assert "error" not in client.call({"op": "hello", "layout": WIRE_LAYOUT})
    before = client.call({"op": "stats"})["stats"]
    for head, error in NUMBERS:
        client.send_raw(Wire.frame(head))
        if error is not None:
            reply, _ = client.reply()
            assert error in reply.get("error", ""), (head[:80], reply)
    # The ops that get no reply sent none (the next reply is this stats'), and nothing changed
    # (but the count of clients: other tests' connections may close meanwhile).
    after = client.call({"op": "stats"})["stats"]
    assert {k: v for k, v in after.items() if k != "clients"} == {
        k: v for k, v in before.items() if k != "clients"
    }
    assert proc.poll() is None
    words = ("release: lease: expected `int`, got `float`", "abort: txn: expected `int`, got `float`",
             "release: a string holds a lone surrogate")  # fmt: skip
    log = proc.log.wait_for(*words)
    assert all(w in log for w in words) and "its request raised" not in log, log[-3000:]
    # A body where none belongs, and a token body that is not int64, are refused by name.
    assert "takes no body" in client.call({"op": "stats"}, b"12345678")["error"]
    assert "not packed int64" in client.call({"op": "alloc", **WIRE_KEY}, b"1234")["error"]
    kv_round_trip(path, seed=2)
    assert proc.poll() is None
    client.close()


def test_an_exception_in_one_request_drops_that_client_and_the_loop_serves_on(tmp_path, monkeypatch):
    """No exception from one client's request ends the serving loop (a bug in a handler: here
    ``stats`` raising): that client is dropped and logged, the others are served."""
    state = Sidecar(1 << 20)
    server = Server(state, str(tmp_path / "s.sock"))
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        for _ in range(500):  # until it listens
            try:
                beside = Wire(server.path)
                break
            except OSError:
                threading.Event().wait(0.01)
        assert "error" not in beside.call({"op": "hello", "layout": WIRE_LAYOUT})
        stats = state.stats
        calls = []

        def broken():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            return stats()

        monkeypatch.setattr(state, "stats", broken)
        victim = Wire(server.path)
        victim.send_raw(encode({"op": "stats"}))
        assert victim.hung_up()
        assert thread.is_alive()
        assert beside.call({"op": "stats"})["stats"]["clients"] == 1
        kv_round_trip(server.path, seed=3)
    finally:
        server.stop()
        thread.join(10)


def test_a_hello_costs_no_memory_per_block_and_absurd_layouts_are_refused(tmp_path_factory):
    """A pool's free list is a counter plus the ids freed again, not a list of every block: a
    hello of 1 KiB blocks to a 1 GiB sidecar (a million blocks) used to grow its RSS by ~40 MiB
    (a Python list of every id), 4-byte blocks to 64 MiB by 642 MiB; now neither costs memory
    per block, and blocks that small are refused."""
    path = tmp_path_factory.mktemp("sc") / "s.sock"
    proc = start_sidecar(path, "1G")
    try:
        client = Wire(path)
        assert client.call({"op": "stats"})["stats"]["pools"] == 0
        before = rss_bytes(proc.pid)
        hello = client.call({"op": "hello", "layout": WIRE_LAYOUT})
        assert hello["num_blocks"] == 1 << 20
        grown = rss_bytes(proc.pid) - before
        assert grown < 4 << 20, f"RSS grew by {grown / 2**20:.1f} MiB at a hello"
        four_bytes = {"block_size": 1, "layers": [{**WIRE_LAYOUT["layers"][0], "k_head_dim": 1, "v_head_dim": 1,
                                                   "dtype": "float16"}]}  # fmt: skip
        refused = client.call({"op": "hello", "layout": four_bytes})
        assert "hello: layout: a block takes 4 bytes" in refused["error"], refused
        assert "at least 1024 bytes" in refused["error"]
        assert client.call({"op": "stats"})["stats"]["pools"] == 1
        kv_round_trip(path, seed=4)
        assert rss_bytes(proc.pid) - before < 8 << 20
    finally:
        proc.kill()
        proc.wait()


def test_a_second_sidecar_or_a_socket_path_taken_is_refused_in_one_line(sidecar, tmp_path, capsys):
    """What stops a sidecar from serving is one line on stderr naming the path and what to do,
    exit status 1, never a traceback; and it leaves the path alone. A second sidecar process on
    the socket; the command's main() in this process for the other paths (the same code)."""
    path, proc = sidecar
    second = subprocess.run(
        [sys.executable, "-m", "radixkv.sidecar", "--socket", str(path), "--host-bytes", "1M"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 1 and second.stdout == "" and len(lines) == 1, second.stderr
    assert lines[0] == (
        f"radixkv sidecar: a sidecar is already serving {path} (it holds {path}.lock): stop it first, "
        "or give this one another --socket"
    )
    regular = tmp_path / "regular"
    regular.write_text("not a socket")
    refusals = {
        regular: "is not a socket (a file): remove it, or give the sidecar another --socket",
        tmp_path: "is not a socket (a directory): remove it",
        tmp_path
        / "missing"
        / "s.sock": "missing/s.sock.lock (No such file or directory): give the sidecar a --socket",
        tmp_path / ("x" * 120): "cannot create the socket",  # past AF_UNIX's 107 bytes
    }
    for where, words in refusals.items():
        assert main(["--socket", str(where), "--host-bytes", "1M"]) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and str(where) in err and words in err, err
    assert regular.read_text() == "not a socket" and stat.S_ISSOCK(os.lstat(path).st_mode)
    assert proc.poll() is None
    kv_round_trip(path, seed=5)


def test_a_client_that_sends_and_never_reads_stalls_nobody_and_gets_every_reply_later(sidecar):
    """A flood of requests from a client that does not read: the sidecar used to block in
    sendall() on it for up to 5 s (SEND_TIMEOUT_S), every other client waiting, then drop it.
    Now its replies wait in its queue (its requests too, past 1 MiB of replies), the others are
    served meanwhile, and it gets every reply, in order, once it reads."""
    path, proc = sidecar
    beside, flooder = Wire(path), Wire(path)
    assert "stats" in flooder.call({"op": "stats"})  # both connected
    clients = beside.call({"op": "stats"})["stats"]["clients"]
    frame = encode({"op": "stats"})
    flood = frame * 20_000  # 440 KB of requests, ~14 MB of replies: far more than sockets buffer
    flooder.sock.setblocking(False)
    sent = 0
    with contextlib.suppress(BlockingIOError):
        while sent < len(flood):
            sent += flooder.sock.send(flood[sent : sent + (1 << 16)])
    flooder.sock.setblocking(True)
    flooder.sock.settimeout(30)
    # Served while the flooder's replies wait unread (it is still connected: the clients are the same).
    assert beside.call({"op": "stats"})["stats"]["clients"] == clients
    kv_round_trip(path, seed=6)
    for _ in range(sent // len(frame)):
        assert "stats" in flooder.reply()[0]
    if sent % len(frame):  # the frame its last send cut: sent whole now, answered too
        flooder.send_raw(flood[sent : -(-sent // len(frame)) * len(frame)])
        assert "stats" in flooder.reply()[0]
    assert "stats" in flooder.call({"op": "stats"})
    assert proc.poll() is None
    beside.close()
    flooder.close()
