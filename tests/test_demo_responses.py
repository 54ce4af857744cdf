"""/v1/responses through the official openai client against a served app: create, continue
(previous_response_id, read from the prefix cache), retrieve, delete, tenants, store=false,
streaming event order, tool calls; and the bounded store on its own."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import ResponseIncompleteEvent

from demo.api.app import create_app
from demo.api.conversations import ResponseStore, StoredResponse
from demo.api.server import serving
from demo.config import Config
from tests.demo_checkpoints import ADD, save_agent_model

TOOLS = [{"type": "function", "name": "add", "description": "Sum of two numbers", "parameters": ADD}]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    path = save_agent_model(tmp_path_factory.mktemp("agent") / "agent-tiny")
    app = create_app(Config(model=path, block_size=16, api_keys=("k-one", "k-two"), responses_max_stored=50))
    with serving(app) as base:
        yield base


def client(url, key="k-one"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_create_continue_retrieve_delete(url):
    c = client(url)
    first = c.responses.create(
        model="agent-tiny",
        instructions="Be brief.",
        input="Where is Lima?",
        max_output_tokens=6,
        temperature=0,
    )
    assert first.object == "response" and first.id.startswith("resp_")
    assert first.output[0].type == "message" and first.output_text
    # the same conversation as chat completions: the same prompt, the same greedy text
    chat = c.chat.completions.create(
        model="agent-tiny", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Lima?"}],
    )  # fmt: skip
    assert chat.choices[0].message.content == first.output_text
    assert chat.usage.prompt_tokens == first.usage.input_tokens
    second = c.responses.create(
        model="agent-tiny", instructions="Be brief.", input="And Osaka?", previous_response_id=first.id,
        max_output_tokens=6, temperature=0,
    )  # fmt: skip
    # its history (instructions, first input and reply) comes from the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    assert second.previous_response_id == first.id
    by_hand = c.chat.completions.create(
        model="agent-tiny", max_tokens=6, temperature=0,
        messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Lima?"},
            {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And Osaka?"},
        ],
    )  # fmt: skip
    assert by_hand.choices[0].message.content == second.output_text
    got = c.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="agent-tiny", input="x", previous_response_id=first.id, max_output_tokens=2)
    assert c.responses.retrieve(second.id).id == second.id  # continuing from it still works


def test_tenants_and_store_false(url):
    one, two = client(url, "k-one"), client(url, "k-two")
    mine = one.responses.create(model="agent-tiny", input="a secret", max_output_tokens=2, temperature=0)
    for call in (
        lambda: two.responses.retrieve(mine.id),
        lambda: two.responses.delete(mine.id),
        lambda: two.responses.create(
            model="agent-tiny", input="x", previous_response_id=mine.id, max_output_tokens=2
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert one.responses.retrieve(mine.id).id == mine.id  # untouched by the other tenant
    loose = one.responses.create(model="agent-tiny", input="forget me", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(loose.id)
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong").responses.retrieve(mine.id)


def test_stream_event_order(url):
    c = client(url)
    plain = c.responses.create(
        model="agent-tiny", input="Tell me about Rome.", max_output_tokens=8, temperature=0
    )
    events = list(
        c.responses.create(
            model="agent-tiny", input="Tell me about Rome.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",  # completed, or incomplete where max_output_tokens cut it
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == plain.usage.output_tokens


def test_a_truncated_stream_ends_with_response_incomplete(url):
    """OpenAI ends a reply cut by max_output_tokens with response.incomplete; it used to end with
    response.completed (holding status incomplete), which a client switching on the event type
    takes for a finished answer."""
    c = client(url)
    kw = {"model": "agent-tiny", "input": "Tell me about Rome.", "max_output_tokens": 2, "temperature": 0}
    assert c.responses.create(**kw).status == "incomplete"  # the reply is longer than 2 tokens
    events = list(c.responses.create(**kw, stream=True))
    last = events[-1]
    assert isinstance(last, ResponseIncompleteEvent) and last.type == "response.incomplete", last
    assert (
        last.response.status == "incomplete"
        and last.response.incomplete_details.reason == "max_output_tokens"
    )
    assert "response.completed" not in [e.type for e in events]
    assert c.responses.retrieve(last.response.id).status == "incomplete"


def test_tool_call_round_trip(url):
    c = client(url)
    r = c.responses.create(model="agent-tiny", input="What is 2 + 3?", tools=TOOLS, tool_choice="required",
                           parallel_tool_calls=False, max_output_tokens=80, temperature=0)  # fmt: skip
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add"
    jsonschema.validate(json.loads(calls[0].arguments), ADD)
    events = list(c.responses.create(model="agent-tiny", input="What is 2 + 3?", tools=TOOLS, tool_choice="required",
                                      parallel_tool_calls=False, max_output_tokens=80, temperature=0, stream=True))  # fmt: skip
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments
    assert r.status == "completed" and events[-1].type == "response.completed"  # the call ended it
    nxt = c.responses.create(
        model="agent-tiny", previous_response_id=r.id, tools=TOOLS, max_output_tokens=4, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}],
    )  # fmt: skip
    assert nxt.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 16
    by_hand = c.chat.completions.create(
        model="agent-tiny", max_tokens=4, temperature=0,
        tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
        messages=[
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": calls[0].call_id, "type": "function", "function": {"name": "add", "arguments": calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "5"},
        ],
    )  # fmt: skip
    assert by_hand.usage.prompt_tokens == nxt.usage.input_tokens
    assert by_hand.choices[0].message.content == nxt.output_text


def test_output_items_resent_as_input(url):
    """Without server state (store=false), a client resends the earlier output items: the same
    prompt as the stored conversation's continuation."""
    c = client(url)
    first = c.responses.create(
        model="agent-tiny", input="Name a city.", store=False, max_output_tokens=4, temperature=0
    )
    items = [{"role": "user", "content": "Name a city."}]
    items += [{"type": "reasoning", "id": "rs_1", "summary": []}] + [o.model_dump() for o in first.output]
    items += [{"role": "user", "content": "Another one."}]
    resent = c.responses.create(
        model="agent-tiny", input=items, store=False, max_output_tokens=4, temperature=0
    )
    kept = c.responses.create(model="agent-tiny", input="Name a city.", max_output_tokens=4, temperature=0)
    cont = c.responses.create(
        model="agent-tiny",
        input="Another one.",
        previous_response_id=kept.id,
        max_output_tokens=4,
        temperature=0,
    )
    assert resent.usage.input_tokens == cont.usage.input_tokens and resent.output_text == cont.output_text


def test_bad_requests(url):
    c = client(url)
    with pytest.raises(openai.BadRequestError, match="input"):
        c.responses.create(model="agent-tiny", input=[{"type": "image_generation_call"}])
    with pytest.raises(openai.BadRequestError, match="function tools"):
        c.responses.create(model="agent-tiny", input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="agent-tiny", input="x", previous_response_id="resp_nope")


def test_store_bounds():
    now = [1000.0]
    store = ResponseStore(max_items=2, max_age_s=60, clock=lambda: now[0])
    for i in range(3):
        store.put("t", StoredResponse(f"r{i}", now[0], (), {}))
    assert store.get("t", "r0") is None and store.get("t", "r2") is not None and len(store) == 2
    assert store.get("other", "r2") is None and not store.delete("other", "r2")
    now[0] += 61
    assert store.get("t", "r2") is None and len(store) == 0
    off = ResponseStore(max_items=0, max_age_s=1)
    off.put("t", StoredResponse("x", 0.0, (), {}))
    assert off.get("t", "x") is None
    with pytest.raises(ValueError):
        ResponseStore(max_items=-1, max_age_s=1)


def test_reasoning_item(url):
    c = client(url)
    kw = {"model": "agent-tiny", "input": "Think about Rome.", "max_output_tokens": 6, "temperature": 0}
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}  # the template opens <think>
    r = c.responses.create(**kw, extra_body=thinking)
    assert [o.type for o in r.output] == ["reasoning"] and r.output[0].content[0].text
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    nxt = c.responses.create(
        model="agent-tiny", input="Go on.", previous_response_id=r.id, max_output_tokens=2
    )
    assert nxt.usage.input_tokens > r.usage.input_tokens  # a reply with no content continues too
    events = list(c.responses.create(**kw, stream=True, extra_body=thinking))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.reasoning_text.done", "response.output_item.done", f"response.{r.status}"]
    assert set(kinds[3:-3]) == {"response.reasoning_text.delta"}
    assert (
        "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        == r.output[0].content[0].text
    )


def test_text_format_json_schema(url):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # fmt: skip
    r = client(url).responses.create(
        model="agent-tiny", input="A digit as JSON.", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
