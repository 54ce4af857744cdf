"""Hang-ups under continuous batching (issue 28, item 10), on the real server (waitress): four
non-streaming clients hang up while another request runs. The worker asks whether a client is
still there itself, before it runs a request and between decode steps, so a request whose client
left costs at most one decode chunk (it used to run until its own thread next looked, and the
store received their tokens), and its 499 is counted when the hang-up happens, not once later
requests finish."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import requests

from demo.api.app import build_engine, create_app
from demo.api.server import serving
from demo.config import Config
from demo.engine import generation

CHUNK = 16


def count_499(url: str) -> int:
    text = requests.get(url + "/metrics", timeout=30).text
    return sum(int(n) for n in re.findall(r'radixkv_requests_total\{[^}]*status="499"[^}]*\} (\d+)', text))


def test_gone_clients_cost_at_most_one_decode_chunk_and_count_as_499_at_once(monkeypatch):
    # The request threads look at their clients late (as a busy machine may make them):
    # what bounds the cost must be the worker's own check.
    monkeypatch.setattr(generation, "ALIVE_EVERY", 60.0)
    config = Config(model="builtin-tiny", cache_tokens=16384, decode_chunk=CHUNK)
    engine = build_engine(config)
    app = create_app(config, engine)
    no_eos = {str(engine.tokenizer.eos_token_id): -100}
    submitted: list = []
    real_submit = engine.submit

    def recording_submit(*args, **kwargs):
        gen = real_submit(*args, **kwargs)
        submitted.append(gen)
        return gen

    monkeypatch.setattr(engine, "submit", recording_submit)

    def body(prompt: str) -> bytes:
        return json.dumps(
            {"prompt": prompt, "max_tokens": 300, "temperature": 0, "logit_bias": no_eos}
        ).encode()

    with serving(app) as url:
        host, port = url.removeprefix("http://").split(":")
        kept = {}
        runner = threading.Thread(
            target=lambda: kept.update(
                r=requests.post(url + "/v1/completions", data=body("the one kept"), timeout=300)
            )
        )
        runner.start()
        deadline = time.monotonic() + 60
        while not (submitted and submitted[0].generated > 2 * CHUNK) and time.monotonic() < deadline:
            time.sleep(0.01)
        gone = []
        for i in range(4):
            s = socket.create_connection((host, int(port)), timeout=30)
            data = body(f"a client that leaves {i}")
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(data)}\r\n\r\n".encode()
                + data
            )
            gone.append(s)
        while len(submitted) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(submitted) == 5
        for s in gone:
            s.close()
        counted = 0
        while counted < 4 and runner.is_alive():
            counted = count_499(url)
            time.sleep(0.05)
        assert counted == 4 and runner.is_alive()  # counted while the kept request still runs
        runner.join(300)
    assert kept["r"].status_code == 200 and kept["r"].json()["usage"]["completion_tokens"] == 300
    leavers = submitted[1:]
    assert all(g.finished.is_set() for g in leavers)
    assert all(g.generated <= CHUNK for g in leavers), [g.generated for g in leavers]
