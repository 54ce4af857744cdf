"""Issues 27 + 30: a constrained request is an ordinary row of a running batch. Its grammar
(response_format json_schema, tool_choice required) is that row's RowHook (one llguidance
matcher per row, advanced by the row's own tokens, kept on the request across pauses), so it
joins a batch of greedy and seeded rows at the next chunk boundary instead of waiting for a
batch of its own; every reply equals the same request alone and is valid against its schema."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import openai
import pytest

from demo.api.app import build_engine, create_app
from demo.api.server import serving
from demo.config import Config
from demo.engine import batching
from tests.demo_checkpoints import save_agent_model
from tests.engine_gate import generate_path
from tests.test_demo_agents import JSON_SCHEMAS, SCHEMAS, TOOLS

TEXT = "\n".join(f"| Ines {i} | {40 + i} | Porto | pilot |" for i in range(4))
SCHEMA = JSON_SCHEMAS[1]

# The running rows (plain text, long replies), then the newcomers (constrained).
BODIES = {
    "greedy": dict(
        messages=[{"role": "user", "content": "Summarize: " + TEXT}], max_tokens=30, temperature=0
    ),
    "seeded": dict(
        messages=[{"role": "user", "content": "Describe: " + TEXT[:90]}],
        max_tokens=30,
        temperature=0.9,
        seed=5,
    ),
    "json": dict(
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=60,
        temperature=0.8,
        seed=7,
        top_p=0.95,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": SCHEMA, "strict": True},
        },
    ),
    "tool": dict(
        messages=[{"role": "user", "content": "What is the weather in Lima this week?"}],
        max_tokens=60,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    ),
}
RUNNING, NEWCOMERS = ("greedy", "seeded"), ("json", "tool")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    checkpoint = save_agent_model(tmp_path_factory.mktemp("agent") / "agent-tiny")
    config = Config(model=checkpoint, block_size=16)
    engine = build_engine(config)
    with serving(create_app(config, engine)) as url:
        yield engine, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, name: str):
    r = client.chat.completions.create(model="agent-tiny", **BODIES[name])
    m = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return m.content, calls, r.choices[0].finish_reason, r.usage.completion_tokens


def test_constrained_requests_join_a_running_batch_of_greedy_and_seeded_rows(served, monkeypatch):
    engine, client = served
    alone = {name: ask(client, name) for name in BODIES}  # one at a time (also warms the grammar path)
    jsonschema.validate(json.loads(alone["json"][0]), SCHEMA)
    (name, arguments), *more = alone["tool"][1]
    assert not more and alone["tool"][2] == "tool_calls"
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert all(alone[n][3] == 30 for n in RUNNING)  # they run their whole length: still running below

    generate_path(engine, monkeypatch)  # the path that pauses (adapter and image requests)
    # Every batch pauses each 3 steps (every row resumes many times, grammar rows included); at
    # the first pause of the batch running both rows, the worker waits until the newcomers are
    # queued, so they join at that boundary (deterministic, whatever the machine's speed).
    monkeypatch.setattr(engine.scheduler, "pause_for", lambda batch: lambda generated: generated >= 3)
    finished, queued = engine.scheduler.finished, threading.Event()

    def gate(paused):
        if len(paused) == len(RUNNING) and not queued.is_set():
            deadline = time.monotonic() + 60
            while engine.queued < len(NEWCOMERS) and time.monotonic() < deadline:
                time.sleep(0.005)
            queued.set()
        return finished(paused)

    monkeypatch.setattr(engine.scheduler, "finished", gate)
    batches, run = [], batching.run_batch

    def spy(runner, gens, *args):
        batches.append(
            [(g.params.grammar is not None, g.params.seed, g.replied(g.open_rows[0])) for g in gens]
        )
        return run(runner, gens, *args)

    monkeypatch.setattr(batching, "run_batch", spy)
    out: dict[str, tuple] = {}

    def send(name):
        out[name] = ask(client, name)

    threads = {n: threading.Thread(target=send, args=(n,)) for n in BODIES}
    for n in RUNNING:
        threads[n].start()
    deadline = time.monotonic() + 60
    while engine.running < len(RUNNING) and time.monotonic() < deadline:
        time.sleep(0.005)
    for n in NEWCOMERS:
        threads[n].start()
    for t in threads.values():
        t.join(180)
    monkeypatch.undo()

    assert queued.is_set()
    # one generate() call held all four: the two constrained rows beside the running greedy and
    # seeded rows, which had already made tokens (a running batch, joined at its boundary)
    joined = [b for b in batches if len(b) == 4]
    assert joined, batches
    assert any(sum(g for g, _, _ in b) == 2 and all(r > 0 for g, _, r in b if not g) for b in joined)
    assert out == alone


def test_constrained_requests_join_the_step_loop_beside_greedy_and_seeded_rows(served, monkeypatch):
    """The step loop: the constrained newcomers are admitted between steps of the running
    greedy and seeded rows and then make tokens in the same steps; every reply equals alone."""
    from demo.engine.step_loop import StepLoop

    engine, client = served
    alone = {name: ask(client, name) for name in BODIES}
    steps, emit = [], StepLoop._emit

    def spy(loop, indices, tokens, logprobs):
        grammar = sum(loop.rows[i].gen.params.grammar is not None for i in indices)
        steps.append((len(indices), grammar))  # (rows making a token, constrained ones)
        return emit(loop, indices, tokens, logprobs)

    monkeypatch.setattr(StepLoop, "_emit", spy)
    out: dict[str, tuple] = {}
    threads = {n: threading.Thread(target=lambda n=n: out.__setitem__(n, ask(client, n))) for n in BODIES}
    for n in RUNNING:
        threads[n].start()
    deadline = time.monotonic() + 60
    while (engine.running < len(RUNNING) or len(steps) < 3) and time.monotonic() < deadline:
        time.sleep(0.002)
    for n in NEWCOMERS:
        threads[n].start()
    for t in threads.values():
        t.join(180)
    monkeypatch.undo()
    assert (4, 2) in steps, steps  # all four rows in one step, the two constrained ones included
    assert out == alone


def test_a_grammar_gives_each_row_its_own_matcher_and_takes_no_other_hooks(served):
    from demo.engine.constrained import GrammarHook, json_lark
    from demo.engine.engine import Params

    engine, _ = served
    grammar = engine.runner.grammars.check(json_lark(SCHEMA))
    ids = engine.text_ids("JSON please")
    sampled = engine.runner.grammar_hooks(ids, Params(5, temperature=1.0, n=3, grammar=grammar))
    assert len(sampled) == 3 and all(isinstance(h, GrammarHook) for h in sampled)
    assert len({id(h.state.matcher) for h in sampled}) == 3  # one matcher per sampled row
    assert len(engine.runner.grammar_hooks(ids, Params(5, temperature=0.0, n=3, grammar=grammar))) == 1
    assert engine.runner.grammar_hooks(ids, Params(5)) is None
    queued = engine.queued, engine.scheduler._reserved
    with pytest.raises(ValueError, match="grammar takes no other hooks"):
        engine.submit(ids, Params(5, temperature=0.0, grammar=grammar), hooks=[None])
    assert (engine.queued, engine.scheduler._reserved) == queued  # nothing queued, no place taken


def test_an_image_request_with_a_json_schema_gets_one_matcher_per_expanded_row(tmp_path):
    """An image request (its rows expanded from one input row by generate()) is constrained
    row by row too: n sampled choices, each valid against the schema."""
    from tests.demo_checkpoints import data_url, png, save_vlm

    color = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue", "green"]}, "n": {"type": "integer", "maximum": 9}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    app = create_app(Config(model=save_vlm(tmp_path / "tiny-llava"), block_size=16))
    content = [
        {"type": "text", "text": "Its color?"},
        {"type": "image_url", "image_url": {"url": data_url(png(1))}},
    ]
    r = app.test_client().post(
        "/v1/chat/completions",
        json={
            "model": "tiny-llava",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 30,
            "n": 2,
            "temperature": 1.0,
            "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": color}},
        },
    )
    assert r.status_code == 200, r.get_json()
    for choice in r.get_json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), color)
