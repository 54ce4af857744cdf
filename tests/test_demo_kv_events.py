"""End to end: a real server with --kv-events-config. A subscriber that knows only vLLM's
schema (tests.test_kv_events.Rebuilt) rebuilds the blocks the server caches from a replay of
its batches: as many as /metrics counts, the prompt's tokens, nothing after a flush, and the
same hashes when the same prompt is cached again."""

import json
import re
import signal
import time

import pytest
import requests

from tests.demo_process import start_demo
from tests.test_kv_events import Rebuilt

zmq = pytest.importorskip("zmq")


def replay_all(sock) -> list[bytes]:
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads = []
    while True:
        _, seq, payload = sock.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            return payloads
        payloads.append(payload)


def cached_blocks(url: str) -> int:
    text = requests.get(url + "/metrics", timeout=30).text
    return int(re.search(r'^radixkv_pool_blocks\{state="cached"\} (\d+)', text, re.M).group(1))


def test_a_router_rebuilds_what_the_server_caches_from_its_events(tmp_path):
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/pub",
        "replay_endpoint": f"ipc://{tmp_path}/replay",
        "topic": "kv",
    }
    args = ["--model", "builtin-tiny", "--block-size", "16", "--port", "0", "--admin-token", "t"]
    proc, url = start_demo([*args, "--kv-events-config", json.dumps(config)], str(tmp_path / "log"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(config["replay_endpoint"])
    sock.setsockopt(zmq.RCVTIMEO, 30_000)

    def rebuilt_when(done) -> Rebuilt:  # batches leave within ~50 ms of a change: ask until seen
        for _ in range(600):
            rebuilt = Rebuilt()
            for payload in replay_all(sock):
                rebuilt.apply(payload)
            if done(rebuilt):
                return rebuilt
            time.sleep(0.05)
        raise AssertionError("the events never showed the change")

    body = {"messages": [{"role": "user", "content": "tell me a story " * 12}], "max_tokens": 4}
    try:
        assert requests.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        n = cached_blocks(url)
        assert n >= 4
        first = rebuilt_when(lambda r: len(r.prefixes()) == n).prefixes()
        assert {medium for medium, _, _ in first} == {"GPU"}
        assert all(len(tokens) % 16 == 0 for _, _, tokens in first)
        r = requests.post(url + "/v1/cache/flush", headers={"Authorization": "Bearer t"}, timeout=30)
        assert r.status_code == 200 and cached_blocks(url) == 0
        rebuilt_when(lambda r: not r.prefixes() and r.blocks == {})
        assert requests.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        again = rebuilt_when(lambda r: len(r.prefixes()) == cached_blocks(url)).prefixes()
        shared = set(first) & set(again)  # the prompt's blocks: the same hashes as before the flush
        assert len(shared) >= 4
    finally:
        sock.close(0)
        ctx.term()
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def test_a_real_sidecar_publishes_what_its_clients_share(tmp_path):
    """``python -m radixkv.sidecar --kv-events-config``: a client's prompt reaches the sidecar's
    shared tier, and the sidecar's replayed events (medium CPU) hold its whole blocks; a second
    store reading them shows the same prefix was served from the sidecar."""
    import hf_patch
    from tests.hf_models import assert_same_as_stock, build, ids, tokens
    from tests.sidecar_process import start_sidecar

    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"ipc://{tmp_path}/side.pub",
        "replay_endpoint": f"ipc://{tmp_path}/side.replay",
    }
    path = tmp_path / "s.sock"
    proc = start_sidecar(path, "16M", "--kv-events-config", json.dumps(config))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(config["replay_endpoint"])
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        model = build("llama-sdpa")
        writer = hf_patch.build_store(model, block_size=4, budget_tokens=512, sidecar=path)
        doc = tokens(22, 901)
        assert_same_as_stock(model, ids(doc + tokens(3, 902)), writer, max_new_tokens=2, do_sample=False)
        assert writer.remote.flush(30)
        for _ in range(600):
            rebuilt = Rebuilt()
            for payload in replay_all(sock):
                rebuilt.apply(payload)
            held = {tokens for medium, _, tokens in rebuilt.prefixes() if medium == "CPU"}
            if tuple(doc[:20]) in held:
                break
            time.sleep(0.05)
        assert tuple(doc[:20]) in held and all(len(t) % 4 == 0 for t in held)
        assert {medium for medium, _, _ in rebuilt.prefixes()} == {"CPU"}
        reader = hf_patch.build_store(model, block_size=4, budget_tokens=512, sidecar=path)
        cache, _ = assert_same_as_stock(
            model, ids(doc + tokens(3, 903)), reader, max_new_tokens=2, do_sample=False
        )
        assert cache.cached_tokens == [20]
    finally:
        sock.close(0)
        ctx.term()
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
