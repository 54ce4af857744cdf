"""Two sidecars on one L2 tier (a shared directory, a real redis-server on loopback): a prefix
computed through the first is served through the second; damaged values are refused and an L2
that is down costs speed only. Every output is checked against stock generate()."""

from __future__ import annotations

import time

import pytest

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
