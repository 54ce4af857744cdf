"""Demo task prompts (--task-prompts / RADIXKV_TASK_PROMPTS, "task_id") and tier metrics."""

from __future__ import annotations

import json

import pytest

import demo.__main__ as demo_main
from demo.api import build_engine, create_app
from demo.config import Config, from_args
from demo.task_prompts import ENV, TaskPromptError, load, parse

BLOCK = 16
SUPPORT = "You are the support desk of Example Corp. " + " ".join(f"Rule {i}: be kind." for i in range(12))
TASKS = [{"task_id": "support", "prompt": SUPPORT}, {"task_id": "terse", "prompt": "Answer in one word."}]


@pytest.fixture(scope="module")
def engine():
    return build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 14))


def app_for(engine, **kw):
    config = Config(model="builtin-tiny", block_size=BLOCK, task_prompts_json=json.dumps(TASKS), **kw)
    return create_app(config, engine).test_client()


@pytest.fixture(scope="module")
def client(engine):
    return app_for(engine)


def chat(client, content, headers=None, **kw):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3, "temperature": 0, **kw}
    return client.post("/v1/chat/completions", json=body, headers=headers or {})


def test_a_task_request_hits_the_pinned_prompt_on_its_first_use_and_equals_an_explicit_system(client):
    r = chat(client, "where is my parcel 1?", task_id="support")
    assert r.status_code == 200, r.get_json()
    usage = r.get_json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 48  # the pinned task prompt, first request
    explicit = client.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": SUPPORT},
                {"role": "user", "content": "where is my parcel 1?"},
            ],
            "max_tokens": 3,
            "temperature": 0,
        },
    ).get_json()
    assert explicit["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    assert explicit["choices"][0]["message"] == r.get_json()["choices"][0]["message"]


def test_a_task_prompt_is_prepended_to_the_requests_own_system_message(client, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    r = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "task_id": "support"}
    )
    assert r.status_code == 200, r.get_json()
    want = engine.chat_ids([{"role": "system", "content": SUPPORT + "\n\nBe brief."}, messages[1]])
    assert r.get_json()["usage"]["prompt_tokens"] == len(want)


def test_completions_with_a_task_id_start_with_the_task_text(client, engine):
    r = client.post(
        "/v1/completions", json={"prompt": "Customer: hello", "max_tokens": 2, "task_id": "support"}
    )
    assert r.status_code == 200, r.get_json()
    usage = r.get_json()["usage"]
    assert usage["prompt_tokens"] == len(engine.text_ids(SUPPORT + "Customer: hello"))
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 48
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, "task_id": "support"})
    assert ids.get_json()["usage"]["prompt_tokens"] == len(engine.text_ids(SUPPORT)) + 3


@pytest.mark.parametrize(
    "task_id, message",
    [("nope", "unknown task_id 'nope' (known: 'support', 'terse')"), (7, "'task_id' must be a string")],
)
def test_an_unknown_or_malformed_task_id_is_a_400_naming_it(client, task_id, message):
    r = chat(client, "hi", task_id=task_id)
    assert r.status_code == 400
    error = r.get_json()["error"]
    assert error["message"].startswith(message) and error["param"] == "task_id"


def test_every_tenant_gets_the_task_prompts_pinned_in_its_own_namespace(engine):
    client = app_for(engine, api_keys=("key-a", "key-b"))
    for key in ("key-a", "key-b"):
        r = chat(client, "a new question", headers={"Authorization": f"Bearer {key}"}, task_id="support")
        assert r.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48


def test_an_admin_flush_keeps_the_task_prompts_pinned():
    """The store's flush drops task pins (KV of older weights); the demo's flush keeps the
    weights, so the operator's prompts must stay pinned and hit on their next use."""
    engine = build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 14))
    client = app_for(engine, api_keys=("key-a",), admin_token="adm")
    pinned = {k: v for k, v in engine.stats().items() if k.startswith("task_")}
    assert pinned["task_prompts"] >= 2
    flushed = client.post("/v1/cache/flush", headers={"X-Admin-Token": "adm"})
    assert flushed.status_code == 200, flushed.get_json()
    assert {k: v for k, v in engine.stats().items() if k.startswith("task_")} == pinned
    r = chat(client, "after the flush", headers={"Authorization": "Bearer key-a"}, task_id="support")
    assert r.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    engine.check_invariants()


def test_a_salted_task_request_reads_only_its_salts_prefixes(engine):
    """The pins are in the tenant's namespace; a salt narrows to (tenant, salt), where the task
    prompt is cached like any prefix: not read on the salt's first request, read on its next."""
    client = app_for(engine, api_keys=("key-s",))
    headers = {"Authorization": "Bearer key-s"}
    first = chat(client, "salted one", headers=headers, task_id="support", cache_salt="team-1")
    assert first.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = chat(client, "salted two", headers=headers, task_id="support", cache_salt="team-1")
    assert second.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    other = chat(client, "salted three", headers=headers, task_id="support", cache_salt="team-2")
    assert other.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    off = chat(client, "not cached", headers=headers, task_id="support", cache_prompt=False)
    assert off.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_metrics_show_task_pins_and_host_tier_gauges(monkeypatch):
    monkeypatch.setenv("RADIXKV_HOST_CACHE_TOKENS", "4096")
    engine = build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1024))
    client = app_for(engine)
    for i in range(12):  # distinct long prompts: more than the 1,024-token device pool holds
        chat(client, f"question {i} " + "word " * 120)
    for i in range(3):
        chat(client, f"question {i} " + "word " * 120)
    text = client.get("/metrics").get_data(as_text=True)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert int(samples["radixkv_task_prompts"]) >= 2  # forms of at least one block: chat, completion
    assert int(samples['radixkv_task_pinned_blocks{tier="device"}']) > 0
    assert int(samples["radixkv_host_pool_capacity_blocks"]) == 4096 // BLOCK
    assert int(samples["radixkv_host_demotions_total"]) > 0
    assert int(samples["radixkv_host_hits_total"]) > 0
    assert int(samples['radixkv_tier_copy_bytes_total{direction="to_host"}']) > 0
    assert int(samples['radixkv_host_pool_blocks{state="cached"}']) > 0
    engine.check_invariants()


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", f"{ENV}: not valid JSON"),
        ('{"task_id": "a"}', f"{ENV}: expected a JSON list"),
        ('["x"]', f"{ENV}: entry 0: expected an object"),
        ('[{"prompt": "p"}]', f"{ENV}: entry 0: 'task_id' must be a non-empty string, got None"),
        ('[{"task_id": "a", "prompt": ""}]', f"{ENV}: entry 0 (task_id 'a'): 'prompt' must be a non-empty"),
        (
            '[{"task_id": "a", "prompt": "p"}, {"task_id": "a", "prompt": "q"}]',
            f"{ENV}: entry 1: task_id 'a' appears twice",
        ),
    ],
)
def test_malformed_task_prompts_name_what_and_where(text, message):
    with pytest.raises(TaskPromptError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse(text, ENV)


def test_the_file_flag_wins_and_a_missing_file_is_named(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(TASKS[:1]))
    assert load(str(path), json.dumps(TASKS)) == {"support": SUPPORT}
    assert load(None, json.dumps(TASKS[1:])) == {"terse": "Answer in one word."}
    with pytest.raises(TaskPromptError, match=f"--task-prompts {tmp_path}/missing.json: cannot read"):
        load(str(tmp_path / "missing.json"), None)
    config = from_args(["--task-prompts", str(path)], env={ENV: "[]"})
    assert (config.task_prompts, config.task_prompts_json) == (str(path), "[]")


def test_the_server_refuses_to_start_with_malformed_or_oversized_task_prompts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("demo.server.serve_forever", lambda *a, **k: pytest.fail("the server started"))
    bad = tmp_path / "bad.json"
    bad.write_text('[{"task_id": "a"}]')
    with pytest.raises(SystemExit):
        demo_main.main(["--model", "builtin-tiny", "--task-prompts", str(bad)])
    err = capsys.readouterr().err
    assert f"--task-prompts {bad}: entry 0 (task_id 'a'): 'prompt' must be a non-empty string" in err
    big = tmp_path / "big.json"
    big.write_text(json.dumps([{"task_id": "big", "prompt": "word " * 400}]))
    with pytest.raises(SystemExit):
        demo_main.main(["--model", "builtin-tiny", "--cache-tokens", "128", "--task-prompts", str(big)])
    err = capsys.readouterr().err
    assert "task prompts cannot be pinned" in err and "the device pool has 8 blocks" in err
