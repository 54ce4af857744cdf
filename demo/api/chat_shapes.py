"""Chat message and stream-delta shapes for replies with parts (demo.api.reply_parts):
``reasoning_content`` beside ``content`` (vLLM's and DeepSeek's field) and OpenAI ``tool_calls``.

Streamed tool calls follow OpenAI: a call's first delta carries its ``index``, ``id``, ``type``
and ``function.name`` with empty ``arguments``; the arguments follow in further deltas of the
same ``index``: as they are written for formats that can tell (Hermes), else in one delta once
the call is complete.
"""

from __future__ import annotations

from demo.api.reply_parts import IdentifiedCall, Part, ReplyParser


def tool_call(c: IdentifiedCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.call.name, "arguments": c.call.arguments}}


def message(parser: ReplyParser, reasoning: bool) -> dict:
    """The assistant message of a finished reply; ``reasoning``: the reasoning split is on."""
    out = {"role": "assistant", "content": parser.content if parser.content or not parser.calls else None}
    if reasoning:
        out["reasoning_content"] = parser.reasoning or None
    if parser.calls:
        out["tool_calls"] = [tool_call(c) for c in parser.calls]
    return out


def deltas(part: Part) -> list[dict]:
    """The stream deltas of a part, in order: reasoning, content, then the calls' pieces."""
    out = []
    if part.reasoning:
        out.append({"reasoning_content": part.reasoning})
    if part.content:
        out.append({"content": part.content})
    for c in part.call_deltas:
        if c.name is not None:
            fn = {"name": c.name, "arguments": ""}
            out.append({"tool_calls": [{"index": c.index, "id": c.id, "type": "function", "function": fn}]})
        else:
            out.append({"tool_calls": [{"index": c.index, "function": {"arguments": c.arguments}}]})
    return out
