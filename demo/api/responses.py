"""OpenAI response shapes: choices, logprobs, usage and stream chunks, as plain dicts.

Logprobs (of the distribution after penalties and logit_bias, before temperature and top_p;
see demo.engine.processors) in OpenAI's two shapes:

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": None}``;
- completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}``, where each top_logprobs entry also holds the chosen token (OpenAI: "up to
  logprobs+1 elements") and text_offset counts characters of the completion text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from demo.engine.generation import Choice, Delta, Result
from demo.engine.processors import TokenLogprobs

TokenText = Callable[[int], str]  # token id -> its text (special tokens included)


def usage(r: Result) -> dict:
    return {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "total_tokens": r.prompt_tokens + r.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    }


def _entry(token_text: TokenText, token: int, logprob: float) -> dict:
    text = token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(steps: Sequence[TokenLogprobs] | None, token_text: TokenText) -> dict | None:
    if steps is None:
        return None
    content = [
        {
            **_entry(token_text, s.token, s.logprob),
            "top_logprobs": [_entry(token_text, t, lp) for t, lp in s.top],
        }
        for s in steps
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(
    steps: Sequence[TokenLogprobs] | None, token_text: TokenText, offset: int = 0
) -> dict | None:
    """`offset`: characters of the completion before these tokens (streamed chunks)."""
    if steps is None:
        return None
    tokens, offsets = [], []
    for s in steps:
        offsets.append(offset)
        tokens.append(token_text(s.token))
        offset += len(tokens[-1])
    tops = []
    for s in steps:
        top = {token_text(t): lp for t, lp in s.top}
        top.setdefault(token_text(s.token), s.logprob)
        tops.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [s.logprob for s in steps],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def choice(endpoint: str, c: Choice, token_text: TokenText) -> dict:
    """One entry of a non-streamed response's `choices`."""
    if endpoint == "chat":
        return {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "finish_reason": c.finish_reason,
            "logprobs": chat_logprobs(c.logprobs, token_text),
        }
    return {
        "index": c.index,
        "text": c.text,
        "finish_reason": c.finish_reason,
        "logprobs": completion_logprobs(c.logprobs, token_text),
    }


class ChunkChoices:
    """The `choices` entries of stream chunks; tracks each choice's text length (for
    completions' text_offset) and whether logprobs were asked for."""

    def __init__(self, endpoint: str, n: int, logprobs: bool, token_text: TokenText):
        self.endpoint, self.logprobs, self.token_text = endpoint, logprobs, token_text
        self._chars = [0] * n

    def role(self, index: int) -> dict:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }

    def delta(self, d: Delta) -> dict:
        steps = d.logprobs if self.logprobs else None
        if self.endpoint == "chat":
            return {
                "index": d.index,
                "delta": {"content": d.text},
                "finish_reason": None,
                "logprobs": chat_logprobs(steps, self.token_text),
            }
        out = {
            "index": d.index,
            "text": d.text,
            "finish_reason": None,
            "logprobs": completion_logprobs(steps, self.token_text, self._chars[d.index]),
        }
        if steps:
            self._chars[d.index] += sum(len(t) for t in out["logprobs"]["tokens"])
        return out

    def finish(self, c: Choice) -> dict:
        if self.endpoint == "chat":
            return {"index": c.index, "delta": {}, "finish_reason": c.finish_reason, "logprobs": None}
        return {"index": c.index, "text": "", "finish_reason": c.finish_reason, "logprobs": None}
