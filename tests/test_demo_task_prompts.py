"""Demo task prompts (--task-prompts / RADIXKV_TASK_PROMPTS, "task_id") and tier metrics."""

from __future__ import annotations

import json

import pytest

import demo.__main__ as demo_main
from demo.api.app import build_engine, create_app
from demo.config import Config, from_args
from demo.task_prompts import ENV, TaskPromptError, TaskPrompts, load, parse

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


def pinned_chat_tokens(engine) -> int:
    """Tokens of the support task's chat form in whole pinned blocks: what any tenant reads."""
    probes = [engine.chat_ids(TaskPrompts.chat(SUPPORT, [{"role": "user", "content": p}])) for p in "ab"]
    common = next(i for i, (x, y) in enumerate(zip(*probes)) if x != y)
    return common // BLOCK * BLOCK


def test_the_task_prompts_are_pinned_once_for_all_tenants():
    """Three tenants pin what one does (issue 17: 398 blocks for two tenants where 100 do)."""
    counts = []
    for keys in ((), ("key-a", "key-b", "key-c")):
        engine = build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 14))
        app_for(engine, api_keys=keys)
        stats = engine.stats()
        counts.append((stats["task_prompts"], stats["task_pinned_blocks"]))
    assert counts[0] == counts[1] and counts[0][1] > 0


def test_tenants_read_the_task_prompt_and_nothing_of_each_other(engine):
    """Every tenant reads the pinned task prompt on its first request; the same question from
    another tenant reads exactly the task prompt's blocks, not the first tenant's text (and the
    first tenant reads its own text on its second ask)."""
    client = app_for(engine, api_keys=("key-a", "key-b"))
    pinned = pinned_chat_tokens(engine)
    assert pinned >= 48
    question = "a new question about my parcel and its long journey across the sea " * 3

    def cached(key):
        r = chat(client, question, headers={"Authorization": f"Bearer {key}"}, task_id="support")
        assert r.status_code == 200, r.get_json()
        return r.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("key-a") == pinned
    assert cached("key-b") == pinned
    assert cached("key-a") > pinned + BLOCK
    assert cached("key-b") > pinned + BLOCK
    engine.check_invariants()


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


def test_a_salted_task_request_reads_the_task_prompt_and_only_its_salts_text(engine):
    """A salt narrows sharing to (tenant, salt) for the request's own text; the operator's task
    prompt is public and pinned, so every salt reads it (it says nothing about anyone's traffic)."""
    client = app_for(engine, api_keys=("key-s",))
    headers = {"Authorization": "Bearer key-s"}
    pinned = pinned_chat_tokens(engine)
    question = "salted question that runs on for a good number of tokens " * 3

    def cached(**kw):
        r = chat(client, question, headers=headers, task_id="support", **kw)
        assert r.status_code == 200, r.get_json()
        return r.get_json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(cache_salt="team-1") == pinned
    assert cached(cache_salt="team-1") > pinned + BLOCK
    assert cached(cache_salt="team-2") == pinned
    assert cached() == pinned  # the tenant without a salt is a namespace of its own too
    assert cached(cache_prompt=False) == 0


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
    monkeypatch.setattr("demo.api.server.serve_forever", lambda *a, **k: pytest.fail("the server started"))
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
