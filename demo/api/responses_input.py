"""A /v1/responses request in the chat form the rest of the API takes.

    req = responses_input.parse(body)
    req.messages        # the new turn's chat messages (instructions not included)
    req.chat_body       # a chat-completions body for schema / options / agent_options
                        # (tools, tool_choice, response_format, sampling in chat's names)

Input items (OpenAI's Responses shapes): a string (one user message); messages
``{"role", "content": str | [{"type": "input_text" | "output_text", "text"}]}`` (``"type":
"message"`` optional); ``{"type": "function_call", "call_id", "name", "arguments"}`` (an earlier
call, an assistant turn) and ``{"type": "function_call_output", "call_id", "output"}`` (its
result, a tool message); ``reasoning`` items (an earlier output resent) are skipped, as chat
templates drop earlier turns' reasoning. Responses tools are flat (``{"type": "function", "name", ...}``) and
``text.format`` replaces chat's ``response_format``. ``instructions`` are a system message
before the conversation, never stored with it (OpenAI: not carried over to continuations).

The chat parsers name chat's fields in their errors; ``with req.named():`` around them renames
each error's ``param`` and message back to the field this request sent (``max_tokens`` ->
``max_output_tokens``, ``response_format`` -> ``text.format``, ``tools[0].function.name`` ->
``tools[0].name``, ``messages[1].tool_calls[0].function.arguments`` -> ``input[2].arguments``):
the one place that knows how the fields were renamed, here, names them back.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

from demo.api.schema import _bad, _utf8
from demo.errors import ApiError

ROLES = ("user", "system", "developer", "assistant")
MAX_ID_CHARS = 128
# A chat field name as the chat parsers write it in a param or a message (a path such as
# messages[1].tool_calls[0].function.arguments), not inside another word or path.
_CHAT_NAME = re.compile(
    r"(?<![\w.])(?:max_tokens|response_format(?:\.json_schema(?:\.schema)?)?|tools\[(\d*)\]\.function"
    r"|messages(?:\[(\d+)\]((?:\.[A-Za-z_]+|\[\d+\])*))?)(?![\w\[])"
)
# The rest of a messages[k] path, by the input item that became the message: an assistant
# turn's calls are function_call items (call m is its own item), a tool turn a function_call_output.
_CALL_FIELDS = {"": "", ".function.arguments": ".arguments", ".function.name": ".name", ".id": ".call_id",
                ".function": ""}  # fmt: skip
_OUTPUT_FIELDS = {".content": ".output", ".tool_call_id": ".call_id"}


@dataclass(frozen=True)
class ResponsesRequest:
    messages: list[dict]  # chat messages of this turn's input
    instructions: str | None
    previous_id: str | None
    store: bool
    chat_body: dict  # chat-completions fields for the shared parsers
    sources: tuple[tuple[int, ...], ...] = ()  # per message: the input items it was made of

    @contextlib.contextmanager
    def named(self):
        """Errors of the chat parsers (over ``chat_body``, or ``{"messages": self.messages}``)
        raised inside, with the fields this request sent named in their param and message."""
        try:
            yield
        except ApiError as e:
            renamed = ApiError(e.status, self._rename(e.message), e.param and self._rename(e.param), e.code)
            renamed.type, renamed.retry_after = e.type, e.retry_after
            raise renamed from None

    def _rename(self, text: str) -> str:
        return _CHAT_NAME.sub(self._field, text)

    def _field(self, m: re.Match) -> str:
        name = m.group(0)
        if name == "max_tokens":
            return "max_output_tokens"
        if name.startswith("response_format"):
            return "text.format.schema" if name.endswith(".schema") else "text.format"
        if name.startswith("tools"):
            return f"tools[{m.group(1)}]"
        if m.group(2) is None:
            return "input"
        k, rest = int(m.group(2)), m.group(3)
        if not k < len(self.sources):
            return name
        items, role = self.sources[k], self.messages[k]["role"]
        if not items:
            return "input"
        call = re.fullmatch(r"\.tool_calls(?:\[(\d+)\](.*))?", rest)
        if call is not None:  # call j of the turn: the turn's j-th function_call item
            j, tail = int(call.group(1) or 0), call.group(2) or ""
            return f"input[{items[j] if j < len(items) else items[0]}]{_CALL_FIELDS.get(tail, tail)}"
        if role == "tool":
            return f"input[{items[0]}]{_OUTPUT_FIELDS.get(rest, rest)}"
        return f"input[{items[0]}]{rest}"


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise _bad(
                    f"{param}[{j}] must be an input_text part {{'type': 'input_text', 'text'}}",
                    f"{param}[{j}]",
                )
            out.append(part["text"])
        return "".join(out)
    raise _bad(f"{param} must be a string or a list of input_text parts", param)


def _items(value: Any) -> tuple[list[dict], list[list[int]]]:
    """Chat messages of ``input`` and, per message, the input items it was made of (consecutive
    function_call items join one assistant turn)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], [[]]  # (no item: the field is input itself)
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a non-empty string or list of input items", "input")
    out: list[dict] = []
    sources: list[list[int]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            sources.append([i])
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str) and call_id):
                raise _bad(
                    f"{where}: a function_call item needs 'call_id', 'name' and 'arguments' strings", where
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
                sources[-1].append(i)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append([i])
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not (isinstance(call_id, str) and call_id and isinstance(output, str)):
                raise _bad(
                    f"{where}: a function_call_output item needs 'call_id' and 'output' strings", where
                )
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
            sources.append([i])
        elif kind == "reasoning":
            continue  # an earlier reply's reasoning, resent by clients that keep no server state
        else:
            raise _bad(
                f"{where}.type must be message, function_call, function_call_output or reasoning",
                f"{where}.type",
            )
    return out, sources


def _tools(value: Any) -> list | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _bad(
                f"tools[{i}]: only function tools are supported", f"tools[{i}]", "unsupported_parameter"
            )
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def _format(text: Any) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad(
                "'text.format' of type json_schema needs {'name', 'schema': {...}}", "text.format.schema"
            )
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


def parse(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    if instructions is not None:
        _utf8(instructions, "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not (isinstance(previous, str) and 0 < len(previous) <= MAX_ID_CHARS):
        raise _bad("'previous_response_id' must be a response id", "previous_response_id")
    if previous is not None:
        _utf8(previous, "previous_response_id")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise _bad("'store' must be a boolean", "store")
    chat = {
        k: body[k]
        for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls", "seed")
        if k in body
    }
    chat["max_tokens"] = body.get("max_output_tokens")
    chat["tools"] = _tools(body.get("tools"))
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    chat["response_format"] = _format(body.get("text"))
    for extra in ("chat_template_kwargs", "cache_salt", "cache_prompt"):
        if extra in body:
            chat[extra] = body[extra]
    messages, sources = _items(body.get("input"))
    return ResponsesRequest(
        messages, instructions, previous, store, chat, tuple(tuple(items) for items in sources)
    )
