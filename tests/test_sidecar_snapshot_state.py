"""The sidecar's state for layouts with recurrent-state snapshots, in one process: snapshot slots
private until commit and freed with their client, matches usable to the deepest snapshot, the
snapshots' share of the budget, layouts without KV layers, and snapshots in the L2 tier (a
``file:`` directory: the same value checks as Redis). test_sidecar_snapshots.py runs real
processes."""

from __future__ import annotations

import pytest

from radixkv.l2 import block_keys, open_l2, snapshot_key
from radixkv.l2.block_keys import SNAPSHOT_MARKER, key_identity
from radixkv.sidecar.layout import STATE_ONLY_BLOCKS, KVLayout
from radixkv.sidecar.state import Sidecar
from radixkv.tree import pack_tokens

B = 1024
KV = [{"num_kv_heads": 1, "k_head_dim": 64, "v_head_dim": 64, "dtype": "float32"}]  # 1 KiB blocks of 2
STATES = [{"shape": [128], "dtype": "float32"}, {"shape": [2, 128], "dtype": "bfloat16"}]  # 1 KiB
LAYOUT = {"block_size": 2, "layers": KV, "states": STATES}
NS = (b"\x01" * 32, b"null")


def toks(*ids: int) -> bytes:
    return bytes(pack_tokens(list(ids)))


def sidecar(budget=B * 64, state_bytes=None, **kw) -> Sidecar:
    state = Sidecar(budget, state_bytes=state_bytes, **kw)
    for cid in (1, 2):
        state.add_client(cid)
        state.hello(cid, LAYOUT)
    return state


def pool_of(state: Sidecar):
    return next(iter(state.pools.values()))


def snapshot(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(KVLayout.from_json(LAYOUT).snapshot_bytes))


def write(state, cid, ids: bytes, snaps: dict[int, bytes], ns=NS) -> dict:
    """Alloc with the snapshot positions, write every block and snapshot given, commit."""
    pool = pool_of(state)
    positions = sorted(snaps)
    txn = state.alloc(cid, ns, ids, positions)
    for slot in txn["slots"]:
        pool.geometry.write_block(pool.buf, slot, bytes([slot % 251]) * B)
    for pos, slot in zip(positions, txn["snaps"]):
        if slot >= 0:
            pool.geometry.write_snapshot(pool.buf, slot, snaps[pos])
    return state.commit_reply(cid, txn["txn"]) if txn["txn"] else {"inserted": 0, "snapshots": 0}


def test_snapshots_are_private_until_commit_and_a_match_is_usable_to_the_deepest():
    state = sidecar()
    pool = pool_of(state)
    assert pool.tree.stateful and pool.num_slots == (B * 64 // 4) // pool.slot_bytes
    doc = toks(*range(10, 22))  # six blocks
    txn = state.alloc(1, NS, doc, [4, 8])
    assert txn["start"] == 0 and len(txn["slots"]) == 6 and len(txn["snaps"]) == 2 and -1 not in txn["snaps"]
    for pos, slot in zip((4, 8), txn["snaps"]):
        pool.geometry.write_snapshot(pool.buf, slot, snapshot(pos))
    miss = state.match(2, NS, doc, 0)
    assert miss["num_tokens"] == 0 and miss["snap"] == -1  # written, not committed: invisible
    assert state.stats()["private_snapshots"] == 2
    assert state.commit_reply(1, txn["txn"]) == {"inserted": 12, "snapshots": 2}
    # Usable to the deepest snapshot (8 tokens); the KV goes on to 12: the junction.
    hit = state.match(2, NS, doc, 0)
    assert (hit["num_tokens"], hit["kv_tokens"], hit["snap"]) == (8, 12, txn["snaps"][1])
    assert hit["slots"] == txn["slots"][:4]
    assert pool.geometry.read_snapshot(pool.buf, hit["snap"]) == snapshot(8)
    assert state.match(2, NS, doc, 4)["slots"] == txn["slots"][2:4]  # the client held 4 tokens
    assert state.match(2, NS, doc, 8)["lease"] == 0
    # A second writer of the same document: only the snapshot it lacks gets a slot.
    again = state.alloc(2, NS, doc, [4, 8, 12])
    assert again["slots"] == [] and again["snaps"][:2] == [-1, -1] and again["snaps"][2] >= 0
    pool.geometry.write_snapshot(pool.buf, again["snaps"][2], snapshot(12))
    assert state.commit_reply(2, again["txn"]) == {"inserted": 0, "snapshots": 1}
    assert state.match(1, NS, doc, 0)["num_tokens"] == 12
    # Nothing to write: no transaction.
    assert state.alloc(2, NS, doc, [12])["txn"] == 0
    stats = state.stats()
    assert stats["cached_snapshots"] == 3 and stats["inserted_snapshots"] == 3 and stats["snapshot_hits"] == 3
    assert stats["used_state_bytes"] == 3 * pool.slot_bytes
    # Open writes and leases go with their client; snapshot slots are freed with the blocks.
    state.alloc(1, NS, toks(*range(50, 58)), [2, 6, 8])
    state.release(2, 1)
    state.drop_client(1)
    state.drop_client(2)
    stats = state.stats()
    assert (
        stats["open_txns"]
        == stats["open_leases"]
        == stats["pinned_blocks"]
        == stats["private_snapshots"]
        == 0
    )
    assert stats["aborted_snapshots"] == 3 and stats["aborted_blocks"] == 4
    state.check_invariants()


def test_bad_snapshot_positions_are_refused_and_change_nothing():
    state = sidecar()
    plain = Sidecar(B * 64)
    plain.add_client(1)
    plain.hello(1, {"block_size": 2, "layers": KV})
    with pytest.raises(ValueError, match="this layout holds no states"):
        plain.alloc(1, NS, toks(1, 2, 3, 4), [2])
    for bad in ([3], [6], [2, 4, 8]):  # not a block multiple; past the whole blocks
        with pytest.raises(ValueError, match="snaps: position"):
            state.alloc(1, NS, toks(1, 2, 3, 4, 5), bad)
    assert state.stats()["open_txns"] == 0 and state.stats()["pinned_blocks"] == 0
    state.check_invariants()


def test_snapshot_pressure_drops_snapshots_not_kv_and_takes_back_only_its_share():
    # 16 blocks of budget; snapshots take at most 4 (slots of 1 KiB each).
    state = sidecar(B * 16, state_bytes=B * 4)
    pool = pool_of(state)
    assert pool.num_slots == 4
    docs = [toks(*range(100 * i, 100 * i + 4)) for i in range(5)]  # two blocks each
    for i, doc in enumerate(docs):
        assert write(state, 1, doc, {4: snapshot(i)})["snapshots"] == 1
    stats = state.stats()
    # The fifth snapshot dropped the least recently used one; every document's KV stayed.
    assert stats["evicted_snapshots"] == 1 and stats["evicted_blocks"] == 0 and stats["cached_blocks"] == 10
    assert (
        state.match(2, NS, docs[0], 0)["num_tokens"] == 0 and state.match(2, NS, docs[0], 0)["kv_tokens"] == 4
    )
    assert state.match(2, NS, docs[4], 0)["num_tokens"] == 4
    # KV fills what the snapshots leave: 12 blocks of KV beside 4 snapshots is the whole budget.
    assert write(state, 1, toks(*range(900, 904)), {})["inserted"] == 4
    assert state.stats()["used_bytes"] == B * 16
    # A new snapshot then takes an old one's slot (the share is full): no KV goes for it.
    before = state.stats()["evicted_blocks"]
    assert write(state, 1, docs[0], {4: snapshot(9)})["snapshots"] == 1
    assert state.stats()["evicted_blocks"] == before and state.stats()["evicted_snapshots"] == 2
    state.check_invariants()


def test_blocks_may_use_the_snapshots_share_until_a_snapshot_takes_it_back():
    state = sidecar(B * 16, state_bytes=B * 4)
    docs = [toks(*range(100 * i, 100 * i + 4)) for i in range(8)]  # two blocks each: the whole budget
    for doc in docs:
        assert write(state, 1, doc, {})["inserted"] == 4
    assert state.stats()["used_bytes"] == B * 16 and state.stats()["used_state_bytes"] == 0
    # A snapshot of the last document: the least recently used KV (the first document) goes.
    assert write(state, 1, docs[7], {4: snapshot(7)}) == {"inserted": 0, "snapshots": 1}
    stats = state.stats()
    assert stats["evicted_blocks"] == 2 and stats["evicted_snapshots"] == 0
    assert stats["used_bytes"] == B * 15 and stats["used_state_bytes"] == B
    assert (
        state.match(2, NS, docs[0], 0)["kv_tokens"] == 0 and state.match(2, NS, docs[7], 0)["num_tokens"] == 4
    )
    state.check_invariants()


def test_a_layout_without_kv_layers_bounds_its_blocks_by_count():
    layout = {"block_size": 2, "layers": [], "states": STATES}
    state = Sidecar(B * 64)
    state.add_client(1)
    pool = state.hello(1, layout)
    assert pool.block_bytes == 0 and pool.num_blocks == B * 64 // 1024 <= STATE_ONLY_BLOCKS
    assert KVLayout.from_json(layout).state_only_blocks(1 << 40) == STATE_ONLY_BLOCKS
    doc = toks(*range(40))  # 20 blocks of no bytes
    txn = state.alloc(1, NS, doc, [20, 40])
    assert len(txn["slots"]) == 20 and -1 not in txn["snaps"]
    for pos, slot in zip((20, 40), txn["snaps"]):
        pool.geometry.write_snapshot(pool.buf, slot, snapshot(pos))
    state.commit(1, txn["txn"])
    hit = state.match(1, NS, doc, 0)
    assert hit["num_tokens"] == 40 and pool.geometry.read_snapshot(pool.buf, hit["snap"]) == snapshot(40)
    state.release(1, hit["lease"])
    # Blocks take no bytes of the budget; only their count bounds them: a longer document
    # evicts the least recently used ones.
    assert state.stats()["used_bytes"] == 2 * pool.slot_bytes
    long = toks(*range(1000, 1000 + 2 * pool.num_blocks))
    txn = state.alloc(1, NS, long, [2 * pool.num_blocks])
    assert len(txn["slots"]) == pool.num_blocks and state.stats()["evicted_blocks"] == 20
    state.commit(1, txn["txn"])
    state.check_invariants()


def test_snapshots_go_through_the_l2_checked_as_blocks(tmp_path):
    l2 = open_l2(f"file:{tmp_path}")
    a = sidecar(l2=l2, l2_writer=l2.put_many)  # committed blocks and snapshots go straight to the L2
    doc = toks(*range(10, 22))  # six blocks
    assert write(a, 1, doc, {4: snapshot(4), 8: snapshot(8)})["snapshots"] == 2
    keys = block_keys(NS[0], NS[1], list(range(10, 22)), 2)
    snap_keys = [snapshot_key(keys[p // 2 - 1]) for p in (4, 8)]
    assert all(k.endswith(SNAPSHOT_MARKER) and key_identity(k) == keys[0][:16] for k in snap_keys)
    assert len(list(tmp_path.rglob("*"))) - len([p for p in tmp_path.rglob("*") if p.is_dir()]) == 8
    # Another sidecar (another machine) with nothing in memory reads blocks and the deepest snapshot.
    b = sidecar(l2=l2)
    hit = b.match(2, NS, doc + toks(99), 0)
    assert (hit["num_tokens"], hit["kv_tokens"]) == (8, 12)
    assert pool_of(b).geometry.read_snapshot(pool_of(b).buf, hit["snap"]) == snapshot(8)
    assert b.counters.l2_snapshot_hits == 1 and b.counters.l2_hit_tokens == 8
    b.check_invariants()
    # A damaged snapshot value is refused (counted) and never served: the next one down is.
    damaged = tmp_path.joinpath(*l2._parts(snap_keys[1]))
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    c = sidecar(l2=l2)
    hit = c.match(2, NS, doc, 0)
    assert hit["num_tokens"] == 4 and pool_of(c).geometry.read_snapshot(
        pool_of(c).buf, hit["snap"]
    ) == snapshot(4)
    assert c.stats()["l2_refused"] == 1
    # A block's value copied under a snapshot's key is refused too (its header names its key).
    tmp_path.joinpath(*l2._parts(snap_keys[0])).write_bytes(
        tmp_path.joinpath(*l2._parts(keys[1])).read_bytes()
    )
    d = sidecar(l2=l2)  # (one L2 store object for all four: its counts add up)
    assert d.match(2, NS, doc, 0)["num_tokens"] == 0 and d.stats()["l2_refused"] == 1 + 2
    for s in (a, b, c, d):
        s.check_invariants()


def test_the_l2_writer_takes_a_value_over_its_bound_when_nothing_waits():
    """A snapshot may outweigh the writer's bound (Mamba-2's default: 261 MiB, the bound 256 MiB):
    it is written when nothing else waits, and dropped (counted) while something does."""
    import threading

    from radixkv.sidecar.l2_writer import L2Writer

    gate = threading.Event()

    class SlowL2:
        def __init__(self) -> None:
            self.got = []

        def put_many(self, items):
            gate.wait(30)
            self.got += [k for k, _ in items]
            return len(items)

    l2 = SlowL2()
    writer = L2Writer(l2, max_bytes=100)
    try:
        writer.put([(b"big", b"x" * 150)])  # nothing waits: taken
        writer.put([(b"next", b"y" * 10)])  # 150 bytes wait (or are being written): dropped
        assert writer.stats() == {"l2_queued_bytes": 150, "l2_dropped_blocks": 1}
        gate.set()
        assert writer.flush(30) and l2.got == [b"big"]
        writer.put([(b"small", b"z" * 60), (b"more", b"z" * 60)])  # the bound again: the second dropped
        assert writer.flush(30) and l2.got == [b"big", b"small"] and writer.stats()["l2_dropped_blocks"] == 2
    finally:
        gate.set()
        writer.close()
