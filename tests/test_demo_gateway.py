"""The demo behind the SGLang Model Gateway (sglang-router, a dev dependency): the metadata it
reads from a worker, and the real router in front of two replica processes, where questions
about one document land on the replica that cached it (cache_aware)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import requests
from transformers import AutoTokenizer

from demo.api.app import build_engine, create_app
from demo.config import Config
from tests.demo_process import start_demo

DOCS = [
    f"Document {d}: a staff list.\n" + "\n".join(f"| Name {d}-{i} | {20 + i} | City {d} |" for i in range(20))
    for d in range(2)
]


@pytest.fixture(scope="module")
def client():
    engine = build_engine(Config(model="builtin-tiny", block_size=16, cache_tokens=4096))
    return engine, create_app(Config(model="builtin-tiny"), engine).test_client()


def test_server_and_model_info_name_the_model_and_a_tokenizer_the_gateway_can_load(client):
    engine, c = client
    for route in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        r = c.get(route)
        assert r.status_code == 200, route
        info = r.get_json()
        assert info["served_model_name"] == "builtin-tiny" and info["is_generation"] is True
        assert info["tokenizer_path"] == info["model_path"]
    server = c.get("/server_info").get_json()
    assert server["context_length"] == engine.context and server["page_size"] == 16
    assert server["max_total_num_tokens"] == engine.store.pool.num_blocks * 16
    loaded = AutoTokenizer.from_pretrained(server["tokenizer_path"])
    text = "a staff list | Name 1-2 | 22 |"
    assert loaded(text)["input_ids"] == engine.tokenizer(text)["input_ids"]
    assert loaded.chat_template == engine.tokenizer.chat_template


def test_get_load_counts_running_and_queued_requests_and_their_tokens(client):
    engine, c = client
    idle = c.get("/get_load").get_json()
    assert idle == [
        {"dp_rank": 0, "num_reqs": 0, "num_running_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    # a request the worker is generating: counted while it runs
    from demo.engine.engine import Params

    gen = engine.submit(engine.text_ids("a long answer please " * 4), Params(400, temperature=0.0))
    deadline = time.monotonic() + 30
    while engine.running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    busy = c.get("/get_load").get_json()[0]
    gen.cancel()
    gen.collect()
    assert busy["num_running_reqs"] == 1 and busy["num_reqs"] >= 1
    assert busy["num_tokens"] >= len(engine.text_ids("a long answer please " * 4))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_replica(log_path: str) -> tuple[subprocess.Popen, str]:
    return start_demo(
        ["--model", "builtin-tiny", "--block-size", "16", "--cache-tokens", "8192", "--port", "0"], log_path
    )


def start_router(
    urls: list[str], policy: str, log_path: str, extra: tuple[str, ...] | list[str] = ()
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prometheus-port", str(free_port()), "--policy", policy, *extra, "--worker-urls", *urls]
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            workers = requests.get(url + "/workers", timeout=2).json()["workers"]
            if len(workers) == len(urls) and all(w["is_healthy"] for w in workers):
                return proc, url
        except (requests.ConnectionError, requests.Timeout, KeyError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("router did not register the replicas:\n" + open(log_path).read()[-3000:])


def ask(url: str, doc: int, question: int) -> int:
    body = {
        "model": "builtin-tiny",
        "messages": [
            {
                "role": "user",
                "content": DOCS[doc] + f"\nQuestion {question}: how old is Name {doc}-{question}?",
            }
        ],
        "max_tokens": 2,
        "temperature": 0,
    }
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_router_sends_questions_about_one_document_to_the_replica_that_cached_it(tmp_path):
    replicas = [start_replica(str(tmp_path / f"replica{i}.log")) for i in range(2)]
    router = None
    try:
        urls = [url for _, url in replicas]
        router, gateway = start_router(urls, "cache_aware", str(tmp_path / "router.log"))
        workers = requests.get(gateway + "/workers", timeout=10).json()["workers"]
        assert {w["model_id"] for w in workers} == {"builtin-tiny"}  # from /model_info, not "unknown"
        assert ask(gateway, 0, 0) == 0 and ask(gateway, 1, 0) == 0  # each document computed once
        # two in a row about one document: round_robin would send the second to the other replica
        order = [(0, 1), (0, 2), (1, 1), (1, 2), (0, 3), (1, 3)]
        cached = [ask(gateway, d, q) for d, q in order]
        assert all(c >= 160 for c in cached), cached  # every later question hit its document
        log = open(tmp_path / "router.log", errors="replace").read()
        warnings = [line for line in log.splitlines() if " WARN " in line or " ERROR " in line]
        assert warnings == [], warnings  # no 404 fallbacks, tokenizer found
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        for proc, _ in replicas:
            proc.terminate()
            proc.wait(timeout=60)
