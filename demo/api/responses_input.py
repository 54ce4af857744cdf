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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from demo.api.schema import _bad

ROLES = ("user", "system", "developer", "assistant")
MAX_ID_CHARS = 128


@dataclass(frozen=True)
class ResponsesRequest:
    messages: list[dict]  # chat messages of this turn's input
    instructions: str | None
    previous_id: str | None
    store: bool
    chat_body: dict  # chat-completions fields for the shared parsers


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


def _items(value: Any) -> list[dict]:
    """Chat messages of ``input``; consecutive function_call items join one assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a non-empty string or list of input items", "input")
    out: list[dict] = []
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
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not (isinstance(name, str) and isinstance(args, str) and isinstance(call_id, str) and call_id):
                raise _bad(
                    f"{where}: a function_call item needs 'call_id', 'name' and 'arguments' strings", where
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not (isinstance(call_id, str) and call_id and isinstance(output, str)):
                raise _bad(
                    f"{where}: a function_call_output item needs 'call_id' and 'output' strings", where
                )
            out.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # an earlier reply's reasoning, resent by clients that keep no server state
        else:
            raise _bad(
                f"{where}.type must be message, function_call, function_call_output or reasoning",
                f"{where}.type",
            )
    return out


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
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


def parse(body: Any) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not (isinstance(previous, str) and 0 < len(previous) <= MAX_ID_CHARS):
        raise _bad("'previous_response_id' must be a response id", "previous_response_id")
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
    return ResponsesRequest(_items(body.get("input")), instructions, previous, store, chat)
