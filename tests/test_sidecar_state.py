"""The sidecar's state, protocol and server in one process: pools per layout under one budget,
keys per identity and namespace, leases and unwritten blocks freed with their client, refusals
of bad input, the socket's mode, Prometheus text. (test_sidecar.py runs real processes.)"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import threading
import urllib.request

import pytest

from radixkv.l2 import block_keys
from radixkv.sidecar.__main__ import stats_main
from radixkv.sidecar.layout import KVLayout, PoolGeometry
from radixkv.sidecar.metrics import prometheus_text, serve_metrics
from radixkv.sidecar.protocol import HEADER, FrameBuffer, ProtocolError, encode, recv, send
from radixkv.sidecar.server import ServeError, Server
from radixkv.sidecar.state import MAX_POOLS, FreeBlocks, Sidecar
from radixkv.tree import pack_tokens


def layout(heads=1, dim=64, dtype="float32", bs=2, layers=1) -> dict:
    one = {"num_kv_heads": heads, "k_head_dim": dim, "v_head_dim": dim, "dtype": dtype}
    return {"block_size": bs, "layers": [one] * layers}


SMALL = layout()  # 2 tokens x 1 head x (64 + 64) x 4 bytes = 1 KiB a block, the smallest taken
B = 1024
NS = (b"\x01" * 32, b"null")


def toks(*ids: int) -> bytes:
    return bytes(pack_tokens(list(ids)))


def write(state: Sidecar, cid: int, ids: bytes, ns=NS) -> int:
    txn = state.alloc(cid, ns, ids)
    return state.commit(cid, txn["txn"]) if txn["txn"] else 0


def test_blocks_are_visible_after_commit_only_and_freed_with_their_client():
    state = Sidecar(B * 8)
    state.add_client(1)
    state.add_client(2)
    state.hello(1, SMALL)
    state.hello(2, SMALL)
    doc = toks(5, 6, 7, 8, 9)  # two whole blocks
    txn = state.alloc(1, NS, doc)
    assert txn["start"] == 0 and len(txn["slots"]) == 2
    assert state.match(2, NS, doc, 0)["num_tokens"] == 0  # written, not committed: invisible
    assert state.commit(1, txn["txn"]) == 4
    hit = state.match(2, NS, doc, 0)
    assert hit["num_tokens"] == 4 and hit["slots"] == txn["slots"]
    assert state.match(2, NS, doc, 2)["slots"] == txn["slots"][1:]  # the client held one block
    assert state.match(2, NS, doc, 4)["lease"] == 0  # nothing past what it holds
    # Another identity and another namespace read nothing.
    assert state.match(2, (b"\x02" * 32, b"null"), doc, 0)["num_tokens"] == 0
    assert state.match(2, (NS[0], b'{"str":"t"}'), doc, 0)["num_tokens"] == 0
    # Client 1 opens a transaction, client 2 holds leases; both go away.
    state.alloc(1, NS, toks(1, 2, 3, 4))
    assert state.stats()["open_txns"] == 1 and state.stats()["pinned_blocks"] == 2
    state.drop_client(1)
    state.drop_client(2)
    stats = state.stats()
    assert stats["open_txns"] == stats["open_leases"] == stats["pinned_blocks"] == 0
    assert stats["aborted_blocks"] == 2 and stats["released_pins"] == 2
    state.check_invariants()


def test_two_layouts_share_one_budget_and_evict_each_other():
    big = layout(dim=128)  # 2 x (128 + 128) x 4 = 2 KiB a block
    state = Sidecar(B * 4)  # four small blocks, or two big ones
    state.add_client(1)
    state.add_client(2)
    state.hello(1, SMALL)
    state.hello(2, big)
    assert len(state.pools) == 2
    assert write(state, 1, toks(1, 2, 3, 4, 5, 6, 7, 8)) == 8  # 4 small blocks: the whole budget
    assert write(state, 2, toks(1, 2, 3, 4)) == 4  # 2 big blocks: the small ones make room
    assert state.stats()["used_bytes"] <= B * 4 and state.counters.evicted_blocks == 4
    state.check_invariants()


def test_a_pool_full_of_pinned_blocks_caches_what_fits():
    state = Sidecar(B * 3)
    for c in (1, 2):
        state.add_client(c)
        state.hello(c, SMALL)
    assert write(state, 1, toks(1, 2, 3, 4)) == 4
    state.match(2, NS, toks(1, 2, 3, 4), 0)  # pins both blocks
    assert write(state, 1, toks(9, 9, 8, 8, 7, 7)) == 2  # one free block of three
    assert state.counters.uncached_tokens == 4
    state.check_invariants()


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"block_size": 3, "layers": SMALL["layers"]}, "power of two"),
        (layout(dtype="int8"), r"layout.layers\[0\].dtype: invalid enum value 'int8' \(dtypes: bfloat16, "),
        (layout(heads=0), r"layout.layers\[0\].num_kv_heads: expected `int` >= 1"),
        (layout(heads=True), r"layout.layers\[0\].num_kv_heads: expected `int`, got `bool`"),
        (layout(dim=64.0), r"layout.layers\[0\].k_head_dim: expected `int`, got `float`"),
        ({"block_size": 1e400, "layers": SMALL["layers"]}, "layout.block_size: expected `int`, got `float`"),
        ({"block_size": 2, "layers": []}, "layout: no layers and no states"),
        (
            {**SMALL, "states": [{"shape": [16, 0], "dtype": "float32"}]},
            r"layout.states\[0\].shape\[1\]: expected `int` >= 1",
        ),
        (
            {**SMALL, "states": [{"shape": [256], "dtype": "int8"}]},
            r"layout.states\[0\].dtype: invalid enum value 'int8'",
        ),
        (
            {**SMALL, "states": [{"shape": [1] * 9, "dtype": "float32"}]},
            r"layout.states\[0\].shape: expected `array` of length <= 8",
        ),
        (
            {**SMALL, "states": [{"shape": [16], "dtype": "float32"}]},
            "a snapshot takes 64 bytes; .* 1024 to ",
        ),
        (
            {**SMALL, "states": [{"shape": [1 << 16] * 3, "dtype": "float32"}]},
            "a snapshot takes 1125899906842624 bytes",
        ),
        # a quarter of 1 MiB holds 3 snapshots of 80 KiB: fewer than the sidecar needs
        (
            {**SMALL, "states": [{"shape": [80, 256], "dtype": "float32"}]},
            "hold 3 snapshot.* at least 4: raise --state-bytes",
        ),
        (
            {"block_size": 2, "layers": SMALL["layers"] * 1025},
            "layout.layers: expected `array` of length <= 1024",
        ),
        ({**SMALL, "extra": 1}, "layout: object contains unknown field `extra`"),
        ("nope", "layout: expected `object`, got `str`"),
        # 4-byte blocks (one token of one head of dim 1 in float16): 16.7 M blocks in 64 MiB
        (layout(dim=1, dtype="float16", bs=1), r"a block takes 4 bytes \(1 token of 4 bytes of K and V\)"),
        # 1 KiB blocks of 256 tokens: 8 bytes of key a token for 4 bytes of KV
        (
            layout(dim=1, dtype="float16", bs=256),
            "256 tokens of 4 bytes .* at least 1024 bytes and 128 bytes a token",
        ),
    ],
)
def test_bad_layouts_are_refused_by_name(bad, words):
    state = Sidecar(1 << 20)
    state.add_client(1)
    with pytest.raises(ValueError, match=words):
        state.hello(1, bad)


def test_free_blocks_cost_memory_for_used_blocks_only_and_hand_out_ascending_runs():
    free = FreeBlocks(1 << 31)  # 2 TiB of 1 KiB blocks: nothing stored for them
    assert len(free) == 1 << 31 and free.freed.itemsize * len(free.freed) == 0
    assert free.take(4) == [0, 1, 2, 3] and free.take(2) == [4, 5]
    free.put([1, 3, 2])
    assert len(free) == (1 << 31) - 3
    assert free.take(5) == [2, 3, 1, 6, 7]  # the last freed first, then fresh ids in order
    assert free.take(0) == [] and len(free.freed) == 0
    small = FreeBlocks(3)
    assert small.take(5) == [0, 1, 2] and small.take(1) == [] and list(small) == []
    small.put([2, 0])
    assert sorted(small) == [0, 2]


def test_the_number_of_pools_is_bounded_and_a_known_layout_is_always_served():
    state = Sidecar(1 << 30)
    state.add_client(1)
    for i in range(MAX_POOLS):
        state.hello(1, layout(bs=2 << (i % 10), heads=1 + i // 10))
    with pytest.raises(ValueError, match=f"pools of {MAX_POOLS} KV layouts already"):
        state.hello(1, layout(heads=99))
    assert len(state.pools) == MAX_POOLS and state.hello(1, layout()).layout.block_size == 2
    state.check_invariants()


def test_bad_requests_are_refused_and_change_nothing():
    state = Sidecar(1 << 10)
    state.add_client(1)
    with pytest.raises(ValueError, match="hello"):
        state.match(1, NS, toks(1, 2), 0)
    state.hello(1, SMALL)
    with pytest.raises(ValueError, match="multiple of the block size"):
        state.match(1, NS, toks(1, 2, 3, 4), 1)
    with pytest.raises(ValueError, match="no open transaction"):
        state.commit(1, 12345)
    tiny = Sidecar(8)
    tiny.add_client(1)
    with pytest.raises(ValueError, match="hold no block of this layout"):
        tiny.hello(1, SMALL)
    state.check_invariants()


def test_geometry_payload_round_trip():
    geometry = PoolGeometry(KVLayout.from_json(layout(layers=3)), 5)
    buf = bytearray(geometry.total_bytes)
    payload = bytes(i % 251 for i in range(geometry.layout.block_bytes))
    geometry.write_block(buf, 3, payload)
    assert geometry.read_block(buf, 3) == payload and geometry.read_block(buf, 2) == bytes(len(payload))
    with pytest.raises(ValueError, match="payload of 3 bytes"):
        geometry.write_block(buf, 0, b"abc")


def test_frames_over_the_limits_or_not_json_are_protocol_errors():
    buffer = FrameBuffer()
    buffer.feed(HEADER.pack(1 << 30, 0))
    with pytest.raises(ProtocolError, match="over the limits"):
        list(buffer.frames())
    buffer = FrameBuffer()
    buffer.feed(HEADER.pack(3, 0) + b"{x}")
    with pytest.raises(ProtocolError, match="not JSON"):
        list(buffer.frames())
    buffer = FrameBuffer()
    data = encode({"op": "stats"}, b"12345678")
    buffer.feed(data[:5])
    assert list(buffer.frames()) == []
    buffer.feed(data[5:])
    assert list(buffer.frames()) == [({"op": "stats"}, b"12345678")]


def test_server_socket_mode_hostile_clients_and_the_stats_command(tmp_path, capsys):
    path = str(tmp_path / "s.sock")
    state = Sidecar(1 << 16)
    server = Server(state, path)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        for _ in range(500):  # until it listens (the file exists from bind(), before listen())
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as probe:
                probe.connect(path)
                break
            threading.Event().wait(0.01)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(RuntimeError, match="already serving"):
            Server(Sidecar(1 << 16), path).listen()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # the refused second sidecar left it alone
        garbage = socket.socket(socket.AF_UNIX)
        garbage.connect(path)
        garbage.sendall(HEADER.pack(1 << 30, 1 << 30))  # over the limits: dropped
        assert garbage.recv(10) == b""
        client = socket.socket(socket.AF_UNIX)
        client.settimeout(10)
        client.connect(path)
        buffer = FrameBuffer()
        send(client, {"op": "dance"})
        assert "unknown op" in recv(client, buffer)[0]["error"]
        send(client, {"op": "match", "ident": "zz", "ns": "x"}, b"")
        assert "hex" in recv(client, buffer)[0]["error"]
        send(client, {"op": "hello", "layout": SMALL})
        reply, _, fds = recv(client, buffer, with_fds=True)
        assert len(fds) == 1 and reply["num_blocks"] == (1 << 16) // B
        os.close(fds[0])
        send(client, {"op": "stats"})
        assert recv(client, buffer)[0]["stats"]["clients"] == 1  # the garbage client is gone
        client.close()
        assert stats_main(["--socket", path]) == 0  # python -m radixkv.sidecar stats
        assert json.loads(capsys.readouterr().out)["clients"] == 1  # itself: the others left
        assert stats_main(["--socket", path + ".none"]) == 1
    finally:
        server.stop()
        thread.join(10)
    assert not os.path.exists(path)


def test_metrics_text_and_endpoint():
    state = Sidecar(1 << 16)
    state.add_client(1)
    text = prometheus_text({**state.stats(), "l2_reads": 3, "l2_down": 1})
    assert "radixkv_sidecar_clients 1" in text and "# TYPE radixkv_sidecar_clients gauge" in text
    assert "radixkv_sidecar_clients_total 1" in text and "_total_total" not in text
    assert "# TYPE radixkv_sidecar_l2_down gauge" in text and "radixkv_sidecar_l2_down 1" in text
    assert "radixkv_sidecar_hit_tokens_total 0" in text and "radixkv_sidecar_l2_reads_total 3" in text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = serve_metrics(state, port)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "radixkv_sidecar_evicted_blocks_total 0" in body
    finally:
        server.shutdown()


class FakeL2:
    """An in-memory L2 with the radixkv.l2 contract; ``broken`` keys answer None (refused)."""

    def __init__(self) -> None:
        self.values: dict[bytes, bytes] = {}
        self.broken: set[bytes] = set()

    def get_many(self, keys):
        return [None if k in self.broken else self.values.get(k) for k in keys]

    def put_many(self, items):
        self.values.update(items)
        return len(items)

    def stats(self):
        return {"reads": 0, "hits": 0, "writes": len(self.values), "errors": 0, "refused": 0}

    def close(self):
        pass


def test_l2_fills_a_miss_in_memory_and_stops_at_the_first_refused_block():
    l2 = FakeL2()
    a = Sidecar(B * 8, l2=l2, l2_writer=l2.put_many)  # committed blocks go straight to the L2
    a.add_client(1)
    a.hello(1, SMALL)
    doc = toks(1, 2, 3, 4, 5, 6, 7, 8)  # four blocks
    txn = a.alloc(1, NS, doc)
    pool = next(iter(a.pools.values()))
    pool.geometry.write_block(pool.buf, txn["slots"][0], b"\x07" * B)
    a.commit(1, txn["txn"])
    assert len(l2.values) == 4
    b = Sidecar(B * 8, l2=l2)  # a second sidecar (another machine) on the same L2
    b.add_client(1)
    b.hello(1, SMALL)
    hit = b.match(1, NS, doc, 0)
    assert hit["num_tokens"] == 8 and b.counters.l2_hit_tokens == 8
    pool = next(iter(b.pools.values()))
    assert pool.geometry.read_block(pool.buf, hit["slots"][0]) == b"\x07" * B  # the bytes came along
    # Another identity finds nothing; a refused third block stops the fill after two blocks.
    c = Sidecar(B * 8, l2=l2)
    c.add_client(1)
    c.hello(1, SMALL)
    assert c.match(1, (b"\x09" * 32, b"null"), doc, 0)["num_tokens"] == 0
    keys = block_keys(NS[0], NS[1], [1, 2, 3, 4, 5, 6, 7, 8], 2)
    l2.broken = {keys[2]}
    assert c.match(1, NS, doc, 0)["num_tokens"] == 4
    for s in (a, b, c):
        s.check_invariants()


class CountingL2(FakeL2):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def get_many(self, keys):
        self.asked.append(len(keys))
        return super().get_many(keys)


def test_a_long_prompt_reads_the_l2_in_doubling_runs_up_to_its_first_miss():
    """Only the leading hits of an L2 read are used: a 20,000-block prompt whose first 40 blocks
    the L2 holds asks for 16 + 32 keys (not 20,000, each hashed over the whole prompt first),
    and a prompt longer than the pool asks for no more blocks than the pool has."""
    l2 = CountingL2()
    writer = Sidecar(B * 64, l2=l2, l2_writer=l2.put_many)
    writer.add_client(1)
    writer.hello(1, SMALL)
    prompt = list(range(100, 100 + 40_000))  # 20,000 blocks of 2
    assert write(writer, 1, toks(*prompt[:80])) == 80 and len(l2.values) == 40
    reader = Sidecar(B * 64, l2=l2)
    reader.add_client(1)
    reader.hello(1, SMALL)
    hit = reader.match(1, NS, toks(*prompt), 0)
    assert hit["num_tokens"] == 80 and l2.asked == [16, 32]
    assert reader.match(1, NS, toks(*prompt), 80)["lease"] == 0  # from 40 blocks on: one run, a miss
    assert l2.asked == [16, 32, 16]
    everything = CountingL2()
    everything.get_many = lambda keys: everything.asked.append(len(keys)) or [b"\x07" * B] * len(keys)
    full = Sidecar(B * 64, l2=everything)
    full.add_client(1)
    full.hello(1, SMALL)
    assert full.match(1, NS, toks(*prompt), 0)["num_tokens"] == 64 * 2  # the whole pool
    assert sum(everything.asked) == 64 and everything.asked == [16, 32, 16]
    for s in (writer, reader, full):
        s.check_invariants()


def test_a_prefix_in_flight_is_claimed_waited_for_and_released():
    state = Sidecar(B * 16)
    for c in (1, 2, 3):
        state.add_client(c)
        state.hello(c, SMALL)
    doc = toks(1, 2, 3, 4, 5, 6, 7, 8, 9)  # four whole blocks
    assert state.match(1, NS, doc, 0, claim_s=5)["wait"] == 0  # client 1 computes it
    other_question = toks(1, 2, 3, 4, 5, 6, 9, 9)
    assert state.match(2, NS, other_question, 0, claim_s=5)["wait"] == 6 // 2 * 2  # 3 common blocks
    assert state.match(2, (b"\x03" * 32, b"null"), doc, 0, claim_s=5)["wait"] == 0  # other identity
    # Client 2 holds a claim of its own now (other identity): it still waits for client 1, which
    # waits for nobody; client 1 is then never told to wait for client 2 (they would wait for
    # each other), and computes.
    assert state.match(2, NS, doc, 0, claim_s=5)["wait"] == 8
    assert state.match(1, (b"\x03" * 32, b"null"), doc, 0, claim_s=5)["wait"] == 0
    assert write(state, 1, doc) == 8  # the commit fulfils client 1's claim
    hit = state.match(3, NS, other_question, 0, claim_s=5)
    assert hit["wait"] == 0 and hit["num_tokens"] == 6
    # A claim goes with its client; expired claims are dropped.
    state.drop_client(2)
    assert all(c.cid != 2 for c in state.claims.live)
    state.match(3, NS, toks(7, 7, 7, 7), 0, claim_s=1e-6)
    import time

    time.sleep(0.01)
    assert state.match(1, NS, toks(7, 7, 7, 7), 0, claim_s=5)["wait"] == 0
    state.check_invariants()


def test_a_stale_socket_is_replaced_and_the_lock_goes_with_the_server(tmp_path):
    path = str(tmp_path / "s.sock")
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(path)  # a sidecar that died: its file stays, nobody listens, nobody holds the lock
    dead.close()
    first = Server(Sidecar(1 << 16), path)
    first.listen()
    try:
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(path)  # the new sidecar listens on the old path
        with pytest.raises(
            ServeError, match="already serving .* stop it first, or give this one another --socket"
        ):
            Server(Sidecar(1 << 16), path).listen()
    finally:
        first.close()  # as serve() does when it ends
    assert not os.path.exists(path)
    second = Server(Sidecar(1 << 16), path)
    second.listen()  # the lock was free again
    second.close()


def test_no_cycle_of_clients_waiting_for_each_other_and_marks_expire(monkeypatch):
    """Who waits for whom: a match that would close a cycle (directly or through a third client)
    computes instead; a waiter's mark goes with its client, with its next match that does not
    wait, or WAIT_MARK_S after its last poll (a waiter that gave up)."""
    from radixkv.sidecar import claims

    state = Sidecar(B * 64)
    for c in (1, 2, 3):
        state.add_client(c)
        state.hello(c, SMALL)
    x, y, z = toks(1, 1, 1, 1, 1), toks(2, 2, 2, 2, 2), toks(3, 3, 3, 3, 3)  # two whole blocks each
    for cid, prompt in ((1, x), (2, y), (3, z)):
        assert state.match(cid, NS, prompt, 0, claim_s=5)["wait"] == 0  # each claims its own
    assert state.match(1, NS, y, 0, claim_s=5)["wait"] == 4  # 1 waits for 2
    assert state.match(2, NS, z, 0, claim_s=5)["wait"] == 4  # 2 waits for 3
    assert state.match(3, NS, x, 0, claim_s=5)["wait"] == 0  # 3 -> 1 -> 2 -> 3: refused
    assert state.match(2, NS, x, 0, claim_s=5)["wait"] == 0  # 2 -> 1 -> 2: refused
    assert state.claims.waiting == {1: (2, state.claims.waiting[1][1])}  # 2 stopped waiting
    state.drop_client(1)
    assert 1 not in state.claims.waiting
    # A waiter that gave up: its mark is forgotten WAIT_MARK_S after its last poll.
    monkeypatch.setattr(claims, "WAIT_MARK_S", 0.0)
    assert state.match(3, NS, y, 0, claim_s=5)["wait"] == 4  # 3 waits for 2 (mark expires at once)
    assert state.match(2, NS, z, 0, claim_s=5)["wait"] == 4  # not a cycle any more
    state.check_invariants()
