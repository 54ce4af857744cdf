"""What every tool-call format shares: the parsed call record and the format's interface.

A format knows the marker that opens the calls part of a reply (``start``), how to read the
calls from the text that follows it (``parse``), and how that text is written, as a Lark
grammar with the calls' JSON schemas embedded (``grammar``), so that ``tool_choice: required``
or a named function can be forced by constrained decoding (demo.engine.constrained).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

# The start of a call object whose arguments can be streamed as written: name first, then them
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's "arguments" string)


class ToolFormat:
    """A tool-call format. Subclasses set ``name`` and ``start`` and implement ``parse`` and
    ``grammar``; ``at_start_only``: the marker counts only at the reply's start (after spaces)."""

    name = ""
    start = ""
    at_start_only = False
    arguments_key = "arguments"  # the key of a call's arguments object in the model's JSON

    def parse(self, text: str, final: bool) -> list[ToolCall] | None:
        """Calls in ``text`` (which starts with ``start``). ``final=False``: the calls complete
        so far (maybe none); ``final=True``: every call, or None if ``text`` is not a calls block."""
        raise NotImplementedError

    def grammar(self, call_schema: dict, parallel: bool, lit=None) -> str:
        """A Lark grammar (llguidance's dialect) of the calls block, each call matching
        ``call_schema`` (a JSON schema of one call object); one call unless ``parallel``.
        ``lit(text)``: text as a Lark expression (default ``lark_literal``; the engine's writes
        a marker that is one added token as that token, ``<[id]>``)."""
        raise NotImplementedError

    def partial(self, text: str) -> tuple[str, str] | None:
        """For a calls block ``text`` whose last call is still being written: (its name, the
        arguments text written so far), once the name is known; None otherwise (or for a
        format that releases calls whole). The arguments text then grows into the
        ``arguments`` ``parse`` gives that call (the raw text, as written)."""
        return None

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def call_schema(self, tools: list[dict]) -> dict:
        """The JSON schema of one call object naming one of ``tools`` (OpenAI function specs)."""
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["name"]},
                    self.arguments_key: t.get("parameters") or {"type": "object"},
                },
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        return options[0] if len(options) == 1 else {"anyOf": options}

    def call_from_json(self, obj) -> ToolCall | None:
        """A ToolCall from a parsed call object ({"name", arguments_key: {...}}), or None."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(self.arguments_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def raw_arguments(obj_text: str) -> tuple[str, str, bool] | None:
    """(name, the arguments' text so far, whether that object is complete) of a call object's
    text that starts ``{"name": ..., "arguments": `` (or "parameters"); None if it does not."""
    head = _CALL_HEAD.match(obj_text)
    if head is None:
        return None
    try:
        name = json.loads(f'"{head.group(1)}"')
    except ValueError:
        return None
    rest, depth, in_string, escaped = obj_text[head.end() :], 0, False, False
    for k, ch in enumerate(rest):
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return name, rest[: k + 1], True
            if depth < 0:
                return None
    return name, rest, False


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: dict) -> str:
    """llguidance's embedded JSON: ``%json{...}`` with compact separators."""
    return "%json" + json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def decode_objects(text: str, separator: str) -> tuple[list, str]:
    """JSON values at the start of ``text``, separated by ``separator`` (whitespace around it
    allowed): (values, the text left after the last complete one)."""
    decoder, values, rest = json.JSONDecoder(), [], text
    while True:
        stripped = rest.lstrip()
        if values:
            if not stripped.startswith(separator):
                return values, rest
            stripped = stripped[len(separator) :].lstrip()
        try:
            value, end = decoder.raw_decode(stripped)
        except ValueError:
            return values, rest
        values.append(value)
        rest = stripped[end:]
