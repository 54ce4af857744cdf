"""The reply parsers on strings: reasoning split, tool-call formats, and streaming in pieces
equal to parsing the whole reply."""

from __future__ import annotations

import json
import random

import pytest

from demo.api import reasoning, tool_parsers
from demo.api.reasoning import THINK
from demo.api.reply_parts import ReplyParser, parse_whole
from demo.api.tool_parsers import Hermes, Llama3Json, Mistral


def pieces(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        k = rng.randint(1, 5)
        out.append(text[i : i + k])
        i += k
    return out


def streamed(fmt_r, inside, fmt_t, text, seed):
    p = ReplyParser(fmt_r, inside, fmt_t)
    parts = [p.feed(t) for t in pieces(text, seed)] + [p.finish()]
    reasoning_text = "".join(x.reasoning for x in parts)
    content = "".join(x.content for x in parts)
    calls = [(c.index, c.call) for x in parts for c in x.calls]
    return reasoning_text, content, calls


REASONING_CASES = [
    # (inside, reply, reasoning, content)
    (False, "<think>plan it</think>\n\nThe answer.", "plan it", "The answer."),
    (False, "  <think>a</think>b", "a", "b"),
    (False, "No thinking here <think>x</think>", "", "No thinking here <think>x</think>"),
    (True, "step one</think>\n\nfinal", "step one", "final"),
    (True, "<think>again</think>done", "again", "done"),
    (True, "never closed", "never closed", ""),
    (False, "<think>cut off while thinking", "cut off while thinking", ""),
    (False, "<thi", "", "<thi"),
    (False, "", "", ""),
    (True, "a</thin", "a</thin", ""),
]


@pytest.mark.parametrize("inside,reply,want_reasoning,want_content", REASONING_CASES)
def test_reasoning_split(inside, reply, want_reasoning, want_content):
    assert reasoning.split(THINK, inside, reply) == (want_reasoning, want_content)
    for seed in range(5):
        assert streamed(THINK, inside, None, reply, seed)[:2] == (want_reasoning, want_content)


def test_reasoning_choice():
    assert reasoning.choose("auto", "{{ '<think>' }}...{{ '</think>' }}") == THINK
    assert reasoning.choose("auto", "{{ messages }}") is None
    assert reasoning.choose("none", "<think></think>") is None
    assert reasoning.choose("deepseek_r1", None) == THINK
    assert THINK.opens_in("<|assistant|><think>\n") and not THINK.opens_in("<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="deepseek_r1"):
        reasoning.choose("r1", None)


def call(name, **args):
    return tool_parsers.ToolCall(name, json.dumps(args))


TOOL_CASES = [
    (
        Hermes(),
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>',
        "Let me look.",
        [call("get_weather", city="Lima")],
    ),
    (
        Hermes(),
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>',
        "",
        [call("a"), call("b", x=1)],
    ),
    (Hermes(), "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    (Hermes(), "plain text < tool", "plain text < tool", []),
    (Hermes(), '<tool_call>{"name": "a", "arguments": {"q": 1}}', "", [call("a", q=1)]),  # unterminated
    (Llama3Json(), '{"name": "f", "parameters": {"n": 2}}', "", [call("f", n=2)]),
    (
        Llama3Json(),
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
        "",
        [call("f"), call("g")],
    ),
    (
        Llama3Json(),
        'The JSON is {"name": "f", "parameters": {}}',
        'The JSON is {"name": "f", "parameters": {}}',
        [],
    ),
    (Llama3Json(), '{"not": "a call"}', '{"not": "a call"}', []),
    (Mistral(), 'ok[TOOL_CALLS][{"name": "f", "arguments": {"a": "b"}}]', "ok", [call("f", a="b")]),
    (Mistral(), '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "", [call("f", a=1), call("g")]),
    (Mistral(), "[TOOL_CALLS]garbage", "[TOOL_CALLS]garbage", []),
]


@pytest.mark.parametrize("fmt,reply,want_content,want_calls", TOOL_CASES)
def test_tool_formats(fmt, reply, want_content, want_calls):
    whole = parse_whole(None, False, fmt, reply)
    assert whole.content == want_content
    assert [c.call for c in whole.calls] == want_calls
    assert whole.finish_reason_override == ("tool_calls" if want_calls else None)
    for seed in range(5):
        _, content, calls = streamed(None, False, fmt, reply, seed)
        assert content == want_content and [c for _, c in calls] == want_calls
        assert [i for i, _ in calls] == list(range(len(want_calls)))


def test_reasoning_then_tool_call():
    reply = '<think>need weather</think>\n<tool_call>\n{"name": "w", "arguments": {"c": "x"}}\n</tool_call>'
    r, content, calls = streamed(THINK, False, Hermes(), reply, 3)
    assert (r, content, [c for _, c in calls]) == ("need weather", "", [call("w", c="x")])


def test_ids_and_choice():
    assert len(Mistral().call_id()) == 9 and Mistral().call_id().isalnum()
    assert Hermes().call_id().startswith("call_")
    assert isinstance(tool_parsers.choose("auto", "{% if tools %}<tool_call>{% endif %}"), Hermes)
    assert isinstance(tool_parsers.choose("auto", "{% if tools %}[TOOL_CALLS]{% endif %}"), Mistral)
    assert isinstance(tool_parsers.choose("auto", "{% if tools %}<|python_tag|>{% endif %}"), Llama3Json)
    assert tool_parsers.choose("auto", "{{ messages }}") is None
    assert isinstance(tool_parsers.choose("mistral", None), Mistral)
    with pytest.raises(ValueError, match="hermes"):
        tool_parsers.choose("qwen", None)


def test_one_call_without_parallel_tool_calls():
    reply = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    p = ReplyParser(None, False, Hermes(), max_calls=1)
    parts = [p.feed(t) for t in pieces(reply, 1)] + [p.finish()]
    assert [c.call.name for x in parts for c in x.calls] == ["a"] and p.content == ""


@pytest.mark.parametrize("fmt,reply,want_content,want_calls", TOOL_CASES)
def test_call_deltas_rebuild_the_calls(fmt, reply, want_content, want_calls):
    """OpenAI's stream view: per index one header (id, name), then arguments pieces whose
    concatenation is the call's arguments; Hermes streams them as written."""
    for seed in range(4):
        p = ReplyParser(None, False, fmt)
        parts = [p.feed(t) for t in pieces(reply, seed)] + [p.finish()]
        deltas = [d for x in parts for d in x.call_deltas]
        rebuilt = {}
        for d in deltas:
            if d.name is not None:
                assert d.index not in rebuilt and d.arguments == ""
                rebuilt[d.index] = [d.id, d.name, ""]
            else:
                assert rebuilt[d.index][0] == d.id
                rebuilt[d.index][2] += d.arguments
        got = [(i, n, a) for i, (_, n, a) in sorted(rebuilt.items())]
        assert got == [(i, c.call.name, c.call.arguments) for i, c in enumerate(p.calls)]
        assert [c.call for c in p.calls] == [tool_parsers.ToolCall(c.name, c.arguments) for c in want_calls]


def test_hermes_arguments_stream_as_written():
    args = json.dumps({"city": "Lima", "days": 3, "notes": 'a "quoted" } ]'})
    reply = '<tool_call>\n{"name": "w", "arguments": ' + args + "}\n</tool_call>"
    p = ReplyParser(None, False, Hermes())
    parts = [p.feed(reply[i : i + 3]) for i in range(0, len(reply), 3)] + [p.finish()]
    pieces_ = [d.arguments for x in parts for d in x.call_deltas if d.name is None]
    assert len(pieces_) > 5 and "".join(pieces_) == args == p.calls[0].call.arguments


def test_hermes_streaming_edge_cases():
    # name after the arguments: nothing to stream early, the call comes whole (re-serialised)
    reply = '<tool_call>{"arguments": {"b": [1,2]}, "name": "f"}</tool_call>'
    p = parse_whole(None, False, Hermes(), reply)
    assert [c.call for c in p.calls] == [tool_parsers.ToolCall("f", '{"b": [1, 2]}')]
    # announced while written, then malformed: not a call; its text is content
    bad = '<tool_call>{"name": "f", "arguments": {"a": 1} oops</tool_call>'
    p = ReplyParser(None, False, Hermes())
    parts = [p.feed(bad[i : i + 4]) for i in range(0, len(bad), 4)] + [p.finish()]
    assert p.calls == [] and p.content == bad
    assert any(d.name == "f" for x in parts for d in x.call_deltas)  # the header had gone out
