"""Agents against the served app (waitress, real HTTP), through the official openai client: a
tool-calling loop (the prompt checked against apply_chat_template(tools=...), calls forced by
constrained decoding on a random model and validated against their schemas, streamed deltas,
cached_tokens growing per turn), json_schema outputs, and the reasoning split."""

from __future__ import annotations

import copy
import json

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.api.app import create_app
from demo.api.server import serving
from demo.config import Config
from tests.demo_checkpoints import ADD, save_agent_model, stock_reply

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Lima", "Paris", "Osaka"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast of a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Sum of two numbers", "parameters": ADD}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_agent_model(tmp_path_factory.mktemp("agent") / "agent-tiny")


@pytest.fixture(scope="module")
def stock(checkpoint):
    tok = AutoTokenizer.from_pretrained(checkpoint)
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval(), tok


@pytest.fixture(scope="module")
def server(checkpoint):
    """The app served over HTTP by waitress in this process (demo.api.server.serving)."""
    with serving(create_app(Config(model=checkpoint, block_size=16))) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def template_ids(tok, messages, **kw) -> list[int]:
    """The prompt transformers renders: apply_chat_template, arguments as objects (HF's convention)."""
    hf = copy.deepcopy(messages)
    for m in hf:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    text = tok.apply_chat_template(hf, add_generation_prompt=True, tokenize=False, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tool_loop(client, stock):
    model, tok = stock
    messages = [
        {"role": "system", "content": "You are a travel agent."},
        {"role": "user", "content": "What is the weather in Lima this week?"},
    ]
    # tool_choice auto: the reply is the stock generate() reply to apply_chat_template(tools=...)
    free = client.chat.completions.create(
        model="agent-tiny", messages=messages, tools=TOOLS, max_tokens=12, temperature=0
    )
    ids = template_ids(tok, messages, tools=TOOLS)
    assert free.usage.prompt_tokens == len(ids)
    assert free.choices[0].message.content == stock_reply(model, tok, ids, 12)[1]
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.tool_calls

    cached = []
    for turn in range(3):
        choice = "required" if turn != 1 else {"type": "function", "function": {"name": "add"}}
        r = client.chat.completions.create(
            model="agent-tiny", messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            max_tokens=60, temperature=0,
        )  # fmt: skip
        assert r.usage.prompt_tokens == len(template_ids(tok, messages, tools=TOOLS))
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        if turn == 1:
            assert call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        # the same request streamed: OpenAI's deltas (header, then arguments) rebuild the call
        stream = client.chat.completions.create(
            model="agent-tiny", messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
            max_tokens=60, temperature=0, stream=True,
        )  # fmt: skip
        name, args, ids_seen, reasons = "", "", set(), []
        for chunk in stream:
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or []:
                    assert d.index == 0
                    ids_seen |= {d.id} if d.id else set()
                    name += d.function.name or ""
                    args += d.function.arguments or ""
                assert not ch.delta.content
                reasons.append(ch.finish_reason)
        assert (name, args) == (call.function.name, call.function.arguments)
        assert len(ids_seen) == 1 and reasons[-1] == "tool_calls"
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn}: sunny"})
    assert cached[0] > 0 and cached[1] > cached[0] and cached[2] > cached[1], cached
    # the last turn renders the whole history (tool calls and results) as transformers does
    last = client.chat.completions.create(
        model="agent-tiny", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
    )
    full = template_ids(tok, messages, tools=TOOLS)
    assert last.usage.prompt_tokens == len(full)
    assert last.choices[0].message.content == stock_reply(model, tok, full, 4)[1]


def test_parallel_calls_and_refusals(client):
    messages = [{"role": "user", "content": "Weather in Osaka and 2 + 3?"}]
    r = client.chat.completions.create(
        model="agent-tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    for call in r.choices[0].message.tool_calls:  # one or more, each valid
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        client.chat.completions.create(
            model="agent-tiny",
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    with pytest.raises(openai.BadRequestError, match="not"):
        client.chat.completions.create(
            model="agent-tiny", messages=messages, tools=bad, tool_choice="required"
        )


JSON_SCHEMAS = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "job": {"enum": ["baker", "nurse", "pilot"]},
        },
        "required": ["name", "age", "job"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"when": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}},
        "required": ["when"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", JSON_SCHEMAS)
def test_json_schema_outputs_validate(client, schema):
    r = client.chat.completions.create(
        model="agent-tiny",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        max_tokens=80,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        },
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_object_and_sampled_rows(client):
    r = client.chat.completions.create(
        model="agent-tiny",
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=60,
        temperature=1.0,
        n=3,
        seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "o", "schema": JSON_SCHEMAS[1]}},
    )
    for c in r.choices:  # each sampled row has its own grammar state
        jsonschema.validate(json.loads(c.message.content), JSON_SCHEMAS[1])


def test_reasoning_split(client, stock):
    model, tok = stock
    messages = [{"role": "user", "content": "Think first: which city is warmer?"}]
    kw = {"enable_thinking": True}
    r = client.chat.completions.create(
        model="agent-tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        extra_body={"chat_template_kwargs": kw},
    )
    ids = template_ids(tok, messages, **kw)
    assert tok.decode(ids[-2:]).endswith("<think>\n")  # the template opened the block
    msg = r.choices[0].message
    assert msg.reasoning_content == stock_reply(model, tok, ids, 10)[1] and not msg.content
    stream = client.chat.completions.create(
        model="agent-tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"chat_template_kwargs": kw},
    )
    parts = [(ch.choices[0].delta.model_extra or {}).get("reasoning_content") for ch in stream if ch.choices]
    assert "".join(p for p in parts if p) == msg.reasoning_content
    plain = client.chat.completions.create(
        model="agent-tiny", messages=messages, max_tokens=10, temperature=0
    )
    assert plain.choices[0].message.content == stock_reply(model, tok, template_ids(tok, messages), 10)[1]
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None


@torch.no_grad()
def test_grammar_state_survives_a_pause(stock):
    """Constrained greedy decoding in one generate() equals the same decoding in two chunks,
    the second resuming the first chunk's grammar state over its context (a paused request):
    the grammar is the row's RowHook, run by the batch's RowSampler as the engine runs it."""
    from demo.engine.constrained import GrammarHook, Grammars, json_lark
    from demo.engine.generation import Generation, Params
    from demo.engine.sampling import Row, RowSampler

    model, tok = stock
    grammars = Grammars(tok, model.config.vocab_size, [tok.eos_token_id])
    grammar = grammars.check(json_lark(JSON_SCHEMAS[1]))
    prompt = torch.tensor([tok("<|user|>JSON please<|end|><|assistant|>")["input_ids"]])

    def request():
        hook = GrammarHook(grammars.start(grammar), prompt.shape[1])
        ids = prompt[0].tolist()
        return Generation(
            ids, Params(40, temperature=0.0), None, tok.decode, {tok.eos_token_id}, hooks=[hook]
        )

    def run(ids, gen, steps):
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
            logits_processor=[RowSampler([Row(gen, 0, 0)])],
        )  # fmt: skip
        return out

    whole = run(prompt, request(), 40)
    gen = request()
    first = run(prompt, gen, 7)
    second = run(first, gen, 40 - 7)
    assert second[0].tolist() == whole[0].tolist()
    text = tok.decode(whole[0, prompt.shape[1] :], skip_special_tokens=True)
    jsonschema.validate(json.loads(text), JSON_SCHEMAS[1])


def test_constrained_and_free_rows_share_batches(checkpoint, stock):
    """Constrained and free requests run together, pausing every 3 decode steps so that they
    re-form batches: each free reply equals stock generate(), each constrained one validates,
    and a free request after a constrained one reads the prompt the grammar left in the cache."""
    import threading

    from demo.api.app import build_engine
    from demo.engine.constrained import json_lark
    from demo.engine.engine import Params

    model, tok = stock
    engine = build_engine(Config(model=checkpoint, block_size=16, decode_chunk=3, max_batch_size=4))
    grammar = engine.runner.grammars.check(json_lark(JSON_SCHEMAS[1]))
    prompts = [
        engine.chat_ids([{"role": "user", "content": f"Person {i}, as JSON please."}]) for i in range(4)
    ]
    results = [None] * 4
    with engine.exclusive():  # queue all four before the worker can run any
        gens = [
            engine.submit(
                ids, Params(60 if i % 2 else 10, temperature=0.0, grammar=grammar if i % 2 else None)
            )
            for i, ids in enumerate(prompts)
        ]
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, gens[i].collect())) for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # some step (or generate() call) decoded several of them together; newcomers may join one by
    # one within the admission budget
    steps = (
        engine.scheduler.rows_per_step.counts[1:] if engine.loop else engine.scheduler.batch_sizes.counts[1:]
    )
    assert sum(steps) > 0
    for i, r in enumerate(results):
        if i % 2:
            jsonschema.validate(json.loads(r.text), JSON_SCHEMAS[1])
        else:
            assert r.text == stock_reply(model, tok, prompts[i], 10)[1]
    again = engine.submit(prompts[1], Params(4, temperature=0.0)).collect()
    assert again.cached_tokens >= len(prompts[1]) - 16
    assert again.text == stock_reply(model, tok, prompts[1], 4)[1]
    engine.check_invariants()


def test_apply_bitmask_by_definition():
    """Bit t % 32 of word t // 32 keeps token t; logits past the mask are never allowed."""
    from demo.engine.constrained import apply_bitmask

    g = torch.Generator().manual_seed(0)
    for vocab, words in ((100, 4), (512, 16), (70, 2)):
        mask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
        scores = torch.randn(3, vocab, generator=g)
        want = scores.clone()
        for r in range(3):
            for t in range(vocab):
                if t >= 32 * words or not (int(mask[r, t // 32]) >> (t % 32)) & 1:
                    want[r, t] = -float("inf")
        apply_bitmask(scores, mask)
        assert torch.equal(scores, want)


def test_apply_bitmask_narrow_mask_spares_free_rows():
    from demo.engine.constrained import apply_bitmask

    scores = torch.zeros(2, 40)
    mask = torch.full((2, 1), -1, dtype=torch.int32)  # 32 tokens wide, all allowed
    apply_bitmask(scores, mask, rows=[1])
    assert torch.equal(scores[0], torch.zeros(40))  # a free row keeps the tokens past the mask
    assert torch.isinf(scores[1, 32:]).all() and torch.equal(scores[1, :32], torch.zeros(32))
