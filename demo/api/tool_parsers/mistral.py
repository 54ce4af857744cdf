"""Mistral tool calls after the ``[TOOL_CALLS]`` control token, in either of Mistral's layouts:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}]   (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}                          (v11+ tokenizers)

Mistral templates require call ids of exactly 9 letters and digits; ids are made so.
"""

from __future__ import annotations

import json
import secrets
import string

from demo.api.tool_parsers.base import ToolCall, ToolFormat, json_rule, lark_literal

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class Mistral(ToolFormat):
    name = "mistral"
    start = MARKER

    def call_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def parse(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text[len(MARKER) :].lstrip() if text.startswith(MARKER) else text.lstrip()
        if body.startswith("["):
            try:
                value, end = json.JSONDecoder().raw_decode(body)
            except ValueError:
                return None if final else []
            calls = [self.call_from_json(o) for o in value] if isinstance(value, list) else [None]
            if any(c is None for c in calls) or (final and body[end:].strip()):
                return None if final else []
            return calls
        calls = []
        for part in body.split(MARKER):  # v11: name[ARGS]{...}, repeated with the marker
            name, sep, args = part.partition(ARGS)
            try:
                value, end = json.JSONDecoder().raw_decode(args.lstrip()) if sep else (None, 0)
            except ValueError:
                value = None
            call = (
                self.call_from_json({"name": name.strip(), "arguments": value}) if value is not None else None
            )
            if call is None or not name.strip():
                return None if final else calls
            calls.append(call)
        return calls

    def grammar(self, call_schema: dict, parallel: bool, lit=lark_literal) -> str:
        more = f" ({lit(', ')} call)*" if parallel else ""
        return f"start: {lit(MARKER + '[')} call{more} {lit(']')}\ncall: {json_rule(call_schema)}\n"
