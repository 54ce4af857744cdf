"""Llama 3.1-3.3 JSON tool calls: the reply is the call object itself, after an optional
``<|python_tag|>``; several calls are separated by ``;``.

    {"name": "get_weather", "parameters": {"city": "Lima"}}

The call is recognised only at the reply's start (a JSON object later in a reply is content).
"""

from __future__ import annotations

from demo.api.tool_parsers.base import ToolCall, ToolFormat, decode_objects, json_rule, lark_literal

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    name = "llama3_json"
    start = "{"
    at_start_only = True
    arguments_key = "parameters"
    starts = (PYTHON_TAG, "{")

    def parse(self, text: str, final: bool) -> list[ToolCall] | None:
        text = text.lstrip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG) :]
        objects, rest = decode_objects(text, ";")
        calls = [self.call_from_json(o) for o in objects]
        if any(c is None for c in calls):
            return None if final else []
        if final and (rest.strip() or not calls):
            return None
        return calls

    def grammar(self, call_schema: dict, parallel: bool, lit=lark_literal) -> str:
        more = f" ({lit('; ')} call)*" if parallel else ""
        return f"start: call{more}\ncall: {json_rule(call_schema)}\n"
