"""The demo's HTTP API through Flask's test client (and once through the openai client).

One tiny built-in model and one engine are shared by the module; each test uses its own
prompt text, so what one test caches never decides another's outcome.
"""

from __future__ import annotations

import json
import uuid

import pytest

from demo.api.app import build_engine, create_app
from demo.config import Config

BLOCK = 16
TABLE = "Here is a table:\n" + "\n".join(f"| Alice {i} | {20 + i} | Berlin | baker |" for i in range(30))


@pytest.fixture(scope="module")
def engine():
    return build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 15))


def make_client(engine, **kw):
    return create_app(Config(model="builtin-tiny", block_size=BLOCK, **kw), engine).test_client()


@pytest.fixture(scope="module")
def client(engine):
    return make_client(engine)


def doc() -> str:
    """A long prompt no other test has sent."""
    return f"[{uuid.uuid4().hex}]\n{TABLE}\n"


def chat(client, content, headers=None, **kw):
    body = {
        "model": "builtin-tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        "temperature": 0,
        **kw,
    }
    r = client.post("/v1/chat/completions", json=body, headers=headers or {})
    assert r.status_code == 200, r.get_json()
    return r.get_json()


def cached(resp) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def sse(resp) -> list:
    """Parse an SSE body strictly: `data: ...` lines, each followed by a blank line."""
    text = resp.get_data(as_text=True)
    assert resp.mimetype == "text/event-stream"
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") and "\n" not in e for e in events[:-1])
    return [json.loads(e[6:]) for e in events[:-2]]


def test_models(client):
    r = client.get("/v1/models").get_json()
    assert r["object"] == "list" and r["data"][0]["id"] == "builtin-tiny"
    assert r["data"][0]["object"] == "model" and r["data"][0]["max_model_len"] == 1024


def test_chat_schema(client):
    r = chat(client, doc())
    assert (
        r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-") and r["model"] == "builtin-tiny"
    )
    (choice,) = r["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    u = r["usage"]
    assert u["completion_tokens"] <= 4 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert cached(r) == 0


def test_completions_schema(client):
    r = client.post("/v1/completions", json={"prompt": doc(), "max_tokens": 3, "temperature": 0}).get_json()
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    assert isinstance(r["choices"][0]["text"], str) and r["usage"]["completion_tokens"] <= 3
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2}).get_json()
    assert ids["usage"]["prompt_tokens"] == 4


def test_chat_stream_framing(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": doc()}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse(r)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
    assert all(c["usage"] is None for c in chunks[:-1])
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert deltas and all(deltas), deltas  # text came in content chunks, none of them empty
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    u = chunks[-1]["usage"]
    assert u["prompt_tokens"] > 0 and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_completions_stream_without_usage(client):
    chunks = sse(client.post("/v1/completions", json={"prompt": doc(), "max_tokens": 3, "stream": True}))
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_stream_equals_non_stream(client):
    prompt = doc()
    whole = chat(client, prompt, max_tokens=8)["choices"][0]["message"]["content"]
    chunks = sse(
        client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            },
        )
    )
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole


def test_cached_tokens_rise_on_repeated_prefix(client, engine):
    prefix = doc()
    first = chat(client, prefix + "Question: who is the oldest?")
    second = chat(client, prefix + "Question: who lives in Berlin?")
    assert cached(first) == 0
    assert 0 < cached(second) < second["usage"]["prompt_tokens"] and cached(second) % BLOCK == 0
    assert (
        cached(second) >= first["usage"]["prompt_tokens"] - 2 * BLOCK - 10
    )  # the shared part, block-rounded
    engine.check_invariants()


def test_second_turn_reuses_first(client):
    messages = [{"role": "user", "content": doc()}]
    first = chat(client, None, messages=messages, max_tokens=12)
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the youngest?"},
    ]
    second = chat(client, None, messages=messages)
    assert cached(second) >= first["usage"]["prompt_tokens"] // BLOCK * BLOCK - BLOCK


def test_tenant_isolation(engine):
    c = make_client(engine, api_keys=("key-a", "key-b"))
    a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-a"}):
        r = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}, headers=headers
        )
        assert r.status_code == 401 and r.get_json()["error"]["code"] == "invalid_api_key"
    assert c.get("/v1/models").status_code == 401
    prompt = doc()
    assert cached(chat(c, prompt, headers=a)) == 0
    assert cached(chat(c, prompt, headers=b)) == 0  # B never sees A's prefix
    assert cached(chat(c, prompt, headers=a)) > 0
    assert cached(chat(c, prompt, headers=b)) > 0  # B's own copy
    # The namespace comes from the key alone: client fields cannot pick another tenant's.
    # (B repeats A's prompt with A's very fields, so a namespace taken from them would hit.)
    prompt, fields = doc(), {"user": "key-a", "cache_salt": "key-a", "namespace": "key-a"}
    assert cached(chat(c, prompt, headers=a, **fields)) == 0
    assert cached(chat(c, prompt, headers=b, **fields)) == 0


def test_flush_needs_admin_token(engine):
    assert make_client(engine).post("/v1/cache/flush").status_code == 403
    c = make_client(engine, admin_token="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Admin-Token": "wrong"}):
        r = c.post("/v1/cache/flush", headers=headers)
        assert r.status_code == 401 and r.get_json()["error"]["type"] == "invalid_request_error"
    prompt = doc()
    chat(c, prompt)
    assert cached(chat(c, prompt)) > 0
    assert c.post("/v1/cache/flush", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert cached(chat(c, prompt)) == 0
    assert c.post("/v1/cache/flush", headers={"X-Admin-Token": "s3cret"}).get_json()["flushed"] is True
    engine.check_invariants()


def test_reuse_off_reports_nothing_cached():
    c = create_app(Config(model="builtin-tiny", reuse=False)).test_client()
    prompt = doc()
    assert cached(chat(c, prompt)) == 0 and cached(chat(c, prompt)) == 0
    assert "radixkv_prefix_reuse_enabled 0" in c.get("/metrics").get_data(as_text=True)


def test_cache_does_not_change_output(client):
    off = create_app(Config(model="builtin-tiny", reuse=False)).test_client()
    prefix = doc()
    for i, (question, sampling) in enumerate(
        [
            ("Who is the oldest?", {}),
            ("Who is a baker?", {}),
            ("Who is the oldest?", {}),
            ("Who is a pilot?", {"temperature": 1.0, "seed": 11}),
        ]
    ):
        on_r = chat(client, prefix + question, max_tokens=16, **sampling)
        off_r = chat(off, prefix + question, max_tokens=16, **sampling)
        assert on_r["choices"][0]["message"]["content"] == off_r["choices"][0]["message"]["content"]
        assert on_r["usage"]["completion_tokens"] == off_r["usage"]["completion_tokens"]
        assert (cached(on_r) > 0) == (i > 0)  # all but the first come from the cache
    assert len(set(on_r["choices"][0]["message"]["content"])) > 3  # varied text, not one repeated token


def test_stop_string_cuts_output(client):
    prompt = doc()
    full = chat(client, prompt, max_tokens=24)["choices"][0]["message"]["content"]
    assert len(full) > 4
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = chat(client, prompt, max_tokens=24, stop=[stop, "\x00never"])
    assert cut["choices"][0]["message"]["content"] == full[: full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_seed_and_length(client):
    prompt = doc()
    a = chat(client, prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    b = chat(client, prompt, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    r = chat(client, prompt, max_completion_tokens=5)
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"


def _too_long(engine):
    return {"messages": [{"role": "user", "content": "Alice " * (engine.context + 10)}]}


BAD = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", b"", 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"messages": ["hi"]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": 3}, 400),
    ("/v1/chat/completions", "too_long", 400),
    *[
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": v}, 400)
        for v in (0, -1, 10**9, "10", 1.5, True)
    ],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1020}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": "x"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400),
    *[
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra}, 400)
        for extra in (
            {"n": 0},
            {"n": 17},
            {"frequency_penalty": 2.5},
            {"presence_penalty": "x"},
            {"logit_bias": {"abc": 1}},
            {"logit_bias": {"99999": 1}},
            {"logit_bias": {"5": 101}},
            {"logit_bias": [1]},
            {"logprobs": "yes"},
            {"logprobs": True, "top_logprobs": 21},
            {"top_logprobs": 2},
            {"cache_prompt": "no"},
            {"cache_salt": ""},
            {"cache_salt": 5},
        )
    ],
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"}, 404),
    ("/v1/chat/completions", b"x" * (2 << 20), 413),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400),
    ("/v1/completions", {"prompt": None}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 6}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, 400),
    ("/v1/nope", {}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_refused_and_server_keeps_serving(client, engine, path, body, status):
    if body == "too_long":
        body = _too_long(engine)
    if isinstance(body, bytes):
        r = client.post(path, data=body, content_type="application/json")
    else:
        r = client.post(path, json=body)
    assert r.status_code == status
    err = r.get_json()["error"]
    assert err["type"] == "invalid_request_error" and isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    engine.check_invariants()
    assert chat(client, "still there?")["choices"][0]["message"]["role"] == "assistant"
    engine.check_invariants()


def test_too_long_prompt_has_a_code(client, engine):
    r = client.post("/v1/chat/completions", json=_too_long(engine))
    assert r.get_json()["error"]["code"] == "context_length_exceeded"


def test_metrics(client):
    prompt = doc()
    chat(client, prompt)
    chat(client, prompt)
    text = client.get("/metrics").get_data(as_text=True)
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["radixkv_prefix_reuse_enabled"] == 1
    assert values["radixkv_prefix_cache_hits_total"] > 0
    assert values["radixkv_prefix_cache_queries_total"] >= values["radixkv_prefix_cache_hits_total"]
    assert 0 < values["radixkv_prefix_cache_hit_rate"] <= 1
    assert "radixkv_prefix_cache_evictions_total" in values
    # Idle server: every block is free, cached (pinned is a subset) or retired by a flush.
    pool = {s: values[f'radixkv_pool_blocks{{state="{s}"}}'] for s in ("free", "cached", "pinned", "retired")}
    assert pool["cached"] > 0 and pool["pinned"] == 0
    assert pool["free"] + pool["cached"] + pool["retired"] == values["radixkv_pool_capacity_blocks"]
    assert values['radixkv_requests_total{endpoint="chat",status="200"}'] >= 2
    assert values['radixkv_ttft_seconds_count{endpoint="chat"}'] >= 2
    assert values['radixkv_request_seconds_bucket{endpoint="chat",le="+Inf"}'] >= 2


def test_page(client):
    html = client.get("/").get_data(as_text=True)
    assert "random" in html and "noise" in html and "chat.js" in html
    js = client.get("/static/chat.js").get_data(as_text=True)
    assert "include_usage" in js and "cached_tokens" in js


def test_openai_client_against_real_server(engine):
    import openai  # a dev dependency: a missing client must fail, not skip

    from demo.api.server import serving

    app = create_app(Config(model="builtin-tiny", api_keys=("sk-test",)), engine)
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["builtin-tiny"]
        prompt = doc()
        r = client.chat.completions.create(
            model="builtin-tiny", messages=[{"role": "user", "content": prompt}], max_tokens=5, temperature=0
        )
        assert r.choices[0].message.role == "assistant" and r.usage.prompt_tokens_details.cached_tokens == 0
        stream = client.chat.completions.create(
            model="builtin-tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            == r.choices[0].message.content
        )
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        c = client.completions.create(model="builtin-tiny", prompt=prompt, max_tokens=3)
        assert c.usage.completion_tokens <= 3
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="builtin-tiny", messages=[], max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_serves_a_local_checkpoint_directory(tmp_path):
    from demo.model.loading import build_builtin

    model, tokenizer = build_builtin("builtin-tiny")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    c = create_app(Config(model=str(tmp_path), device="cpu", cache_tokens=4096)).test_client()
    assert c.get("/v1/models").get_json()["data"][0]["id"] == tmp_path.name
    prompt = doc()
    first, second = chat(c, prompt, model=tmp_path.name), chat(c, prompt, model=str(tmp_path))
    assert second["choices"] == first["choices"] and cached(second) > 0
    off = create_app(Config(model="builtin-tiny", reuse=False)).test_client()
    assert chat(off, prompt)["choices"][0]["message"] == first["choices"][0]["message"]
