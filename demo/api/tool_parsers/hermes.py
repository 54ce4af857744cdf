"""Hermes / Qwen tool calls: each call a JSON object between ``<tool_call>`` and ``</tool_call>``.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Lima"}}
    </tool_call>

Used by Qwen2.5, Qwen3, QwQ, Hermes 2/3 and most templates that write ``<tool_call>``.
"""

from __future__ import annotations

import json

from demo.api.tool_parsers.base import ToolCall, ToolFormat, json_rule, lark_literal, raw_arguments

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    start = OPEN

    def parse(self, text: str, final: bool) -> list[ToolCall] | None:
        calls, rest = [], text
        while True:
            rest = rest.lstrip()
            if not rest:
                return calls if calls or not final else None
            if not rest.startswith(OPEN):
                return None if final else calls
            body = rest[len(OPEN) :]
            end = body.find(CLOSE)
            if end < 0 and not final:
                return calls  # this call is still being written
            inner, rest = (body, "") if end < 0 else (body[:end], body[end + len(CLOSE) :])
            try:
                call = self.call_from_json(json.loads(inner))
            except ValueError:
                call = None
            call = self._as_written(call, inner)
            if call is None:
                return None if final else calls
            calls.append(call)

    @staticmethod
    def _as_written(call: ToolCall | None, inner: str) -> ToolCall | None:
        """``call`` with its arguments as the model wrote them (what a stream sent), when the
        call object starts with its name and the written arguments are the parsed ones."""
        raw = raw_arguments(inner) if call is not None else None
        if raw is None or not raw[2] or raw[0] != call.name:
            return call
        try:
            same = json.loads(raw[1]) == json.loads(call.arguments)
        except ValueError:
            return call
        return ToolCall(call.name, raw[1]) if same else call

    def partial(self, text: str) -> tuple[str, str] | None:
        at = text.rfind(OPEN)
        if at < 0 or CLOSE in text[at:]:
            return None
        raw = raw_arguments(text[at + len(OPEN) :])
        return (raw[0], raw[1]) if raw is not None else None

    def grammar(self, call_schema: dict, parallel: bool, lit=lark_literal) -> str:
        call = f"{lit(OPEN + chr(10))} {json_rule(call_schema)} {lit(chr(10) + CLOSE)}"
        return f"start: call{' (' + lit(chr(10)) + ' call)*' if parallel else ''}\ncall: {call}\n"
