"""Snapshots of recurrent state through a real sidecar process (one for the module): a store with
states commits in one process and another client reads its KV and snapshot, byte for byte; pins
and writes go with a client killed mid-write; a hybrid model (Qwen3.5 text: attention + Gated
DeltaNet) and a pure Mamba-2 computed in this process are read by a fresh process, whose output
equals stock generate(), and what that process computed is read back here.
(test_sidecar_snapshot_state.py: the sidecar's state in one process.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import torch

import hf_patch
from radixkv import pack_tokens
from tests.hf_models import one_torch_thread  # noqa: F401 (a fixture)
from tests.hybrid_models import build_hybrid, tokens
from tests.sidecar_process import (
    BS,
    ROOT,
    client_env,
    hybrid_same_as_stock,
    run_client,
    sidecar_stats,
    start_sidecar,
    state_entry,
    state_store,
)
from tests.test_hf_recurrent import DOC, INTERVAL

FAMILIES = ("qwen3_5_text", "mamba2")


@pytest.fixture(scope="module")
def sock(tmp_path_factory):
    path = tmp_path_factory.mktemp("ss") / "s.sock"
    proc = start_sidecar(path, "16M")
    yield path
    proc.kill()
    proc.wait()


def settled(path, timeout: float = 30) -> dict:
    """The sidecar's stats once nothing is pinned or open (a release is sent without a reply:
    the sidecar may read it after the next stats request)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = sidecar_stats(path)
        held = stats["open_leases"] + stats["open_txns"] + stats["pinned_blocks"] + stats["private_snapshots"]
        if held == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def check_accounting(stats: dict) -> None:
    """What the sidecar's counters must say of its own state: snapshots within their share,
    blocks and snapshots within the budget."""
    assert stats["used_state_bytes"] <= stats["state_budget_bytes"] <= stats["budget_bytes"], stats
    assert stats["used_bytes"] <= stats["budget_bytes"], stats
    assert stats["cached_snapshots"] > 0 and stats["used_state_bytes"] > 0, stats


@pytest.mark.parametrize("kv", [True, False], ids=["kv+states", "states-only"])
def test_another_client_reads_the_kv_and_snapshot_a_store_committed_byte_for_byte(sock, kv):
    a, b = state_store(sock, kv=kv), state_store(sock, kv=kv)
    layers = len(a.pool.layers)
    toks, k, v, snaps = state_entry(11 + kv, 28, (8, 20), layers)  # 7 blocks; snapshots at 8 and 20
    a.commit(toks, k, v, snapshots=snaps)
    assert a.remote.flush(30)
    assert a.stats()["sidecar_written_snapshots"] == 2 and a.stats()["sidecar_failed_writes"] == 0
    # B holds nothing: the sidecar's match is usable to its deepest snapshot (20; A's commit cached
    # its KV that far only: none could be served past it).
    with b.acquire(toks + [5], None) as lease:
        assert lease.remote is not None and lease.num_tokens == lease.kv_tokens == 20
        ks = [torch.zeros(1, 2, 20, 16) for _ in range(layers)]
        vs = [torch.zeros(1, 2, 20, 16) for _ in range(layers)]
        b.read([lease], 20, ks, vs)
        out = [torch.zeros(8, 64), torch.zeros(3, 5, dtype=torch.bfloat16)]
        assert b.read_state(lease, out)
        assert all(torch.equal(x, y[:, :, :20]) for x, y in zip(ks + vs, k + v))
        assert all(torch.equal(x, y) for x, y in zip(out, snaps[20]))
        pinned = sidecar_stats(sock)
        assert pinned["open_leases"] == 1 and pinned["pinned_blocks"] == 5
    stats = b.stats()
    assert stats["remote_snapshots_read"] == stats["snapshots_read"] == 1
    assert stats["bytes_from_remote"] == 20 * b.pool.bytes_per_token
    # B's local snapshot at 8 (it commits what it read) is not asked for again: the sidecar has it.
    b.commit(toks[:20], ks, vs, snapshots={8: snaps[8], 20: out})
    assert b.remote.flush(30) and b.stats()["sidecar_written_snapshots"] == 0
    stats = settled(sock)
    assert stats["open_leases"] == stats["pinned_blocks"] == stats["private_snapshots"] == 0, stats
    check_accounting(stats)


def test_snapshots_on_the_host_tier_are_written_through_from_there(sock):
    """A store whose nodes (and their snapshots) were demoted before the write: the writer copies
    the snapshots from the host tier's state pool."""
    on = []
    a = state_store(sock, host=True, namer=lambda ns: (b"\x06" * 32, b"null") if on else None)
    toks, k, v, snaps = state_entry(21, 24, (8, 16))
    a.commit(toks, k, v, snapshots=snaps)  # kept local: the namer says no key yet
    with a._lock:
        a._make_room_locked(0, a.pool.num_blocks)
    assert a.stats()["host_snapshots"] == 2 and a.stats()["snapshots"] == 0
    on.append(True)
    a.remote.push(pack_tokens(toks[:16]), None)  # what the commit would have queued
    assert a.remote.flush(30) and a.stats()["sidecar_written_snapshots"] == 2
    b = state_store(sock, namer=lambda ns: (b"\x06" * 32, b"null"))
    with b.acquire(toks, None) as lease:
        out = [torch.zeros(8, 64), torch.zeros(3, 5, dtype=torch.bfloat16)]
        assert lease.num_tokens == 16 and b.read_state(lease, out)
        assert all(torch.equal(x, y) for x, y in zip(out, snaps[16]))


def test_a_client_killed_while_writing_snapshots_leaves_nothing_held(tmp_path_factory):
    """A process commits a document with snapshots, pins it, takes blocks and snapshot slots for
    another, writes half, and is SIGKILLed: its pin, blocks and slots are freed (a sidecar of its
    own, whose one pool's bytes in use must then be exactly those of its cached blocks and
    snapshots: a slot or block leaked would show), what it committed stays served."""
    from radixkv.sidecar.layout import KVLayout

    path = tmp_path_factory.mktemp("sk") / "s.sock"
    proc = start_sidecar(path, "16M")
    try:
        res = subprocess.run(
            [sys.executable, "-m", "tests.sidecar_process", "half-write-states", "--socket", str(path),
             "--doc-seed", "31", "--pin-seed", "32"],
            env=client_env(path), cwd=ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert res.returncode == -signal.SIGKILL, res.stdout[-2000:] + res.stderr[-2000:]
        stats = settled(path)
        assert stats["open_leases"] == stats["open_txns"] == stats["pinned_blocks"] == 0, stats
        assert stats["private_snapshots"] == stats["private_blocks"] == 0
        assert (
            stats["aborted_snapshots"] == 3 and stats["aborted_blocks"] == 6 and stats["released_pins"] == 1
        )
        b = state_store(path)
        layout = KVLayout.from_json(b.remote.layout)
        assert (
            stats["used_state_bytes"]
            == stats["cached_snapshots"] * layout.slot_stride
            == 2 * layout.slot_stride
        )
        assert stats["used_bytes"] == stats["cached_blocks"] * layout.block_bytes + stats["used_state_bytes"]
        # What it committed stays served; what it half wrote is nowhere.
        pinned_doc, _, _, snaps = state_entry(32, 24, (8, 16))
        with b.acquire(pinned_doc, None) as lease:
            out = [torch.zeros(8, 64), torch.zeros(3, 5, dtype=torch.bfloat16)]
            assert lease.num_tokens == 16 and b.read_state(lease, out)
            assert all(torch.equal(x, y) for x, y in zip(out, snaps[16]))
        half_doc, _, _, _ = state_entry(31, 24, ())
        with b.acquire(half_doc, None) as lease:
            assert lease.num_tokens == 0 and lease.remote is None
        check_accounting(settled(path))
    finally:
        proc.kill()
        proc.wait()


def test_a_fresh_process_reads_a_hybrid_models_document_through_the_sidecar(sock):
    """The issue's check: process A (here) computes a document and a question through
    ``build_store(model, sidecar=...)``; a fresh process B asks another question over the
    document: its output equals stock (checked there) and it read the document from the sidecar,
    to the deepest snapshot on the shared path (the interval: 64 of 70 tokens). B's own commit
    reaches the sidecar at its exit: a third store here then reads to B's junction snapshot (68,
    where its prompt and A's part), which A never took."""
    doc_blocks = len(DOC) // BS * BS
    for name in FAMILIES:
        model = build_hybrid(name)
        a = hf_patch.build_store(
            model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL, sidecar=sock
        )
        assert hybrid_same_as_stock(model, torch.tensor([DOC + tokens(9, seed=2)]), a).cached_tokens == [0]
        assert a.stats()["sidecar_written_snapshots"] > 0
    b = run_client(sock, "hybrid", *(x for name in FAMILIES for x in ("--run", f"{name}:3")))
    want = doc_blocks - doc_blocks % INTERVAL  # 64: the deepest interval snapshot within the document
    assert [r["cached"] for r in b] == [want] * len(FAMILIES), b
    assert all(r["remote_hit_tokens"] == want and r["remote_snapshots_read"] == 1 for r in b), b
    for name in FAMILIES:
        model = build_hybrid(name)
        c = hf_patch.build_store(
            model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL, sidecar=sock
        )
        cache = hybrid_same_as_stock(model, torch.tensor([DOC + tokens(7, seed=4)]), c)
        assert cache.cached_tokens == [doc_blocks] and c.stats()["remote_hit_tokens"] == doc_blocks
    stats = settled(sock)
    assert stats["open_leases"] == stats["pinned_blocks"] == stats["open_txns"] == 0, stats
    check_accounting(stats)
