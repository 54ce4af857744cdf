"""What careless and hostile clients found (issue 12): each test failed before its fix.

Bad field types, streams that hang up or fail half-way, out-of-range seeds, a full queue,
non-ASCII keys, password guessing, and half-open connections against the real server.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest
import requests

from demo.api.app import build_engine, create_app
from demo.api.server import Limits, serving
from demo.config import Config
from demo.engine.engine import Engine


@pytest.fixture(scope="module")
def engine():
    e = build_engine(Config(model="builtin-tiny", cache_tokens=1 << 14))
    cfg = e.model.generation_config
    cfg.suppress_tokens = [*(cfg.suppress_tokens or []), *e.runner.eos]  # replies run to max_tokens
    return e


@pytest.fixture(scope="module")
def client(engine):
    return create_app(Config(model="builtin-tiny"), engine).test_client()


def chat(content: str = "hi", **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def error(r, status: int) -> dict:
    assert r.status_code == status, r.get_data(as_text=True)
    return r.get_json()["error"]


def count(metrics: str, endpoint: str, status: int) -> int:
    m = re.search(rf'radixkv_requests_total{{endpoint="{endpoint}",status="{status}"}} (\d+)', metrics)
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("role", [["user"], {"user": 1}, 3, None])
def test_role_of_the_wrong_type_is_a_400(client, role):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": role, "content": "x"}]})
    assert error(r, 400)["param"] == "messages[0].role"


def test_seed_is_bounded_to_int64(client):
    for seed in (2**63, -(2**63) - 1, 2**64):
        err = error(client.post("/v1/chat/completions", json=chat(seed=seed)), 400)
        assert err["param"] == "seed" and "9223372036854775807" in err["message"]
    for seed in (2**63 - 1, -(2**63), 0):
        assert client.post("/v1/chat/completions", json=chat(seed=seed, temperature=1)).status_code == 200


@pytest.mark.parametrize("value", [[], "yes", 1, False])
def test_stream_options_must_be_an_object(client, value):
    r = client.post("/v1/chat/completions", json=chat(stream=True, stream_options=value))
    assert error(r, 400)["param"] == "stream_options"


def test_generation_failing_mid_stream_is_counted_as_500(engine, monkeypatch):
    app = create_app(Config(model="builtin-tiny"), engine)

    def fail_after_a_token(*args, **kwargs):
        streamer = kwargs["streamer"]
        streamer.put(kwargs.get("input_ids", args[0] if args else None))  # the prompt
        ids = kwargs.get("input_ids", args[0] if args else None)
        streamer.put(ids[:, -1:])  # one token per row
        raise RuntimeError("boom")

    monkeypatch.setattr(engine.model, "generate", fail_after_a_token)
    from hf_patch.running_batch import RunningBatch

    steps, step = [], RunningBatch.step

    def fail_at_the_second_step(self, **kwargs):  # the step loop: a token out, then the failure
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("boom")
        return step(self, **kwargs)

    monkeypatch.setattr(RunningBatch, "step", fail_at_the_second_step)
    r = app.test_client().post("/v1/chat/completions", json=chat(stream=True, max_tokens=8))
    body = r.get_data(as_text=True)
    assert "generation failed" in body
    monkeypatch.undo()
    metrics = app.test_client().get("/metrics").get_data(as_text=True)
    assert count(metrics, "chat", 500) == 1 and count(metrics, "chat", 200) == 0, metrics


def test_stream_hang_up_is_counted_as_499(engine):
    app = create_app(Config(model="builtin-tiny"), engine)
    with serving(app) as url:
        body = chat("hang up", max_tokens=600, stream=True)
        r = requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60)
        lines = (line for line in r.iter_lines() if line)
        next(lines), next(lines)  # role chunk, then a token
        r.close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            metrics = requests.get(url + "/metrics", timeout=10).text
            if count(metrics, "chat", 499):
                break
            time.sleep(0.2)
        assert count(metrics, "chat", 499) == 1 and count(metrics, "chat", 200) == 0, metrics


class Gate:
    """Holds the engine's model.generate(), or rows being seated in its step loop
    (RunningBatch.seat), until opened; `entered` is set when one is held."""

    def __init__(self, model, monkeypatch):
        from hf_patch.running_batch import RunningBatch

        self.entered, self.open = threading.Event(), threading.Event()

        def hold(call):
            def held(*args, **kwargs):
                self.entered.set()
                assert self.open.wait(60)
                return call(*args, **kwargs)

            return held

        monkeypatch.setattr(model, "generate", hold(model.generate))
        monkeypatch.setattr(RunningBatch, "seat", hold(RunningBatch.seat))


def test_full_queue_refuses_before_tokenising_with_retry_after(engine, monkeypatch):
    small = Engine(engine.model, engine.tokenizer, engine.context, reuse=False, max_queue=1)
    app = create_app(Config(model="builtin-tiny", max_queue=1), small)
    gate = Gate(engine.model, monkeypatch)
    tokenised = []
    chat_ids = small.chat_ids
    monkeypatch.setattr(small, "chat_ids", lambda m: tokenised.append(1) or chat_ids(m))
    results = []

    def post(text):
        results.append(app.test_client().post("/v1/chat/completions", json=chat(text)).status_code)

    first = threading.Thread(target=post, args=("running",))
    first.start()
    assert gate.entered.wait(30)
    second = threading.Thread(target=post, args=("waiting",))
    second.start()
    deadline = time.monotonic() + 30
    while small.queued < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    before = len(tokenised)
    r = app.test_client().post("/v1/chat/completions", json=chat("refused"))
    try:
        assert error(r, 503)["code"] == "busy"
        assert int(r.headers["Retry-After"]) >= 1
        assert len(tokenised) == before, "the refused prompt was tokenised"
    finally:
        gate.open.set()
        first.join(60), second.join(60)
    assert results == [200, 200]


def test_non_ascii_keys_match_when_sent_as_utf8(engine):
    app = create_app(Config(model="builtin-tiny", api_keys=("clé-ünï",), admin_token="sécret"), engine)
    with serving(app) as url:
        good = {"Authorization": "Bearer clé-ünï".encode()}
        assert requests.get(url + "/v1/models", headers=good, timeout=10).status_code == 200
        latin1 = {"Authorization": "Bearer clé-ünï".encode("latin-1")}
        assert requests.get(url + "/v1/models", headers=latin1, timeout=10).status_code == 401
        admin = {"X-Admin-Token": "sécret".encode()}
        assert requests.post(url + "/v1/cache/flush", headers=admin, timeout=10).status_code == 200


def test_repeated_failed_auth_from_one_address_is_refused_for_a_while(engine):
    app = create_app(Config(model="builtin-tiny", api_keys=("right",)), engine)
    c = app.test_client()
    here, elsewhere = {"REMOTE_ADDR": "10.0.0.1"}, {"REMOTE_ADDR": "10.0.0.2"}
    wrong, right = {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer right"}
    codes = [c.get("/v1/models", headers=wrong, environ_base=here).status_code for _ in range(30)]
    assert codes[0] == 401 and codes[-1] == 429, codes
    r = c.get("/v1/models", headers=right, environ_base=here)
    assert error(r, 429)["code"] == "too_many_failed_attempts" and int(r.headers["Retry-After"]) >= 1
    assert c.get("/v1/models", headers=right, environ_base=elsewhere).status_code == 200
    r = c.post("/v1/cache/flush", headers={"X-Admin-Token": "x"}, environ_base=here)
    assert r.status_code == 429


def test_guessing_the_admin_token_on_the_cache_file_endpoints_is_throttled_too(engine, tmp_path):
    config = Config(model="builtin-tiny", admin_token="right", cache_dir=str(tmp_path))
    c = create_app(config, engine).test_client()
    here, wrong = {"REMOTE_ADDR": "10.0.0.3"}, {"X-Admin-Token": "wrong"}
    codes = [c.get("/v1/cache/files", headers=wrong, environ_base=here).status_code for _ in range(30)]
    assert codes[0] == 401 and codes[-1] == 429, codes
    r = c.post("/v1/cache/save", headers={"X-Admin-Token": "right"}, json={"name": "a"}, environ_base=here)
    assert error(r, 429)["code"] == "too_many_failed_attempts"
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_throttle_memory_is_bounded_and_refills():
    from demo.api.auth_throttle import Throttle

    now = [0.0]
    t = Throttle(burst=3, per_second=1.0, max_clients=100, clock=lambda: now[0])
    for i in range(10_000):
        t.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(t) <= 100
    for _ in range(3):
        assert t.retry_after("a") == 0
        t.failed("a")
    assert t.retry_after("a") >= 1
    now[0] += 1.0
    assert t.retry_after("a") == 0


@pytest.mark.parametrize("front_ends", [1, 2, 3, 10, 16])
def test_front_ends_together_allow_no_more_guesses_than_one_server(front_ends):
    """--api-server-count n: a client's connections may land on every front end; the tries all
    of them let through, at once and after a refill, are at most one server's (and >= 1 each)."""
    from demo.api.auth_throttle import Throttle

    now = [0.0]
    one = Throttle(clock=lambda: now[0])
    shares = [Throttle.shared_by(front_ends) for _ in range(front_ends)]
    for t in shares:
        t._clock = lambda: now[0]

    def tries(throttles) -> int:
        n = 0
        for t in throttles:
            while t.retry_after("a") == 0:
                t.failed("a")
                n += 1
        return n

    alone, together = tries([one]), tries(shares)
    assert alone == 10 and front_ends <= together <= max(alone, front_ends)
    now[0] += 50.0  # one server refills 10 tries in 50 s
    assert tries(shares) <= max(tries([one]), front_ends)
    with pytest.raises(ValueError, match="front_ends"):
        Throttle.shared_by(0)


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def test_half_open_connections_never_reach_the_app_nor_stall_it(engine):
    app = create_app(Config(model="builtin-tiny"), engine)
    calls = []
    wsgi = app.wsgi_app
    app.wsgi_app = lambda environ, start: calls.append(environ["PATH_INFO"]) or wsgi(environ, start)
    with serving(app) as url:
        one = _raw(url)
        one.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        one.close()
        socks = []
        for _ in range(200):
            s = _raw(url)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        for s in socks:
            s.close()
        start = time.perf_counter()
        assert requests.get(url + "/health", timeout=10).status_code == 200
        waited = time.perf_counter() - start
        time.sleep(0.5)
        metrics = requests.get(url + "/metrics", timeout=10).text
    assert waited < 2.0, waited
    assert calls == ["/health", "/metrics"], calls[:5]
    assert "radixkv_requests_total{" not in metrics


def test_idle_half_sent_request_is_closed_after_the_timeout(engine):
    app = create_app(Config(model="builtin-tiny"), engine)
    with serving(app, limits=Limits(idle_timeout=1)) as url:
        s = _raw(url)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and then nothing
        start = time.perf_counter()
        assert s.recv(1024) == b""  # closed by the server, not by our 10 s socket timeout
        assert time.perf_counter() - start < 5
        s.close()
