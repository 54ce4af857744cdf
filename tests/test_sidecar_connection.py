"""The sidecar client's wire (radixkv.sidecar.connection) against a server the test drives by hand.

A call that runs out of time leaves its reply owed: a half-read reply is finished, a request the
socket did not take in time is sent whole, a late reply is undone (a lease released, a write
aborted) and never taken for the next call's; a frame nobody asked for, a broken frame or a
closed stream break the connection. ``python -m radixkv.sidecar stats`` on a mute socket says so.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from radixkv.sidecar.connection import Connection, SidecarTimeout
from radixkv.sidecar.protocol import FrameBuffer, ProtocolError, encode


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
    _, conn, peer = wire
    peer.sock.sendall(junk)
    with pytest.raises(ProtocolError):  # found before any request is sent
        for _ in range(1000):  # until the bytes have arrived (at once, on one machine)
            conn.catch_up()
            time.sleep(0.01)


def test_the_stats_command_says_when_the_sidecar_does_not_answer(tmp_path, monkeypatch, capsys):
    from radixkv.sidecar import __main__ as cli

    monkeypatch.setattr(cli, "STATS_TIMEOUT_S", 0.2)
    path = str(tmp_path / "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        assert cli.stats_main(["--socket", path]) == 1
    assert f"the sidecar on {path} did not answer within 0.2 s" in capsys.readouterr().err


def test_close_closes_the_fd_of_a_hello_reply_nobody_took(wire, tmp_path):
    """A hello reply read (late, by a catch-up) but never taken carries the pool's fd: close()
    closes it too."""
    import os

    _, conn, peer = wire
    with pytest.raises(SidecarTimeout):
        conn.call({"op": "hello"}, deadline=time.monotonic() + 0.1)
    assert peer.frame()[0] == {"op": "hello"}
    with open(tmp_path / "pool", "wb+") as f:
        socket.send_fds(peer.sock, [encode({"pool_bytes": 0})], [f.fileno()])
    deadline = time.monotonic() + 30
    while conn.owed:
        assert time.monotonic() < deadline, "the hello reply never came"
        conn.catch_up()
        time.sleep(0.01)
    (fd,) = conn.hello[1]
    os.fstat(fd)  # open, held by the connection
    conn.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_on_late_is_told_the_late_reply_or_none_when_the_connection_closes_first(wire, tmp_path):
    """``on_late`` (the writer's unsettled commits): told the reply a timed-out call's reply when
    it is read, exactly once, and None for a reply still owed when the connection closes."""
    path, conn, peer = wire
    told = []
    with pytest.raises(SidecarTimeout) as raised:
        conn.call({"op": "commit", "txn": 3}, deadline=time.monotonic() + 0.1, on_late=told.append)
    assert raised.value.owed and raised.value.op == "commit"
    peer.frame()
    peer.sock.sendall(encode({"inserted": 8}))
    deadline = time.monotonic() + 30
    while conn.owed:
        assert time.monotonic() < deadline
        conn.catch_up()
        time.sleep(0.01)
    assert told == [{"inserted": 8}]

    def answer():
        assert peer.frame()[0] == {"op": "stats"}
        peer.sock.sendall(encode({"stats": {}}))

    server = threading.Thread(target=answer, daemon=True)
    server.start()
    assert conn.call({"op": "stats"}, deadline=time.monotonic() + 30) == {"stats": {}}
    server.join(30)
    assert told == [{"inserted": 8}]  # told once

    # A skipped call never went out: nothing owed, nothing to tell.
    with pytest.raises(SidecarTimeout):
        conn.call({"op": "commit", "txn": 4}, deadline=time.monotonic() + 0.1, on_late=told.append)
    with pytest.raises(SidecarTimeout) as raised:
        conn.call({"op": "commit", "txn": 5}, deadline=time.monotonic() + 30, on_late=told.append)
    assert not raised.value.owed and conn.owed == 1
    conn.close()
    assert told == [{"inserted": 8}, None]


def test_abandon_sends_nothing_and_leaves_another_copy_of_the_socket_open(wire):
    """A forked child's ``abandon``: its copy of the socket closed, nothing sent or settled, the
    other copy (the parent's) still connected."""
    import os

    path, conn, peer = wire
    with pytest.raises(SidecarTimeout):
        conn.call({"op": "match"}, deadline=time.monotonic() + 0.1)
    peer.frame()
    parent = socket.socket(fileno=os.dup(conn.sock.fileno()))  # the other process's copy
    try:
        conn._out += encode({"op": "release", "lease": 1})  # queued, as a tell not yet sent
        conn.abandon()
        assert conn.sock.fileno() == -1 and conn.owed == 0 and not conn.pending
        peer.sock.settimeout(0.2)
        with pytest.raises(TimeoutError):  # no byte, no end of stream: the parent's copy lives
            peer.sock.recv(1)
        parent.sendall(encode({"op": "stats"}))
        peer.sock.settimeout(30)
        assert peer.frame()[0] == {"op": "stats"}
    finally:
        parent.close()
