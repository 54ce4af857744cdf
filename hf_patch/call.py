"""One model call on a RadixCache, as generate() (hf_patch.patch) and scoring (hf_patch.scoring)
both make it: resolve the store, open a ``Request``, key its rows, and bind in-batch sharing.

    with open_request(model, cache, reason) as request:   # the store bound, the cache emptied
        request.preload(ids, mask, ..., keys=key_parts(model, cache, ids.shape, 1),
                        share=sharing(model, request, model_kwargs))
        ... forward(s) on ``cache`` ...
        request.commit(sequences)
    # every pin released, the cache free for the next call

The two paths differ only in what runs between preload and commit (generate()'s loop, or one
forward whose logits are scored) and in how many trailing tokens per row they must compute
(``keep``: 1 for generate(), the continuation for scoring).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from hf_patch.batch_share import can_share, compute_shared
from hf_patch.cache import RadixCache
from hf_patch.keys.adapters import mixed_batch, row_adapters, unkeyable_reason
from hf_patch.keys.multimodal import Images
from hf_patch.keys.vlm_families import text_only_token_types
from hf_patch.keys.weights import fingerprint, flush_if_weights_changed, model_scope
from hf_patch.model_spec import check_store_fits, model_layout
from hf_patch.request import KeyParts, Request
from hf_patch.stores import default_store


@contextlib.contextmanager
def open_request(model, cache: RadixCache, reason: str | None = None) -> Iterator[Request]:
    """Bind ``cache`` to its store for one call of ``model`` and yield the call's ``Request``.

    Refuses (UnsupportedModelError) models whose KV cannot be reused, and (ValueError) a store
    shaped for another model; flushes the store when ``model``'s weights changed since its last
    call there. ``reason`` (or ``model``'s own, e.g. PEFT prompt learning): the call's KV depends
    on something the key cannot see; it then runs with the cache as a plain cache (nothing read,
    nothing committed, counted as uncacheable). Raises RuntimeError if ``cache`` is in use by
    another call. On exit, every pin the request holds is released, whatever happened.
    """
    layout = model_layout(model)  # also refuses models whose cache radixkv does not know
    # Resolved per call, never written back to the cache: the same RadixCache() may later serve
    # another model (or this one after .half()), which needs its own default store.
    if cache.store is None:
        store = default_store(model)
    else:
        store = cache.store
        check_store_fits(store, model, layout)
    before = fingerprint(model)
    flush_if_weights_changed(store, model, before)
    if cache._request is not None:
        raise RuntimeError("this RadixCache is already in use by a running call")
    cache.start(layout)
    request = cache._request = Request(cache, store, layout, model)
    # Weights changed while the call ran (another thread's optimizer step): its KV is of no one
    # weights, and the identity a sidecar would file it under is already the new one.
    request.weights_unchanged = lambda: fingerprint(model) == before
    reason = reason or unkeyable_reason(model)
    if reason is not None:
        request.mark_uncacheable(reason)
    try:
        yield request
    finally:
        request.close()
        cache._request = None


def _per_row(value, name: str, rows: int, rows_per_prompt: int) -> list:
    """A per-prompt list expanded to generate()'s rows (each prompt repeated for its beams /
    returned sequences), or a ValueError naming ``name``."""
    if len(value) * rows_per_prompt == rows:
        return [v for v in value for _ in range(rows_per_prompt)]
    if len(value) != rows:
        raise ValueError(
            f"RadixCache {name} has {len(value)} entries for {rows // rows_per_prompt} prompts ({rows} rows)"
        )
    return list(value)


def key_parts(
    model, cache: RadixCache, shape: torch.Size, rows_per_prompt: int, images: Images | None = None
) -> KeyParts:
    """Each row's key parts for the first forward's ``input_ids`` of ``shape`` [rows, columns]."""
    rows = shape[0]
    ns = cache.namespace
    namespaces = _per_row(ns, "namespace", rows, rows_per_prompt) if isinstance(ns, list) else [ns] * rows
    sp = cache.shared_prefix
    shared = _per_row(sp, "shared_prefix", rows, rows_per_prompt) if isinstance(sp, list) else [sp] * rows
    extra = cache.extra_ids
    if extra is not None:
        if extra.shape[0] * rows_per_prompt == rows and rows_per_prompt > 1:
            extra = extra.repeat_interleave(rows_per_prompt, dim=0)
        if tuple(extra.shape) != tuple(shape):
            raise ValueError(
                f"RadixCache extra_ids is {list(cache.extra_ids.shape)}, but the prompt is "
                f"{[rows // rows_per_prompt, shape[1]]}: give one extra id per input token"
            )
    if images is not None:  # an image's content id wins over a user's extra id on its tokens
        extra = (
            images.extra_ids if extra is None else torch.where(images.extra_ids != 0, images.extra_ids, extra)
        )
    adapters = row_adapters(model, rows, rows_per_prompt)
    return KeyParts(model_scope(model), namespaces, adapters, shared, extra)


def sharing(model, request: Request, model_kwargs: dict, chunk_size: int | None = None):
    """``share(rows, keep)`` for ``Request.match``: in-batch prefix sharing bound to this call, or
    None where a one-row prefix forward could compute other KV than the batch (model inputs
    besides ids and mask; a PEFT batch with one adapter per row). A VLM family's token types
    that are all zero (text-only rows) are plain: the prefix forward, given none, computes the
    same KV (hf_patch.keys.vlm_families: causal attention, 1-D positions)."""
    plain = text_only_token_types(model, model_kwargs)
    outputs = model_kwargs.get("mm_encoder_outputs")
    if isinstance(outputs, dict) and not any(v is not None for v in outputs.values()):
        plain.add("mm_encoder_outputs")  # generate() leaves {} on a VLM call without images
    kwargs = {k: v for k, v in model_kwargs.items() if k not in plain}
    if not can_share(kwargs) or mixed_batch(model):
        return None
    return functools.partial(
        compute_shared, model, request.store, request.layout, request.epoch, chunk_size=chunk_size
    )
