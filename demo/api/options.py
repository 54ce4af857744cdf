"""The OpenAI request options beyond plain sampling, and the per-request cache controls.

    opts = options.parse(body, "chat", vocab_size)   # ApiError 400 naming the bad field

OpenAI's semantics and ranges: frequency_penalty / presence_penalty in [-2, 2] (additive,
over generated tokens); logit_bias {"token id": -100..100}; n >= 1; on chat `logprobs: bool`
with `top_logprobs` 0..20, on completions `logprobs` 0..5 (an int). vLLM's extra sampling
options: `top_k` (-1 or 0: off), `min_p` in [0, 1], `repetition_penalty` in (0, 2] (1: off).
The cache controls come from the servers that have them: llama.cpp's `cache_prompt` and
vLLM's `cache_salt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from demo.api.schema import _bad, _int, _number, _utf8, decimal

MAX_N = 16  # choices per request: each is a row of the batch, on a server with one worker
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # OpenAI's limits
MAX_SALT_CHARS = 256
MAX_TOP_K = 1 << 20  # above any vocabulary: the same as off


@dataclass(frozen=True)
class Options:
    n: int = 1  # choices generated from the one prompt
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    top_logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's and the top k
    cache_prompt: bool = True  # False: the request neither reads nor writes the prefix cache
    cache_salt: str | None = None  # narrows sharing to the caller's requests with the same salt
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise _bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out = {}
    for key, value in bias.items():
        # OpenAI's keys are token ids as strings ("50256"); JSON object keys are strings anyway.
        token = decimal(key)
        if token is None or token >= vocab_size:
            raise _bad(
                f"'logit_bias' keys must be token ids in 0..{vocab_size - 1}, got {key[:40]!r}", "logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise _bad(f"'logit_bias' values must be numbers in [-100, 100], got {value!r}", "logit_bias")
        out[token] = float(value)
    return out


def _logprobs(body: dict, endpoint: str) -> int | None:
    limit = MAX_TOP_LOGPROBS[endpoint]
    if endpoint == "completions":  # legacy: logprobs is the number of alternatives
        k = _int(body, "logprobs")
        if k is not None and not 0 <= k <= limit:
            raise _bad(f"'logprobs' must be between 0 and {limit}, got {k}", "logprobs")
        return k
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad("'logprobs' must be a boolean", "logprobs")
    k = _int(body, "top_logprobs")
    if k is not None and not 0 <= k <= limit:
        raise _bad(f"'top_logprobs' must be between 0 and {limit}, got {k}", "top_logprobs")
    if k and not wanted:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (k or 0) if wanted else None


def parse(body: dict, endpoint: str, vocab_size: int) -> Options:
    """Options of a chat ("chat") or completions ("completions") body; ApiError 400 if invalid."""
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise _bad(f"'n' must be between 1 and {MAX_N}, got {n}", "n")
    cache_prompt = body.get("cache_prompt", True)
    if not isinstance(cache_prompt, bool):
        raise _bad("'cache_prompt' must be a boolean", "cache_prompt")
    salt: Any = body.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_SALT_CHARS):
        raise _bad(
            f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} characters", "cache_salt"
        )
    if salt is not None:
        _utf8(salt, "cache_salt")  # (it keys the cache, and crosses to the engine process)
    top_k = _int(body, "top_k")
    if top_k is not None and not (top_k == -1 or 0 <= top_k <= MAX_TOP_K):
        raise _bad(f"'top_k' must be -1 or 0 (off) or between 1 and {MAX_TOP_K}, got {top_k}", "top_k")
    return Options(
        n=n or 1,
        top_k=max(top_k or 0, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body, vocab_size),
        top_logprobs=_logprobs(body, endpoint),
        cache_prompt=cache_prompt,
        cache_salt=salt,
    )


def salted(namespace, salt: str | None):
    """The cache namespace of a request: the tenant's own, or (tenant's, salt) with a salt.

    A tuple whose first item is the server-derived tenant namespace: a salt can only split a
    tenant's sharing further, never reach another tenant's (or the unsalted) prefixes."""
    return namespace if salt is None else (namespace, "salt", salt)
