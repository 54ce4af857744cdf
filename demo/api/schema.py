"""OpenAI request validation: a JSON body in, a typed request out, or an ApiError.

Unknown fields are ignored (as vLLM and llama.cpp do); known fields are checked for type
and range, and the first problem is reported with its parameter name. The options beyond
plain sampling (penalties, logit_bias, logprobs, n, cache control) are parsed in
demo.api.options.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from demo.errors import ApiError
from demo.request_json import bounded, json_text

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOPS = 4
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as vLLM
MAX_DIGITS = 18  # significant digits of a decimal() read exactly: past any id, size or bound here


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: the server default, clamped to what the context leaves
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    max_param: str = "max_tokens"  # the field max_tokens came from, for error messages


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str | parts}] (parts: _content)
    sampling: Sampling


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]  # text, or token ids
    sampling: Sampling


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _int(body: dict, name: str) -> int | None:
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise _bad(f"'{name}' must be an integer, got {type(v).__name__}", name)
    return v


def decimal(text: str) -> int | None:
    """The value of ``text`` if it is ASCII digits, else None: the one way a number written by a
    client (a logit_bias key, a remote Content-Length) becomes an int. ``str.isdigit()`` also
    takes "²" and other scripts' digits, which ``int()`` refuses or reads, and ``int()`` of more
    than 4,300 digits raises; a value of more than MAX_DIGITS significant digits comes back as
    ``10**MAX_DIGITS``, above anything it is compared with."""
    if not (text.isascii() and text.isdigit()):
        return None
    digits = text.lstrip("0")
    return int(digits or "0") if len(digits) <= MAX_DIGITS else 10**MAX_DIGITS


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise _bad(f"'{name}' must be a number", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise _bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _utf8(v: str, param: str) -> str:
    # JSON may carry lone surrogates (the escape \ud800 alone): json.loads accepts them, the
    # tokenizer does not (it raised TypeError: a 500 for a bad request).
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad("text must be valid Unicode (no unpaired surrogates)", param) from None
    return v


def _utf8_json(v: Any, param: str) -> None:
    """``_utf8`` for every string inside a JSON value (tools, tool call arguments)."""
    _utf8(json.dumps(v, ensure_ascii=False), param)


def _content(v: Any, param: str) -> str | list[dict]:
    """A message's content: a string, or content parts. Text-only parts are joined into one string;
    with an image or video part, the parts as ``[{"type": "text", "text"}, {"type": "image_url" or
    "video_url", "url", "param"}]`` (demo.api.images and demo.api.videos load them; ``param`` names
    the part in errors)."""
    if isinstance(v, str):
        return _utf8(v, param)
    if not isinstance(v, list):
        raise _bad("content must be a string or a list of content parts", param)
    parts = []
    for j, p in enumerate(v):
        where = f"{param}[{j}]"
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": _utf8(p["text"], param)})
        elif kind in ("image_url", "video_url"):
            media = p.get(kind)
            if not isinstance(media, dict) or not isinstance(media.get("url"), str) or not media["url"]:
                raise _bad(
                    f"{where}: a {kind} part must be {{'type': '{kind}', '{kind}': {{'url': ...}}}}", where
                )
            parts.append({"type": kind, "url": media["url"], "param": where})
        else:
            raise _bad(
                f"{where}: content parts must be {{'type': 'text', 'text': ...}}, image_url or video_url parts",
                where,
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


# Options that change what a response contains: ignoring them would answer another question
# (a tool call where the client waits for one, no prompt where echo asked for it), so they
# are refused by name; other unknown fields are ignored.
_UNSUPPORTED = {
    "tools": lambda v: v not in (None, []),
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": lambda v: v not in (None, []),
    "function_call": lambda v: v not in (None, "none"),
    "response_format": lambda v: v is not None and v != {"type": "text"},
    "echo": lambda v: v not in (None, False),
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v not in (None, ""),
}


# Taken by the chat endpoint (demo.api.agent_options); refused on completions as before.
CHAT_ONLY = ("tools", "tool_choice", "response_format")


def _refuse_unsupported(body: dict, allowed: tuple[str, ...] = ()) -> None:
    for name, used in _UNSUPPORTED.items():
        if name not in allowed and used(body.get(name)):
            raise _bad(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def sampling(body: dict, context: int, allowed: tuple[str, ...] = ()) -> Sampling:
    max_tokens = _int(body, "max_tokens")
    if body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens")
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and not 1 <= max_tokens <= context:
        raise _bad(
            f"'{param}' must be between 1 and the model's context length {context}, got {max_tokens}", param
        )
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise _bad("'stop' must be a non-empty string or a list of them", "stop")
    if stop is not None and len(stop) > MAX_STOPS:
        raise _bad(f"'stop' takes at most {MAX_STOPS} strings", "stop")
    for s in stop or ():
        _utf8(s, "stop")
    seed = _int(body, "seed")
    if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
        # vLLM's bound (torch's int64); wider seeds aliased each other in torch.manual_seed.
        raise _bad(f"'seed' must be between {SEED_MIN} and {SEED_MAX} (a 64-bit signed integer)", "seed")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    options = {} if options is None else options  # not `or {}`: [] and "" are not objects
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise _bad("'stream_options' must be an object like {'include_usage': true}", "stream_options")
    _refuse_unsupported(body, allowed)
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        stop=tuple(stop or ()),
        seed=seed,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        max_param=param,
    )


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    return body


def chat(body: Any, context: int) -> ChatRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{param} must be an object with 'role' and 'content'", param)
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a list/dict is unhashable: no lookup
            raise _bad(
                f"{param}.role must be one of {', '.join(ROLES)}, got "
                + (repr(role[:40]) if isinstance(role, str) else f"a {type(role).__name__}"),
                f"{param}.role",
            )
        calls = _tool_calls(m.get("tool_calls"), f"{param}.tool_calls") if role == "assistant" else None
        if calls and m.get("content") is None:
            content = ""  # an assistant turn of tool calls only (OpenAI sends content null)
        else:
            content = _content(m.get("content"), f"{param}.content")
        if isinstance(content, list) and ROLES[role] != "user":
            media = next(p for p in content if p["type"] != "text")
            raise _bad(f"{media['param']}: images and videos are taken in user messages only", media["param"])
        message = {"role": ROLES[role], "content": content}
        if calls:
            message["tool_calls"] = calls
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{param}: a tool message needs its 'tool_call_id'", f"{param}.tool_call_id")
            message["tool_call_id"] = _utf8(call_id, f"{param}.tool_call_id")
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            message["reasoning_content"] = _utf8(m["reasoning_content"], f"{param}.reasoning_content")
        out.append(message)
    return ChatRequest(out, sampling(body, context, CHAT_ONLY))


def _tool_calls(v: Any, param: str) -> list[dict] | None:
    """An assistant message's tool_calls, in the shape chat templates read: arguments as an
    object (OpenAI sends a JSON string; templates write ``arguments | tojson``)."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise _bad(f"{param} must be a list of tool calls", param)
    out = []
    for j, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(
                f"{param}[{j}] must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                f"{param}[{j}]",
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json_text(args or "{}", f"{param}[{j}].function.arguments")
            except ValueError:
                raise _bad(
                    f"{param}[{j}].function.arguments must be a JSON object (as text)",
                    f"{param}[{j}].function.arguments",
                ) from None
        if not isinstance(args, dict):
            raise _bad(
                f"{param}[{j}].function.arguments must be a JSON object (as text)",
                f"{param}[{j}].function.arguments",
            )
        bounded(args, f"{param}[{j}].function.arguments")
        _utf8_json(args, f"{param}[{j}].function.arguments")
        call = {"type": "function", "function": {"name": _utf8(fn["name"], param), "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = _utf8(c["id"], f"{param}[{j}].id")
        out.append(call)
    return out


def completion(body: Any, context: int, vocab_size: int) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ok_ids = isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt
    )
    if not (isinstance(prompt, str) or ok_ids) or not prompt:
        raise _bad(
            "'prompt' must be a non-empty string or list of token ids (one prompt per request)", "prompt"
        )
    if isinstance(prompt, str):
        _utf8(prompt, "prompt")
    return CompletionRequest(prompt, sampling(body, context))


def check_length(
    num_prompt: int,
    max_tokens: int | None,
    default: int,
    context: int,
    prompt_param: str = "messages",
    max_param: str = "max_tokens",
) -> int:
    """max_new_tokens for a prompt of num_prompt tokens; ApiError if it cannot fit.

    The params name the fields the client sent (messages or prompt, max_tokens or
    max_completion_tokens), so the error points at them."""
    if num_prompt == 0:
        raise _bad("the prompt is empty after tokenization", prompt_param)
    if num_prompt >= context:
        raise _bad(
            f"this model's maximum context length is {context} tokens; the prompt has {num_prompt}",
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is None:
        return min(default, context - num_prompt)
    if num_prompt + max_tokens > context:
        raise _bad(
            f"this model's maximum context length is {context} tokens; you asked for {num_prompt + max_tokens} "
            f"({num_prompt} in the prompt, {max_tokens} to generate)",
            max_param,
            "context_length_exceeded",
        )
    return max_tokens
