"""The sidecar with real processes: a document one process computed is served to a fresh one,
never to another model or namespace; a sidecar killed mid-generation and a client killed
mid-write cost speed, never tokens. Every output is checked against stock generate()."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch

import hf_patch
from hf_patch.keys.weights import model_scope
from tests.hf_models import assert_same_as_stock, build, ids, left_pad, tokens
from tests.sidecar_process import (
    BS,
    DOC_LEN,
    ROOT,
    client_env,
    document,
    run_client,
    sidecar_stats,
    start_sidecar,
)

DOC_BLOCKS_TOKENS = DOC_LEN // BS * BS


@pytest.fixture
def sock(tmp_path_factory):
    # A short path: AF_UNIX paths are limited to 107 bytes.
    path = tmp_path_factory.mktemp("sc") / "s.sock"
    proc = start_sidecar(path)
    yield path
    proc.kill()
    proc.wait()


def test_fresh_processes_read_what_another_computed_never_half_writes_or_other_keys(sock):
    # Process A commits document 4 (written through), pins it, takes blocks for document 3 and
    # writes half of them, then is SIGKILLed before committing.
    res = subprocess.run(
        [sys.executable, "-m", "tests.sidecar_process", "half-write", "--socket", str(sock),
         "--doc-seed", "3", "--pin-seed", "4"],
        env=client_env(sock), cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == -signal.SIGKILL, res.stdout[-2000:] + res.stderr[-2000:]
    stats = sidecar_stats(sock)
    assert (
        stats["open_leases"] == stats["open_txns"] == stats["private_blocks"] == stats["pinned_blocks"] == 0
    )
    assert stats["released_pins"] == 1 and stats["aborted_blocks"] == DOC_LEN // BS
    # A fresh process B: document 4's whole blocks come from the sidecar; another model of the
    # same shape (other weights), another namespace and the half-written document read nothing.
    # B then computes document 8 and exits at once: its prefixes reach the sidecar on the way out.
    runs = ["4:12", "4:12::7", "4:12:tenant-b", "3"]
    b = run_client(sock, "client", *(x for r in runs for x in ("--run", r)), "--exit-doc", "8")
    assert b["cached"] == [DOC_BLOCKS_TOKENS, 0, 0, 0] and b["remote_hit_tokens"] == DOC_BLOCKS_TOKENS
    stats = sidecar_stats(sock)
    assert stats["open_leases"] == stats["pinned_blocks"] == stats["open_txns"] == 0 and stats["pools"] == 1
    model = build("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=sock)
    cache, _ = assert_same_as_stock(
        model, ids(document(8) + tokens(6, 81)), store, max_new_tokens=2, do_sample=False
    )
    assert cache.cached_tokens == [DOC_BLOCKS_TOKENS]


def test_sidecar_killed_mid_generation_then_a_new_one_is_used(tmp_path_factory, caplog):
    path = tmp_path_factory.mktemp("sc") / "s.sock"
    proc = start_sidecar(path)
    model = build("llama-sdpa")
    writer = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    reader = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    doc = document(5)
    assert_same_as_stock(model, ids(doc + tokens(6, 50)), writer, max_new_tokens=3, do_sample=False)
    assert writer.remote.flush(30)

    class KillSidecar:  # runs after the prefill: the prefix was read from the sidecar already
        def __call__(self, input_ids, scores):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            return scores

    prompt = ids(doc + tokens(6, 51))
    stock = model.generate(prompt, max_new_tokens=6, do_sample=False)
    with caplog.at_level(logging.WARNING, logger="radixkv.sidecar.client"):
        cache = hf_patch.RadixCache(reader)
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, past_key_values=cache,
                             logits_processor=[KillSidecar()])  # fmt: skip
        assert torch.equal(out, stock) and cache.cached_tokens == [DOC_BLOCKS_TOKENS]
        assert proc.poll() is not None
        # Later calls serve from the local pool only, still equal to stock.
        for seed in (52, 53):
            assert_same_as_stock(model, ids(doc + tokens(6, seed)), reader, max_new_tokens=3, do_sample=False)
        reader.remote.flush(10)
    gone = [r for r in caplog.records if "gone" in r.getMessage() or "no sidecar" in r.getMessage()]
    assert len(gone) == 1, [r.getMessage() for r in caplog.records]
    assert reader.stats()["sidecar_connected"] == 0

    # A new sidecar on the socket: the reader writes to it again without a restart, and a third
    # store reads through it.
    proc = start_sidecar(path)
    try:
        other = document(6)
        for attempt in range(50):  # the first calls may fall inside the reconnect backoff (<= 2 s)
            assert_same_as_stock(
                model, ids(other + tokens(6, 60 + attempt)), reader, max_new_tokens=2, do_sample=False
            )
            reader.remote.flush(10)
            if reader.stats()["sidecar_connected"]:
                break
            time.sleep(0.2)
        assert reader.stats()["sidecar_connects"] == 2
        assert_same_as_stock(model, ids(other + tokens(6, 99)), reader, max_new_tokens=2, do_sample=False)
        assert reader.remote.flush(30)
        third = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        cache, _ = assert_same_as_stock(
            model, ids(other + tokens(6, 98)), third, max_new_tokens=2, do_sample=False
        )
        assert cache.cached_tokens == [DOC_BLOCKS_TOKENS]
    finally:
        proc.kill()
        proc.wait()


def test_a_sidecar_full_of_pinned_blocks_degrades(tmp_path_factory):
    path = tmp_path_factory.mktemp("sc") / "s.sock"
    model = build("llama-sdpa")
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048)
    block_bytes = BS * a.pool.bytes_per_token
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # 12 blocks: one document of 10 and a bit
    proc = start_sidecar(path, str(12 * block_bytes), "--metrics-port", str(port))
    try:
        a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        c = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        assert_same_as_stock(model, ids(document(7) + tokens(2, 70)), a, max_new_tokens=1, do_sample=False)
        assert a.remote.flush(30)
        ns = (model_scope(model), None)
        held = b.acquire(document(7) + [3], ns)  # pins the document's 10 blocks in the sidecar
        assert held.remote is not None and held.num_tokens == DOC_BLOCKS_TOKENS
        # Another document finds 2 free blocks and every other one pinned: it is cached in part
        # or not at all there, and served right by everyone.
        assert_same_as_stock(model, ids(document(8) + tokens(2, 80)), c, max_new_tokens=1, do_sample=False)
        assert c.remote.flush(30)
        stats = sidecar_stats(path)
        assert stats["uncached_tokens"] > 0 and stats["pinned_blocks"] == DOC_LEN // BS
        # The stats connection just closed leaves the sidecar's client table when the sidecar
        # reads its end, which may come after this scrape: wait (bounded) for the 3 stores.
        deadline = time.monotonic() + 30
        while True:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
            if "radixkv_sidecar_clients 3\n" in metrics or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert f"radixkv_sidecar_pinned_blocks {DOC_LEN // BS}" in metrics
        assert "radixkv_sidecar_clients 3\n" in metrics, [
            line for line in metrics.splitlines() if "clients" in line
        ]
        held.release()
        assert_same_as_stock(model, ids(document(8) + tokens(2, 81)), c, max_new_tokens=1, do_sample=False)
        assert c.remote.flush(30)
        # Unpinned now: the LRU document made room for the new one, which another store reads.
        cache, _ = assert_same_as_stock(
            model, ids(document(8) + tokens(2, 82)), a, max_new_tokens=1, do_sample=False
        )
        assert cache.cached_tokens == [DOC_BLOCKS_TOKENS]
        assert sidecar_stats(path)["evicted_blocks"] > 0
    finally:
        proc.kill()
        proc.wait()


def until_told_to_wait(path, thread: threading.Thread) -> None:
    """Until the sidecar has told a client to wait (B polls for A's prefix), not a fixed sleep."""
    deadline = time.monotonic() + 60
    while sidecar_stats(path)["waits"] == 0:
        assert thread.is_alive() and time.monotonic() < deadline, "B never waited"
        time.sleep(0.02)


def test_a_prefix_another_process_is_computing_is_waited_for(sock, monkeypatch):
    monkeypatch.setenv("RADIXKV_SIDECAR_WAIT_S", "60")
    model = build("llama-sdpa")
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=sock)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=sock)
    ns = (model_scope(model), None)
    doc = document(9)
    a.acquire(doc + tokens(6, 90), ns).release()  # A missed the document: it claims it
    prompt = ids(doc + tokens(6, 91))
    stock = model.generate(prompt, max_new_tokens=3, do_sample=False)
    result = {}

    def replica_b():
        cache = hf_patch.RadixCache(b)
        result["out"] = model.generate(prompt, max_new_tokens=3, do_sample=False, past_key_values=cache)
        result["cached"] = cache.cached_tokens

    thread = threading.Thread(target=replica_b)
    thread.start()
    until_told_to_wait(sock, thread)  # B is polling for A's document now
    assert_same_as_stock(model, ids(doc + tokens(6, 90)), a, max_new_tokens=3, do_sample=False)
    thread.join(120)
    assert torch.equal(result["out"], stock) and result["cached"] == [DOC_BLOCKS_TOKENS]
    assert b.stats()["sidecar_waited"] == 1


def test_a_batch_waits_for_a_prefix_in_flight_and_keeps_it_beside_a_cold_row(sock, monkeypatch):
    """B's batch: a row over the document A is computing, and a cold row. The wait must happen
    before the batch decides it is cold (in-batch sharing's look-up): a row served from the
    sidecar after that lost its hit to the batch's common column count (its cold neighbour's 0),
    and two ranks computed the document twice (batchrun: 1.14-1.21x one process's tokens)."""
    monkeypatch.setenv("RADIXKV_SIDECAR_WAIT_S", "60")
    model = build("llama-sdpa")
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=sock)
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=sock)
    ns = (model_scope(model), None)
    doc = document(12)
    a.acquire(doc + tokens(6, 90), ns).release()  # A missed the document: it claims it
    input_ids, mask = left_pad([doc + tokens(6, 91), tokens(30, 92)])
    stock = model.generate(input_ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    result = {}

    def replica_b():
        cache = hf_patch.RadixCache(b)
        result["out"] = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            past_key_values=cache,
        )
        result["cached"] = cache.cached_tokens

    thread = threading.Thread(target=replica_b)
    thread.start()
    until_told_to_wait(sock, thread)  # B is polling for A's document now
    assert_same_as_stock(model, ids(doc + tokens(6, 90)), a, max_new_tokens=3, do_sample=False)
    thread.join(120)
    assert torch.equal(result["out"], stock)
    assert result["cached"] == [DOC_BLOCKS_TOKENS, 0] and b.stats()["sidecar_waited"] == 1
    # In-batch sharing read the document from the sidecar (then extended it locally for the row).
    assert b.stats()["bytes_from_remote"] == DOC_BLOCKS_TOKENS * b.pool.bytes_per_token


def test_host_tier_blocks_are_written_through_and_a_padded_batch_reads_the_sidecar(sock):
    model = build("llama-sdpa")
    a = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, host_cache_tokens=2048, sidecar=sock)
    docs = [document(30), document(31)[:30]]  # 10 and 7 whole blocks
    for d in docs:
        assert_same_as_stock(model, ids(d + tokens(6, 300)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30)
    before = sidecar_stats(sock)["inserted_tokens"]
    with a._lock:  # every unpinned device block demoted: A's blocks now live on its host tier
        a._make_room_locked(0, a.pool.num_blocks)
    assert a.stats()["host_cached_blocks"] > 0
    # A new prefix over a host-resident one: its write-through copies from A's host pool.
    longer = docs[0] + tokens(8, 301)
    assert_same_as_stock(model, ids(longer + tokens(3, 302)), a, max_new_tokens=2, do_sample=False)
    assert a.remote.flush(30) and sidecar_stats(sock)["inserted_tokens"] > before
    # B, empty, reads both documents from the sidecar in one left-padded batch.
    b = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=sock)
    rows = [longer + tokens(5, 303), docs[1] + tokens(4, 304)]
    input_ids, mask = left_pad(rows)
    cache, _ = assert_same_as_stock(
        model, input_ids, b, attention_mask=mask, max_new_tokens=3, do_sample=False
    )
    # A rectangular batch preloads one common column count: L = min(pad + match) over the rows.
    pads = [input_ids.shape[1] - len(r) for r in rows]
    common = min(p + m for p, m in zip(pads, [len(longer) // BS * BS, len(docs[1]) // BS * BS]))
    assert cache.cached_tokens == [common - p for p in pads] and min(cache.cached_tokens) > 0
    # In-batch sharing read the documents from the sidecar to extend them (not counted as hits);
    # every byte of B's prefixes came from there.
    bpt = b.pool.bytes_per_token
    assert b.stats()["bytes_from_remote"] >= bpt * (len(longer) // BS * BS + len(docs[1]) // BS * BS)


def test_kv_of_a_call_whose_weights_changed_meanwhile_is_not_cached():
    # Its KV belongs to no one weights; a sidecar would file it under the new identity.
    model = build("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=2048)

    class ChangeWeights:
        def __call__(self, input_ids, scores):
            with torch.no_grad():
                model.model.layers[0].mlp.up_proj.weight.mul_(1.01)
            return scores

    model.generate(ids(document(40)), past_key_values=hf_patch.RadixCache(store), max_new_tokens=2,
                   do_sample=False, logits_processor=[ChangeWeights()])  # fmt: skip
    assert store.stats()["inserted_tokens"] == 0
    assert_same_as_stock(model, ids(document(40)), store, max_new_tokens=2, do_sample=False)
    assert store.stats()["inserted_tokens"] > 0  # unchanged weights: cached as ever


def test_drain_reports_commits_written_and_lost_and_never_hangs_on_a_hung_sidecar(tmp_path, caplog):
    """``SidecarTier.drain`` (the demo's shutdown, demo.shutdown_sidecar): a live sidecar takes
    every queued commit; a hung one (SIGSTOP) costs the bound, and what was queued or being
    written then is reported lost; a missing one fails every write at once."""
    from demo.shutdown_sidecar import flush_sidecar
    from radixkv import pack_tokens

    model = build("llama-sdpa")
    path = tmp_path / "s.sock"
    proc = start_sidecar(path)
    try:
        live = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
        missing = hf_patch.build_store(
            model, block_size=BS, budget_tokens=2048, sidecar=tmp_path / "none.sock"
        )
        prompts = [document(seed) + tokens(6, 1000) for seed in (21, 22)]
        for store in (live, missing):
            for prompt in prompts:
                assert_same_as_stock(model, ids(prompt), store, max_new_tokens=2, do_sample=False)
        assert live.stats()["sidecar_written_commits"] == 2 and live.remote.drain(30)[1] == 0
        assert missing.stats()["sidecar_failed_writes"] == 2  # at once, before any drain
        started = time.monotonic()
        assert flush_sidecar(missing, time.monotonic() + 30) == (0, 0)
        assert time.monotonic() - started < 1.0

        # The sidecar hangs while two commits wait: one being written (blocked on its reply), one queued.
        proc.send_signal(signal.SIGSTOP)
        ns = (model_scope(model), None)
        for prompt in prompts:  # their blocks are in the local pool: the writer asks the sidecar
            live.remote.push(pack_tokens(prompt), ns)
        started = time.monotonic()
        with caplog.at_level(logging.INFO, logger="demo.shutdown_sidecar"):
            assert flush_sidecar(live, time.monotonic() + 4) == (0, 2)  # bound: a quarter of 4 s
        assert time.monotonic() - started < 1.0 + 1.0  # the bound, not the call timeout (10 s)
        assert "2 commits queued for the sidecar" in caplog.text and "were dropped" in caplog.text
        assert live.stats()["sidecar_queued_writes"] == 0
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
    assert flush_sidecar(None, time.monotonic() + 30) is None
    assert (
        flush_sidecar(hf_patch.build_store(model, block_size=BS, budget_tokens=64), time.monotonic()) is None
    )
