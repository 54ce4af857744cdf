"""Several clients at once against a real server on 127.0.0.1 (threads + requests).

The server handles HTTP concurrently and generates one request at a time (demo.engine.engine): every
client must get the same answer it would get alone, the queue must refuse politely when full,
a client that hangs up mid-stream must not hold the worker, and the store must stay intact.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from demo.api.app import build_engine, create_app
from demo.api.server import serving
from demo.config import Config

TABLE = "\n".join(f"| Bruno {i} | {30 + i} | Lima | pilot |" for i in range(25))
QUESTIONS = [f"Question {i}: who is number {i}?" for i in range(8)]


@pytest.fixture(scope="module")
def engine():
    return build_engine(Config(model="builtin-tiny", cache_tokens=1 << 15))


def ask(url: str, question: str, stream: bool, max_tokens: int = 12) -> tuple[str, dict]:
    body = {
        "messages": [{"role": "user", "content": TABLE + "\n" + question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }
    r = requests.post(url + "/v1/chat/completions", json=body, stream=stream, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        j = r.json()
        return j["choices"][0]["message"]["content"], j["usage"]
    text, usage, lines = "", None, [line for line in r.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        usage = chunk["usage"] or usage
        text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return text, usage


def test_concurrent_clients_get_their_own_answers(engine):
    app = create_app(Config(model="builtin-tiny"), engine)
    with serving(app) as url:
        alone = {q: ask(url, q, stream=False)[0] for q in QUESTIONS}  # sequential reference
        jobs = [(q, i % 2 == 0) for i, q in enumerate(QUESTIONS * 2)]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda job: ask(url, *job), jobs))
        elapsed = time.perf_counter() - start
    for (question, _), (text, usage) in zip(jobs, results):
        assert text == alone[question]
        assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the table is shared by all
    print(f"\n{len(jobs)} concurrent requests (8 clients) in {elapsed:.2f}s")
    assert elapsed < 60
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_full_queue_answers_503_then_recovers():
    config = Config(model="builtin-tiny", max_queue=1, cache_tokens=1 << 14)
    engine = build_engine(config)
    app = create_app(config, engine)
    with serving(app) as url:

        def post(i):
            body = {
                "messages": [{"role": "user", "content": f"{i} " + TABLE}],
                "max_tokens": 150,
                "temperature": 0,
            }
            return requests.post(url + "/v1/chat/completions", json=body, timeout=120)

        with ThreadPoolExecutor(max_workers=10) as pool:
            responses = list(pool.map(post, range(10)))
        codes = sorted(r.status_code for r in responses)
        assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
        busy = next(r for r in responses if r.status_code == 503).json()["error"]
        assert busy["code"] == "busy" and busy["type"] == "server_error"
        assert ask(url, "after the rush", stream=False)[0] is not None
    engine.check_invariants()


@pytest.fixture(scope="module")
def endless():
    """An engine whose model never emits EOS: a generation runs to max_tokens unless it is
    cancelled, so a cancellation test cannot pass because the reply happened to end early."""
    e = build_engine(Config(model="builtin-tiny", cache_tokens=1 << 14))
    cfg = e.model.generation_config
    cfg.suppress_tokens = [*(cfg.suppress_tokens or []), *e.runner.eos]
    return e


def spy_submit(engine, monkeypatch) -> list:
    """The Generation of every request the engine is given, in order."""
    gens, submit = [], engine.submit

    def spy(*args, **kwargs):
        gens.append(submit(*args, **kwargs))
        return gens[-1]

    monkeypatch.setattr(engine, "submit", spy)
    return gens


LONG = 900  # tokens; ~4 s on two CPU cores, far longer than the checks below allow


def assert_cut_short(engine, gen, url) -> None:
    assert gen.finished.wait(60), "the worker never finished the abandoned request"
    assert gen.cancelled.is_set() and gen.generated < LONG, gen.generated
    start = time.perf_counter()
    text, usage = ask(url, "next one", stream=False, max_tokens=4)
    waited = time.perf_counter() - start
    assert usage["completion_tokens"] == 4 and waited < 10, waited
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_client_hanging_up_mid_stream_frees_the_worker(endless, monkeypatch):
    gens = spy_submit(endless, monkeypatch)
    app = create_app(Config(model="builtin-tiny"), endless)
    with serving(app) as url:
        body = {
            "messages": [{"role": "user", "content": "hang up"}],
            "max_tokens": LONG,
            "temperature": 1.0,
            "stream": True,
        }
        r = requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=120)
        assert r.status_code == 200, r.text  # a refused request would "hang up" vacuously
        lines = (line for line in r.iter_lines() if line)
        next(lines), next(lines)  # the role chunk, then a token: generation is running
        r.close()  # hang up
        assert_cut_short(endless, gens[0], url)


def test_non_streaming_client_hanging_up_frees_the_worker(endless, monkeypatch):
    # Nothing is written to a non-streaming client until the end, so only watching its
    # socket can tell that it left; before that check the worker generated all LONG tokens.
    gens = spy_submit(endless, monkeypatch)
    app = create_app(Config(model="builtin-tiny"), endless)
    with serving(app) as url:
        body = {"messages": [{"role": "user", "content": "walk away"}], "max_tokens": LONG}
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(url + "/v1/chat/completions", json=body, timeout=0.5)
        assert_cut_short(endless, gens[0], url)
        metrics = requests.get(url + "/metrics", timeout=10).text
        assert 'radixkv_requests_total{endpoint="chat",status="499"} 1' in metrics
