"""Two sidecars on one L2 tier (a shared directory, a real redis-server on loopback): a prefix
computed through the first is served through the second, with its recurrent-state snapshots for
a hybrid model; damaged values are refused and an L2 that is down costs speed only. Every output
is checked against stock generate()."""

from __future__ import annotations

import time

import pytest
import torch

import hf_patch
from tests.hf_models import assert_same_as_stock, build, ids, tokens
from tests.redis_server import RedisServer, need_redis
from tests.sidecar_process import BS, DOC_LEN, document, sidecar_stats, start_sidecar

DOC_BLOCKS = DOC_LEN // BS


def wait_written(path, blocks: int) -> dict:
    """The sidecar's L2 writer runs in the background: wait until ``blocks`` were stored."""
    deadline = time.monotonic() + 60
    while True:
        stats = sidecar_stats(path)
        if stats.get("l2_writes", 0) >= blocks and stats.get("l2_queued_bytes", 0) == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def read_through(model, path, doc_seed: int, question_seed: int) -> int:
    """A fresh store on the sidecar at ``path`` generates document + question; cached tokens."""
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, sidecar=path)
    prompt = ids(document(doc_seed) + tokens(6, question_seed))
    cache, _ = assert_same_as_stock(model, prompt, store, max_new_tokens=2, do_sample=False)
    store.remote.close()
    return cache.cached_tokens[0]


@pytest.fixture(params=["file", "redis"])
def l2_url(request, tmp_path):
    if request.param == "file":
        (tmp_path / "l2").mkdir()
        yield f"file:{tmp_path / 'l2'}", None
        return
    need_redis()
    (tmp_path / "redis").mkdir()
    server = RedisServer(tmp_path / "redis").start()
    yield server.url, server
    server.kill()


def test_two_sidecars_on_one_l2(l2_url, tmp_path, tmp_path_factory):
    url, redis = l2_url
    model = build("llama-sdpa")
    socks = [tmp_path_factory.mktemp("sc") / "s.sock" for _ in range(2)]
    procs = [start_sidecar(s, "16M", "--l2", url) for s in socks]
    try:
        assert read_through(model, socks[0], 20, 200) == 0
        assert read_through(model, socks[0], 21, 210) == 0
        wait_written(socks[0], 2 * DOC_BLOCKS)
        # The second sidecar has never seen the document: its memory misses, the L2 serves it.
        assert read_through(model, socks[1], 20, 201) == DOC_BLOCKS * BS
        stats = sidecar_stats(socks[1])
        assert stats["l2_hit_tokens"] == DOC_BLOCKS * BS and stats["l2_refused"] == 0, stats
        # Another model reads nothing from the L2 (its identity is in every key).
        assert read_through(build("llama-sdpa", seed=3), socks[1], 20, 202) == 0

        # Damaged values are refused by their checksum, never served.
        if redis is None:
            for f in (tmp_path / "l2").rglob("*"):
                if f.is_file():
                    data = bytearray(f.read_bytes())
                    data[-1] ^= 0xFF
                    f.write_bytes(bytes(data))
        else:
            client = redis.client()
            for key in client.keys("*"):
                value = bytearray(client.get(key))
                value[-1] ^= 0xFF
                client.set(key, bytes(value))
        assert read_through(model, socks[1], 21, 211) == 0
        assert sidecar_stats(socks[1])["l2_refused"] > 0

        if redis is not None:  # Redis gone: sidecar memory only, outputs unchanged
            redis.kill()
            assert read_through(model, socks[1], 22, 220) == 0
            assert read_through(model, socks[1], 22, 221) == DOC_BLOCKS * BS
            assert sidecar_stats(socks[1])["l2_errors"] > 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_snapshots_through_redis_a_second_sidecar_serves_them_and_refuses_a_damaged_one(tmp_path_factory):
    """Hybrid (Qwen3.5 text) and Mamba-2 documents computed through one sidecar reach Redis with
    their snapshots; a second sidecar with nothing in memory serves them from there. Qwen's
    deepest snapshot on the shared path (at 64 tokens) is damaged in Redis first: refused,
    counted, and the next one down (48) is served; every output equals stock's."""
    need_redis()
    from hf_patch.keys.weights import model_scope
    from hf_patch.stores import sidecar_namer
    from radixkv.l2 import block_keys, snapshot_key
    from tests.hybrid_models import build_hybrid
    from tests.hybrid_models import tokens as hybrid_tokens
    from tests.sidecar_process import hybrid_same_as_stock
    from tests.test_hf_recurrent import DOC, INTERVAL

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    socks = [tmp_path_factory.mktemp("sc") / "s.sock" for _ in range(2)]
    procs = [start_sidecar(s, "16M", "--l2", server.url) for s in socks]
    families = {"qwen3_5_text": 48, "mamba2": 64}
    try:
        models = {name: build_hybrid(name) for name in families}

        def read_through(name, path, question_seed):
            store = hf_patch.build_store(
                models[name], block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL, sidecar=path
            )
            prompt = torch.tensor([DOC + hybrid_tokens(11, question_seed)])
            cached = hybrid_same_as_stock(models[name], prompt, store).cached_tokens[0]
            store.remote.close()
            return cached

        for name in families:
            assert read_through(name, socks[0], 2) == 0
        written = sidecar_stats(socks[0])
        wait_written(socks[0], written["inserted_tokens"] // BS + written["inserted_snapshots"])
        store = hf_patch.build_store(models["qwen3_5_text"], block_size=BS, budget_tokens=64)
        ident, ns = sidecar_namer(models["qwen3_5_text"], store.pool)(
            (model_scope(models["qwen3_5_text"]), None)
        )
        key = b"radixkv:" + snapshot_key(block_keys(ident, ns, DOC[:64], BS)[-1]).hex().encode()
        client = server.client()
        value = bytearray(client.get(key))
        value[-1] ^= 0xFF
        client.set(key, bytes(value))
        for name, want in families.items():
            assert read_through(name, socks[1], 3) == want, name
        stats = sidecar_stats(socks[1])
        assert stats["l2_snapshot_hits"] == 2 and stats["l2_refused"] == 1, stats
        assert stats["l2_hit_tokens"] == sum(families.values()), stats
    finally:
        for p in procs:
            p.kill()
            p.wait()
        server.kill()
