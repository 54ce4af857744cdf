"""Operator task prompts (rtp-llm's MultiTaskPrompt format), prepended by "task_id" and pinned.

    python -m demo --task-prompts tasks.json
    RADIXKV_TASK_PROMPTS='[{"task_id": "support", "prompt": "You are ..."}]' python -m demo

A request carrying ``"task_id"`` beside the OpenAI fields gets that task's prompt prepended:
as the system message of a chat request (before the request's own system text, if any), as a
text prefix of a completion (token-id prompts get its token ids). The prompts' KV is computed
at start-up and pinned for good (``hf_patch.pin_prompts``), once, under the engine's
PUBLIC_NAMESPACE: every tenant and cache_salt reads them there (any request whose token ids
start with a pinned form, task_id or not), while the rest of each request stays keyed by its
own namespace, so tenants still never share their own text (``hf_patch.SharedPrefix``). The
chat and completion forms share the blocks where their tokens agree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Sequence

from demo.errors import ApiError

log = logging.getLogger(__name__)
ENV = "RADIXKV_TASK_PROMPTS"
_PROBES = ("a", "b")  # two different continuations: their common token prefix is the task's


class TaskPromptError(ValueError):
    """A malformed task prompt file or variable; the message says what is wrong and where."""


def parse(text: str, where: str) -> dict[str, str]:
    """``[{"task_id": str, "prompt": str}, ...]`` -> {task_id: prompt}. Raises TaskPromptError."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskPromptError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(entries, list):
        raise TaskPromptError(f"{where}: expected a JSON list of {{'task_id', 'prompt'}} objects")
    prompts: dict[str, str] = {}
    for i, entry in enumerate(entries):
        at = f"{where}: entry {i}"
        if not isinstance(entry, dict):
            raise TaskPromptError(f"{at}: expected an object with 'task_id' and 'prompt'")
        task_id, prompt = entry.get("task_id"), entry.get("prompt")
        if not isinstance(task_id, str) or not task_id:
            raise TaskPromptError(f"{at}: 'task_id' must be a non-empty string, got {task_id!r}")
        if not isinstance(prompt, str) or not prompt:
            raise TaskPromptError(f"{at} (task_id {task_id!r}): 'prompt' must be a non-empty string")
        if task_id in prompts:
            raise TaskPromptError(f"{at}: task_id {task_id!r} appears twice")
        prompts[task_id] = prompt
    return prompts


def load(path: str | None, env_text: str | None) -> dict[str, str]:
    """The task prompts from ``path`` (the flag wins) or from the variable's JSON text; {} if neither."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise TaskPromptError(f"--task-prompts {path}: cannot read: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise TaskPromptError(f"--task-prompts {path}: not UTF-8 text: {e}") from None
        return parse(text, f"--task-prompts {path}")
    if env_text:
        return parse(env_text, ENV)
    return {}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return list(a[:n])


class TaskPrompts:
    """The loaded task prompts and how a request uses them."""

    def __init__(self, prompts: dict[str, str]) -> None:
        self.prompts = prompts

    def __bool__(self) -> bool:
        return bool(self.prompts)

    def lookup(self, body: object) -> str | None:
        """The prompt of the body's ``"task_id"``, None without one; ApiError 400 naming an unknown id."""
        if not isinstance(body, dict) or body.get("task_id") is None:
            return None
        task_id = body["task_id"]
        if not isinstance(task_id, str):
            raise ApiError(400, f"'task_id' must be a string, got {type(task_id).__name__}", "task_id")
        if task_id not in self.prompts:
            known = ", ".join(map(repr, self.prompts)) or "none are configured"
            raise ApiError(400, f"unknown task_id {task_id!r} (known: {known})", "task_id", "unknown_task_id")
        return self.prompts[task_id]

    @staticmethod
    def chat(prompt: str, messages: list[dict]) -> list[dict]:
        """``messages`` with the task prompt as (the start of) the system message."""
        if messages and messages[0]["role"] == "system":
            first = {"role": "system", "content": prompt + "\n\n" + messages[0]["content"]}
            return [first, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def pin(self, engine) -> int:
        """Compute and pin every task prompt's KV, chat and completion forms, once for all tenants.

        The pinned ids are what requests start with: the common token prefix of two requests
        that differ only after the task prompt. Returns the pinned tokens. Raises
        TaskPromptError naming blocks needed and blocks that exist when the pool cannot hold them.
        """
        import hf_patch
        from demo.engine.runner import PUBLIC_NAMESPACE

        forms: dict[tuple, list[int]] = {}
        for task_id, prompt in self.prompts.items():
            chat = [engine.chat_ids(self.chat(prompt, [{"role": "user", "content": p}])) for p in _PROBES]
            forms[task_id, "chat"] = _common_prefix(*chat)
            forms[task_id, "completion"] = _common_prefix(*(engine.text_ids(prompt + p) for p in _PROBES))
        forms = {key: ids for key, ids in forms.items() if len(ids) >= engine.store.block_size}
        tokens = sum(map(len, forms.values()))
        log.info(
            "pinning %d task prompts (%d tokens in chat and completion forms) ...", len(self.prompts), tokens
        )
        started = time.monotonic()
        try:
            base = (
                engine.adapters.base()
                if engine.adapters is not None
                else contextlib.nullcontext(engine.model)
            )
            with base as model:  # the base model's KV, whatever adapters are loaded
                pinned = hf_patch.pin_prompts(model, forms, store=engine.store, namespace=PUBLIC_NAMESPACE)
        except ValueError as e:
            raise TaskPromptError(f"task prompts cannot be pinned: {e}{_fits(engine, forms)}") from None
        engine.runner.set_public_prefixes(forms.values())
        log.info("pinned the task prompts in %.1f s", time.monotonic() - started)
        return sum(pinned.values())


def _fits(engine, forms: dict[tuple, list[int]]) -> str:
    """The --cache-tokens advice for task prompts too big for the pool: their distinct whole
    blocks plus one full-context request's worth of room for the traffic."""
    from hf_patch.task_prompts import _blocks_needed

    block = engine.store.block_size
    need = _blocks_needed(forms.values(), block) * block
    if need <= engine.store.pool.num_blocks * block:  # refused for another reason: no advice
        return ""
    fits = need + -(-engine.context // block) * block
    return (
        f". They take {need} tokens of the pool; --cache-tokens {fits} (or RADIXKV_CACHE_TOKENS={fits}) "
        f"holds them and leaves one full-context request ({engine.context} tokens) room beside them"
    )
