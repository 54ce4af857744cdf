"""The OpenAI batch file format, as vLLM's ``run_batch`` reads and writes it.

Input, one request per line::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [...], "max_tokens": 64, "temperature": 0}}

Output, one line per request::

    {"id": "batch-...", "custom_id": "q1", "error": null,
     "response": {"status_code": 200, "request_id": "...", "body": {<chat.completion>}}}

A line that cannot be served gets ``status_code`` 400, ``body`` null and ``error`` a message
naming what is wrong (vLLM's shape), never a crash.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
# Body fields this runner honours; anything else is refused by name rather than silently ignored.
SUPPORTED_FIELDS = {
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
    "stream", "user",
}  # fmt: skip


@dataclass
class BatchRequest:
    """One input line. ``error`` set: the line is answered with that message, nothing generated."""

    index: int  # 0-based line number among non-blank lines: the output order
    custom_id: str | None
    kind: str = ""  # "chat" | "completion"
    body: dict = field(default_factory=dict)
    error: str | None = None
    prompt_ids: list[int] | None = None
    generate_kwargs: dict = field(default_factory=dict)


def parse_line(index: int, line: str) -> BatchRequest:
    """Read one input line; problems become ``error``, never exceptions."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        return BatchRequest(index, None, error=f"line {index + 1} is not JSON: {exc}")
    if not isinstance(data, dict):
        return BatchRequest(index, None, error=f"line {index + 1} is not a JSON object")
    custom_id = data.get("custom_id")
    request = BatchRequest(index, custom_id if isinstance(custom_id, str) else None)
    if not isinstance(custom_id, str) or not custom_id:
        request.error = "custom_id must be a non-empty string"
    elif data.get("method", "POST") != "POST":
        request.error = f"method must be POST, got {data.get('method')!r}"
    elif data.get("url") not in URLS:
        request.error = f"url must be one of {sorted(URLS)}, got {data.get('url')!r}"
    elif not isinstance(data.get("body"), dict):
        request.error = "body must be a JSON object"
    else:
        request.kind, request.body = URLS[data["url"]], data["body"]
        request.error = _check_body(request.kind, request.body)
    return request


def _check_body(kind: str, body: dict) -> str | None:
    unknown = sorted(set(body) - SUPPORTED_FIELDS)
    if unknown:
        return f"unsupported body field(s) {unknown}; supported: {sorted(SUPPORTED_FIELDS)}"
    if kind == "chat" and (not isinstance(body.get("messages"), list) or not body["messages"]):
        return "a chat request needs a non-empty 'messages' list"
    if kind == "completion" and not isinstance(body.get("prompt"), (str, list)):
        return "a completion request needs 'prompt' (a string or a list of token ids)"
    if body.get("n", 1) != 1:
        return f"n must be 1 (one completion per request line), got {body.get('n')!r}"
    if body.get("stream"):
        return "stream is not available in a batch file"
    for name, low in (("max_tokens", 1), ("max_completion_tokens", 1)):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            return f"{name} must be a positive integer, got {value!r}"
    for name, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = body.get(name)
        if value is not None and (not isinstance(value, (int, float)) or not low <= value <= high):
            return f"{name} must be a number in [{low}, {high}], got {value!r}"
    return None


def encode(request: BatchRequest, tokenizer, default_max_tokens: int, context: int | None = None) -> None:
    """Fill ``prompt_ids`` and ``generate_kwargs`` (or ``error``) from the body.

    ``context``: the model's longest sequence; a prompt + ``max_tokens`` beyond it is an error (as
    in the OpenAI API), and the default ``max_tokens`` is shortened to fit.
    """
    body = request.body
    try:
        if request.kind == "chat":
            rendered = tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True
            )
            ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        elif isinstance(body["prompt"], str):
            ids = tokenizer(body["prompt"])["input_ids"]
        else:
            ids = body["prompt"]
            if not all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in ids):
                raise ValueError(f"prompt token ids must be ints in [0, {len(tokenizer)})")
    except Exception as exc:  # a template error, a malformed message: this request only
        request.error = f"cannot build the prompt: {type(exc).__name__}: {exc}"
        return
    if not ids:
        request.error = "the prompt is empty"
        return
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    new_tokens = asked or default_max_tokens
    if context is not None:
        if len(ids) >= context or (asked and len(ids) + asked > context):
            request.error = (
                f"the prompt has {len(ids)} tokens and asks for {asked or 1} more; "
                f"the model's context is {context} tokens"
            )
            return
        new_tokens = min(new_tokens, context - len(ids))
    request.prompt_ids = list(ids)
    temperature = body.get("temperature", 1.0)  # OpenAI's default: sampling
    kwargs = {"max_new_tokens": new_tokens}
    if temperature == 0:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=float(temperature), top_p=float(body.get("top_p", 1.0)))
    request.generate_kwargs = kwargs


def _request_id(custom_id: str | None, index: int) -> str:
    return "batch-" + hashlib.sha256(f"{index}:{custom_id}".encode()).hexdigest()[:24]


def error_line(request: BatchRequest, status_code: int = 400) -> dict:
    """The output line of a request that was not served (``status_code`` 500: generation failed)."""
    rid = _request_id(request.custom_id, request.index)
    return {
        "id": rid,
        "custom_id": request.custom_id,
        "response": {"status_code": status_code, "request_id": rid, "body": None},
        "error": request.error,
    }


def result_line(request: BatchRequest, model_name: str, text: str, finish_reason: str,
                completion_tokens: int, cached_tokens: int) -> dict:  # fmt: skip
    """The output line of a served request: a chat.completion or text_completion body."""
    rid = _request_id(request.custom_id, request.index)
    if request.kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj, prefix = "text_completion", "cmpl-"
    prompt_tokens = len(request.prompt_ids or ())
    body = {
        "id": prefix + rid[6:],
        "object": obj,
        "created": int(time.time()),
        "model": request.body.get("model") or model_name,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        },
    }
    return {
        "id": rid,
        "custom_id": request.custom_id,
        "response": {"status_code": 200, "request_id": rid, "body": body},
        "error": None,
    }
