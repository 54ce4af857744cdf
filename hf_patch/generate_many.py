"""``generate_many``: run a list of prompts through ``model.generate()`` in cache-friendly batches.

    results = hf_patch.generate_many(model, prompts, tokenizer=tok, max_new_tokens=64)
    results[i].text, results[i].token_ids, results[i].cached_tokens   # in input order

Prompts are token-id lists, strings (with ``tokenizer``) or chat message lists (rendered by the
tokenizer's chat template). They run sorted by their token bytes, so prompts that share a
prefix are adjacent: the first batch of a group computes the prefix once (in-batch sharing)
and later batches find it in the store while it is still fresh (the longest-shared-prefix-
first order of SGLang's scheduler). Batches are left padded and bounded by a token budget.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from hf_patch.cache import RadixCache
from hf_patch.planning.batches import plan_batches
from hf_patch.stores import default_store
from radixkv import KVStore, pack_tokens


@dataclass(frozen=True)
class Generated:
    """One prompt's result. ``token_ids``: the new tokens, up to (not including) the first EOS."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None  # decoded ``token_ids`` (special tokens skipped) when a tokenizer was given
    finish_reason: str  # "stop": an EOS ended it; "length": max_new_tokens (or a stopping criterion)
    cached_tokens: int  # prompt tokens served from the store


def encode_prompt(prompt, tokenizer) -> list[int]:
    """Token ids of one prompt: ids as they are, a string tokenized, chat messages rendered."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a string prompt needs tokenizer=")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        raise ValueError("pass token ids as a list of ints (tensor.tolist()), not a tensor")
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("chat messages need tokenizer= with a chat_template")
        rendered = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        return list(
            rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
        )
    if (
        isinstance(prompt, Sequence)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    raise ValueError(
        f"a prompt must be a non-empty list of token ids, a string, or a list of chat messages "
        f"(dicts with 'role' and 'content'), got {type(prompt).__name__}: {str(prompt)[:80]!r}"
    )


def _kwargs_key(kwargs: dict) -> str:
    """Prompts batch together only under equal generation arguments."""
    return json.dumps(kwargs, sort_keys=True, default=repr)


def _new_token_count(model, kwargs: dict) -> int:
    n = kwargs.get("max_new_tokens", getattr(model.generation_config, "max_new_tokens", None))
    return int(n) if n else 20


def _eos_ids(model, kwargs: dict) -> set[int]:
    eos = kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def generate_many(
    model,
    prompts: Sequence,
    *,
    tokenizer=None,
    store: KVStore | None = None,
    namespace: Hashable = None,
    max_batch_tokens: int = 16384,
    max_batch_size: int = 32,
    per_prompt_kwargs: Sequence[dict] | None = None,
    progress: bool = True,
    **generate_kwargs,
) -> list[Generated]:
    """Generate for every prompt with a RadixCache; results in input order.

    ``prompts``: token-id lists, strings (``tokenizer`` needed) or chat message lists.
    ``generate_kwargs``: passed to every ``model.generate()`` call (``max_new_tokens``,
    ``do_sample``...); ``per_prompt_kwargs[i]`` adds to them for prompt i (prompts batch only
    with prompts of equal arguments). ``store``: default, the model's own store. ``progress``:
    a tqdm bar with prompts/s and the cache hit rate. ``namespace``: one hashable for every
    prompt (RadixCache's per-row list is refused: prompts are reordered into batches). Greedy
    results equal those of stock generate() per prompt (up to float rounding between batch
    shapes).

    Raises ValueError, before generating anything, for a prompt it cannot read or for
    ``num_return_sequences`` > 1 (one result per prompt).
    """
    if per_prompt_kwargs is not None and len(per_prompt_kwargs) != len(prompts):
        raise ValueError(f"per_prompt_kwargs has {len(per_prompt_kwargs)} entries for {len(prompts)} prompts")
    if max_batch_tokens < 1 or max_batch_size < 1:
        raise ValueError("max_batch_tokens and max_batch_size must be positive")
    if isinstance(namespace, list):  # RadixCache's per-row form: prompts here are sorted into batches
        raise ValueError(
            "generate_many takes one namespace for every prompt, got a list: call it once per namespace"
        )
    kwargs_list = [
        {**generate_kwargs, **(per_prompt_kwargs[i] if per_prompt_kwargs else {})}
        for i in range(len(prompts))
    ]
    for i, kw in enumerate(kwargs_list):
        if kw.get("num_return_sequences", 1) != 1:
            raise ValueError(
                f"prompt {i}: generate_many returns one result per prompt (num_return_sequences=1)"
            )
        if "past_key_values" in kw or "attention_mask" in kw:
            raise ValueError(f"prompt {i}: generate_many makes the cache and attention mask itself")
    encoded = []
    for i, prompt in enumerate(prompts):
        try:
            encoded.append(encode_prompt(prompt, tokenizer))
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None
    packed = [pack_tokens(ids) for ids in encoded]
    block_size = (store if store is not None else default_store(model)).block_size
    keys = [_kwargs_key(kw) for kw in kwargs_list]
    new_tokens = [_new_token_count(model, kw) for kw in kwargs_list]
    batches = plan_batches(packed, keys, block_size, max_batch_tokens, max_batch_size, new_tokens)
    pad_id = generate_kwargs.get("pad_token_id", model.generation_config.pad_token_id)
    if pad_id is None and tokenizer is not None:
        pad_id = tokenizer.pad_token_id
    if pad_id is None:
        eos = _eos_ids(model, generate_kwargs)
        pad_id = min(eos) if eos else 0  # masked out: any id works
    results: list[Generated | None] = [None] * len(prompts)
    cached_total = prompt_total = 0
    bar = tqdm(total=len(prompts), unit="prompt", disable=not progress, desc="generate_many")
    try:
        for batch in batches:
            kw = {"pad_token_id": pad_id, **kwargs_list[batch[0]]}
            width = max(len(encoded[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, i in enumerate(batch):
                input_ids[row, width - len(encoded[i]) :] = torch.tensor(encoded[i])
                mask[row, width - len(encoded[i]) :] = 1
            cache = RadixCache(store=store, namespace=namespace)
            with torch.no_grad():
                out = model.generate(
                    input_ids.to(model.device),
                    attention_mask=mask.to(model.device),
                    past_key_values=cache,
                    **kw,
                )
            sequences = (out if isinstance(out, torch.Tensor) else out.sequences)[:, width:].tolist()
            eos = _eos_ids(model, kw)
            for row, i in enumerate(batch):
                new = sequences[row]
                stop = next((j for j, t in enumerate(new) if t in eos), None)
                token_ids = new if stop is None else new[:stop]
                text = (
                    tokenizer.decode(token_ids, skip_special_tokens=True) if tokenizer is not None else None
                )
                results[i] = Generated(
                    encoded[i],
                    token_ids,
                    text,
                    "length" if stop is None else "stop",
                    cache.cached_tokens[row],
                )
                cached_total += cache.cached_tokens[row]
                prompt_total += len(encoded[i])
            bar.update(len(batch))
            bar.set_postfix(hit=f"{cached_total / max(prompt_total, 1):.0%}", refresh=False)
    finally:
        bar.close()
    return results  # type: ignore[return-value]
