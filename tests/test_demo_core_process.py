"""End to end: the engine core in its own process (--api-server-count 2), real processes.

One server for the module: two front ends and an engine process. Its answers (through the
real openai client) must equal the in-process app's over the same model (which the other
demo tests hold to stock generate()); then the faults, with kill -9: a front end's death
loses only its own connections, an engine's makes the front ends answer 503 at once and the
supervisor starts it again; SIGTERM stops every process.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import openai
import pytest
import requests

from demo.api.app import build_engine, create_app
from demo.config import Config
from tests.demo_process import start_demo

pytest.importorskip("zmq")
BLOCK = 16
ARGS = ["--model", "builtin-tiny", "--block-size", str(BLOCK), "--cache-tokens", "16384", "--port", "0"]
ARGS += ["--api-server-count", "2", "--max-batch-size", "8", "--admin-token", "adm"]
ADMIN = {"X-Admin-Token": "adm"}
DOC = "A staff list:\n" + "\n".join(f"| Greta {i} | {20 + i} | Porto | nurse |" for i in range(12)) + "\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("core")
    log = str(folder / "server.log")
    proc, url = start_demo([*ARGS, "--cache-file", str(folder / "cache.rkv")], log)
    yield proc, url, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def local():
    """The in-process app over the same model: the reference answers."""
    engine = build_engine(
        Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=16384, max_batch_size=8)
    )
    return create_app(Config(model="builtin-tiny", block_size=BLOCK), engine).test_client()


@pytest.fixture(scope="module")
def no_eos(local):
    """A logit_bias that keeps a reply going to its max_tokens (the random model may end early)."""
    engine = local.application.extensions["radixkv"]["engine"]
    return {str(e): -100 for e in engine.runner.eos}


def pids(log: str) -> tuple[int, list[int]]:
    """(engine pid, front end pids by index) as the supervisor logged them, latest first."""
    text = open(log).read()
    engine = [int(p) for p in re.findall(r"engine process: pid (\d+)", text)]
    fronts: dict[int, int] = {}
    for index, pid in re.findall(r"front end (\d+): pid (\d+)", text):
        fronts[int(index)] = int(pid)
    return engine[-1], [fronts[i] for i in sorted(fronts)]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
REQUESTS = [
    ("chat", {"messages": [{"role": "user", "content": DOC + "How old is Greta 4?"}], "max_tokens": 12, "temperature": 0}),
    ("chat", {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "n": 3, "temperature": 1, "seed": 7}),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "logprobs": True, "top_logprobs": 3, "temperature": 0}),
    ("completions", {"prompt": DOC + "Greta 7 is", "max_tokens": 10, "temperature": 0, "logprobs": 2}),
    ("completions", {"prompt": "abc", "max_tokens": 16, "n": 2, "temperature": 0.8, "seed": 3, "stop": [" the", "a"]}),
    ("chat", {"messages": [{"role": "user", "content": "JSON"}], "max_tokens": 40, "temperature": 0, "n": 2,
              "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": OBJECT}}}),
]  # fmt: skip


def _strip(answer: dict) -> dict:
    answer = {k: v for k, v in answer.items() if k not in ("id", "created")}
    answer["usage"] = {
        k: v for k, v in answer["usage"].items() if k in ("prompt_tokens", "completion_tokens")
    }
    return answer


@pytest.mark.parametrize("endpoint, body", REQUESTS)
def test_answers_through_the_split_equal_the_in_process_apps(server, local, endpoint, body):
    _, url, _ = server
    c = client(url)
    create = c.chat.completions.create if endpoint == "chat" else c.completions.create
    remote = create(model="builtin-tiny", **body).model_dump(exclude_none=True)
    shape = openai.types.chat.ChatCompletion if endpoint == "chat" else openai.types.Completion
    ref = shape.model_validate(local_json(local, endpoint, body)).model_dump(exclude_none=True)
    assert _strip(remote) == _strip(ref)
    # streamed: the same text per choice
    stream = create(model="builtin-tiny", stream=True, **body)
    texts: dict[int, str] = {}
    for chunk in stream:
        for ch in chunk.choices:
            piece = ch.delta.content if endpoint == "chat" else ch.text
            texts[ch.index] = texts.get(ch.index, "") + (piece or "")
    want = {
        ch["index"]: ch["message"]["content"] if endpoint == "chat" else ch["text"] for ch in ref["choices"]
    }
    assert texts == want


def local_json(local, endpoint: str, body: dict) -> dict:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    resp = local.post(path, json=body)
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return resp.get_json()


def test_metrics_forwarded_routes_and_bad_input(server):
    _, url, _ = server
    text = requests.get(url + "/metrics", timeout=30).text
    assert "radixkv_prefix_cache_queries_total" in text or "radixkv_prefix_reuse_enabled 1" in text
    assert 'radixkv_requests_total{endpoint="chat",status="200"}' in text or "radixkv_requests_total" in text
    assert requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "builtin-tiny"
    load = requests.get(url + "/get_load", timeout=30)  # the gateway's route: the engine's app
    assert load.status_code == 200 and load.json()[0]["num_reqs"] == 0
    flush = requests.post(url + "/v1/cache/flush", timeout=30)  # no admin token: refused by name
    assert flush.status_code == 401 and flush.json()["error"]["code"] == "invalid_admin_token"
    assert requests.post(url + "/v1/cache/flush", headers=ADMIN, timeout=30).json()["flushed"] is True
    bad = requests.post(url + "/v1/chat/completions", json={"messages": "x"}, timeout=30)
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    unknown = requests.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_the_responses_store_is_one_for_every_front_end(server, local):
    """A stored response is read, continued and deleted from whichever front end a new
    connection lands on (the kernel spreads connections over the two: 12 tries reach both
    with probability 1 - 2**-11), and answers as the in-process app does."""
    _, url, _ = server
    body = {"input": DOC + "Who is Greta 3?", "max_output_tokens": 8, "temperature": 0}
    first = client(url).responses.create(model="builtin-tiny", **body)
    ref = local.post("/v1/responses", json=body).get_json()
    assert first.output_text == "".join(
        c["text"] for i in ref["output"] if i["type"] == "message" for c in i["content"]
    )
    for _ in range(12):  # a fresh client each time: a new connection
        got = client(url).responses.retrieve(first.id)
        assert got.id == first.id and got.output_text == first.output_text
    again = client(url).responses.create(
        model="builtin-tiny", previous_response_id=first.id, input="And Greta 5?", max_output_tokens=4
    )
    assert again.previous_response_id == first.id
    assert again.usage.input_tokens_details.cached_tokens >= BLOCK  # the stored conversation's prefix
    assert client(url).responses.delete(first.id) is None
    for _ in range(6):
        with pytest.raises(openai.NotFoundError):
            client(url).responses.retrieve(first.id)


def _count(text: str, line: str) -> float:
    found = [float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line + " ")]
    return found[0] if found else 0.0


def test_metrics_count_every_front_ends_requests_once(server):
    """/metrics is one registry, the engine process's: every scrape (a fresh connection each,
    spread by the kernel over the two front ends) shows the same counts, and they count the
    requests of both front ends; a forwarded request's error is counted once."""
    _, url, _ = server
    ok = 'radixkv_requests_total{endpoint="completions",status="200"}'
    denied = 'radixkv_requests_total{endpoint="flush",status="401"}'

    def scrapes() -> set[tuple[float, float]]:
        texts = [requests.get(url + "/metrics", timeout=30).text for _ in range(8)]
        return {(_count(t, ok), _count(t, denied)) for t in texts}

    [(done, refused)] = scrapes()
    for _ in range(6):  # fresh connections: both front ends answer some
        r = requests.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    assert requests.post(url + "/v1/cache/flush", timeout=30).status_code == 401  # forwarded
    assert scrapes() == {(done + 6, refused + 1)}


def _running(url: str) -> int:
    return requests.get(url + "/get_load", timeout=30).json()[0]["num_reqs"]


def test_a_hang_up_cancels_the_request_in_the_engine(server, no_eos):
    _, url, _ = server
    body = {"prompt": "a b c", "max_tokens": 900, "stream": True, "temperature": 0, "logit_bias": no_eos}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
    deadline = time.monotonic() + 5
    while _running(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(url) == 0


def _stream(url: str, out: list, index: int, no_eos: dict) -> None:
    body = {
        "prompt": f"{index} x y",
        "max_tokens": 200,
        "stream": True,
        "temperature": 0,
        "logit_bias": no_eos,
    }
    try:
        with requests.post(url + "/v1/completions", json=body, stream=True, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        out[index] = "done" if lines and lines[-1] == b"data: [DONE]" else f"cut: {lines[-1:]}"
    except requests.RequestException:
        out[index] = "reset"


def test_a_front_end_killed_loses_only_its_own_connections(server, no_eos):
    _, url, log = server
    _, fronts = pids(log)
    out: list = [None] * 10
    threads = [threading.Thread(target=_stream, args=(url, out, i, no_eos)) for i in range(10)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(fronts[0], signal.SIGKILL)
    for t in threads:
        t.join(90)
    assert all(o in ("done", "reset") for o in out), out  # nothing hangs, nothing half-answered
    assert "done" in out, out  # the other front end's streams end normally
    # the dead front end's requests are cancelled in the engine, and it is started again
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if pids(log)[1][0] != fronts[0] and _running(url) == 0:
            break
        time.sleep(0.2)
    assert pids(log)[1][0] != fronts[0] and _running(url) == 0
    r = client(url).completions.create(model="builtin-tiny", prompt="ok", max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_an_engine_killed_gives_503_at_once_then_restarts_from_the_cache_file(server, no_eos):
    _, url, log = server
    engine, _ = pids(log)
    question = {"prompt": DOC + "Greta 11 is", "max_tokens": 6, "temperature": 0}
    first = requests.post(url + "/v1/completions", json=question, timeout=60).json()
    saved = requests.post(url + "/v1/cache/save", headers=ADMIN, timeout=60)
    assert saved.status_code == 200 and saved.json()["saved"], saved.text
    body = {"prompt": "q r", "max_tokens": 900, "stream": True, "temperature": 0, "logit_bias": no_eos}
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith(b"data: ")
        os.kill(engine, signal.SIGKILL)
        started = time.monotonic()
        rest = [line for line in lines if line]
    assert time.monotonic() - started < 5  # the stream ends at once, with the reason in-band
    assert b"engine_unavailable" in b"".join(rest) and rest[-1] == b"data: [DONE]"
    refused = requests.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
    assert refused.headers["Retry-After"] == "1"
    deadline = time.monotonic() + 90  # the supervisor starts it again (model load included)
    while time.monotonic() < deadline:
        r = requests.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        if r.status_code == 200:
            break
        assert r.status_code == 503
        time.sleep(0.3)
    assert r.status_code == 200 and pids(log)[0] != engine
    again = requests.post(url + "/v1/completions", json=question, timeout=60).json()
    assert again["choices"] == first["choices"]  # the restarted engine answers alike, from the file
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK * (len(DOC) // 80)


def test_sigterm_stops_every_process(server):
    proc, _, log = server
    engine, fronts = pids(log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    for pid in (engine, *fronts):
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ", 1)[1].startswith("Z")
