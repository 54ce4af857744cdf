"""The step loop's decode attention over each row's own columns (cuda_ext.ragged_decode).

A RunningBatch keeps its rows left-padded to a common width W, so a stock SDPA call of a decode
step reads ``B x W`` columns of K and V per layer however short most rows are: with one
1,000-token reply among 30 chat rows of 40 tokens, nine tenths of what it reads is padding, and
on a CPU a decode step's attention is bound by those reads. ``cuda_ext.ragged_decode`` reads
row b's columns ``starts[b]:end`` only.

    with ragged_attention.columns(model, starts, end) as kwargs:   # {} where it does not apply
        out = model(input_ids=..., past_key_values=cache, **kwargs)

``columns`` switches the model's attention to ``"radixkv_ragged"`` for that forward (and back):
a transformers attention function (registered once) that runs the kernel for a one-token query
of float32 CPU tensors with plain scaled softmax attention, and transformers' own SDPA function
for anything else (its mask is built as SDPA's, so that fallback is exact). It applies where
numba is installed (the demo extra), the model is a float32 decoder (one config, full
attention, 1-D positions) in eval mode on the CPU, its attention is ``"sdpa"``
(transformers' default; an eager model, e.g. for softcapping, keeps eager),
``RADIXKV_RAGGED_ATTENTION`` is not ``0`` and ``verify(model)`` passed: once per model, a
two-row decode step through SDPA and through the kernel must give the same logits with every
attention layer calling the registered function (a model that computes attention its own way
keeps SDPA, logged). Not for concurrent forwards of one model from several threads while a
step runs (the switch is the model config's); the demo's worker owns its model.

    with ragged_attention.packed(model, slots, starts, ends) as kwargs:
        out = model(input_ids=ids_1xN, position_ids=pos_1xN, past_key_values=cache, **kwargs)

``packed`` runs one forward over N query tokens of several rows packed as one sequence (a
decode step's token per row beside the prompt tokens of rows joining the batch:
hf_patch.running_batch): token t attends to columns ``starts[t]:ends[t]`` of the cache's row
``slots[t]`` (the cache scatters each token's KV to its row and column). It has no SDPA
fallback (no rectangular mask expresses it): a call the kernel cannot compute raises. Callers
use it only after ``verify(model)`` (and RunningBatch's own packed probe) passed.

Both take ``pool=PoolTables(...)``: each KV row's first ``lengths[b]`` tokens (a cached prefix
many rows share) lie in the store's block pool, read in place through the row's block table
before its own columns, one softmax (``cuda_ext.ragged_decode.ragged_pooled``). Then no call
may fall back to SDPA (it would not see the prefix): one the kernel cannot compute raises.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from cuda_ext import ragged_decode
from hf_patch.model_spec import model_layout
from hf_patch.step_models import unsupported_reason

__all__ = ["NAME", "PACKED", "PoolTables", "available", "columns", "packed", "probed_once", "verify"]

logger = logging.getLogger(__name__)

NAME = "radixkv_ragged"
PACKED = "radixkv_packed"  # the packed forward's setting: no mask built (the kernel needs none)
_ENV = "RADIXKV_RAGGED_ATTENTION"

_state = threading.local()  # calls of the registered function during a forward (verify)
_registered = False


@dataclass(frozen=True)
class PoolTables:
    """Where each KV row's first tokens lie in a block pool (hf_patch.running_batch): row b's
    first ``lengths[b]`` tokens at blocks ``tables[b]`` (``[B, M]`` int64, ``lengths`` ``[B]``;
    0: none) of ``pool_k[pool_layer[layer_idx]]`` / ``pool_v[...]`` (``[blocks, block_size, Hkv,
    D]``, the store's ``BlockPool.k`` / ``.v``), read in place."""

    pool_k: Sequence[torch.Tensor]
    pool_v: Sequence[torch.Tensor]
    pool_layer: dict[int, int]  # model layer index -> pool layer index
    tables: np.ndarray
    lengths: np.ndarray


def available() -> bool:
    """Whether the kernel can run here: numba installed and ``RADIXKV_RAGGED_ATTENTION`` not 0."""
    return ragged_decode.available() and os.environ.get(_ENV, "1") != "0"


def _ensure_registered() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # the SDPA fallback's mask
    AttentionInterface.register(PACKED, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED, _no_mask)
    _registered = True


def _no_mask(*args, **kwargs):
    """The packed forward's mask: none (each token's columns are the kernel's plan)."""
    return None


def _plain(module, kwargs) -> bool:
    """Whether ``module``'s call is plain scaled softmax attention the kernel computes."""
    for name in ("softcap", "sliding_window", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            return False
    return not module.training and getattr(module, "is_causal", True)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = getattr(_state, "calls", None)
    if calls is not None:
        _state.calls = calls + 1
    pool = kwargs.pop("radixkv_pool", None)
    packing = kwargs.pop("radixkv_packed", None)
    if packing is not None:
        return _packed_attention(module, query, key, value, packing, dropout, scaling, kwargs, pool)
    plan = kwargs.pop("radixkv_columns", None)
    usable = (
        plan is not None
        and plan[1] == key.shape[2]  # else this layer's KV is not the step's (never seen): SDPA
        and query.shape[2] == 1
        and query.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype == torch.float32
        and dropout == 0.0
        and not (query.requires_grad or key.requires_grad or value.requires_grad)
        and _plain(module, kwargs)
    )
    if not usable and pool is not None:
        raise ValueError(
            f"ragged attention: a call the kernel cannot compute over rows whose prefix is in the pool "
            f"(query {list(query.shape)} {query.dtype} on {query.device}, dropout {dropout}, options "
            f"{sorted(k for k, v in kwargs.items() if v is not None)}): SDPA would not see the prefix"
        )
    if not usable:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if getattr(_state, "calls", None) is not None:
        _state.kernel_calls += 1
    starts, end = plan
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    if pool is None:
        out = ragged_decode.ragged_decode(query[:, :, 0], key, value, starts, end, scale)
    else:
        rows = len(starts)
        slots, ends = np.arange(rows, dtype=np.int64), np.full(rows, end, dtype=np.int64)
        out = _pooled(module, query[:, :, 0], key, value, slots, starts, ends, scale, pool)
    return out.unsqueeze(1), None  # [B, 1, heads, Dv], as sdpa_attention_forward returns


def _pooled(module, query, key, value, slots, starts, ends, scale, pool: PoolTables) -> torch.Tensor:
    """The kernel with ``pool``'s rows' prefixes read from the pool layer of ``module``."""
    layer = pool.pool_layer.get(getattr(module, "layer_idx", None))
    if layer is None:
        raise ValueError(f"ragged attention: {type(module).__name__} has no layer_idx naming a pool layer")
    return ragged_decode.ragged_pooled(
        query, key, value, slots, starts, ends, pool.pool_k[layer], pool.pool_v[layer],
        pool.tables, pool.lengths, scale,
    )  # fmt: skip


def _packed_attention(module, query, key, value, packing, dropout, scaling, kwargs, pool=None):
    """The kernel over ``query`` ``[1, Hq, N, D]`` (N packed tokens); no fallback: raises
    ValueError for a call it cannot compute."""
    if getattr(_state, "calls", None) is not None:
        _state.kernel_calls += 1
    if (
        query.shape[0] != 1
        or dropout != 0.0
        or query.requires_grad
        or key.requires_grad
        or not _plain(module, kwargs)
    ):
        raise ValueError(
            "packed attention: one packed sequence of plain softmax attention, no dropout or grad "
            f"(query {list(query.shape)}, dropout {dropout}, options {sorted(k for k, v in kwargs.items() if v is not None)})"
        )
    slots, starts, ends = packing
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    if pool is None:
        out = ragged_decode.ragged_packed(query[0].transpose(0, 1), key, value, slots, starts, ends, scale)
    else:
        out = _pooled(module, query[0].transpose(0, 1), key, value, slots, starts, ends, scale, pool)
    return out.unsqueeze(0), None  # [1, N, heads, Dv], as sdpa_attention_forward returns


def _fits(model) -> bool:
    """A float32 model in eval mode on the CPU, whose attention is ``"sdpa"`` (the kernel's
    fallback and mask are SDPA's; an eager model, e.g. for softcapping, keeps eager), with one
    config (a composite model's sub-configs each hold their own attention setting, which the
    switch would overwrite) and full attention over 1-D positions (RunningBatch's models: each
    row's mask is every column from its first real one, all the kernel reads)."""
    config = model.config
    return (
        model.device.type == "cpu"
        and model.dtype == torch.float32
        and not model.training
        and config._attn_implementation == "sdpa"
        and not getattr(config, "sub_configs", None)
        and (not hasattr(config, "get_text_config") or config.get_text_config() is config)
        and unsupported_reason(model) is None
        and not model_layout(model).stateful  # (its probe counts every layer as attention)
    )


@contextlib.contextmanager
def columns(model, starts, end: int, probing: bool = False, pool: PoolTables | None = None):
    """Within: the model's attention is the ragged kernel for a forward given ``**kwargs``
    (row b attends to its columns ``starts[b]:end`` of the cache after this step's append;
    ``starts``: a sequence of ints; ``pool``: rows' prefixes in the pool, first); yields {}
    (and changes nothing) where it does not apply, or raises ValueError there with ``pool``."""
    if not (probing or verify(model)):
        if pool is not None:
            raise ValueError("ragged attention: the model did not pass ragged_attention.verify")
        yield {}
        return
    _ensure_registered()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        kwargs = {"radixkv_columns": (np.asarray(starts, dtype=np.int64), int(end))}
        yield kwargs if pool is None else {**kwargs, "radixkv_pool": pool}
    finally:
        config._attn_implementation = previous


@contextlib.contextmanager
def packed(model, slots, starts, ends, pool: PoolTables | None = None):
    """Within: the model's attention is the packed kernel for a forward given ``**kwargs`` over
    one packed sequence (see the module; ``slots``, ``starts``, ``ends``: one int per token).
    Raises ValueError where ``verify(model)`` did not pass."""
    if not verify(model):
        raise ValueError("packed attention: the model did not pass ragged_attention.verify")
    _ensure_registered()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = PACKED
    try:
        kwargs = {"radixkv_packed": tuple(np.asarray(a, dtype=np.int64) for a in (slots, starts, ends))}
        yield kwargs if pool is None else {**kwargs, "radixkv_pool": pool}
    finally:
        config._attn_implementation = previous


def verify(model) -> bool:
    """Whether a decode step of ``model`` may run through the kernel: numba here, the setting
    on, a float32 CPU sdpa model (checked at each call), and, probed once per model and
    remembered on it (logged when not), a two-row decode step (one row left-padded) on a
    throwaway cache gives through the kernel the logits SDPA gives, every attention layer
    having called the kernel. A model whose layers compute attention their own way (not
    through transformers' registered functions) or with options the kernel lacks keeps SDPA.
    The first probe compiles the kernel (~1-3 s): the demo calls this at start."""
    if not available() or not _fits(model):
        return False
    return probed_once(
        model, "_radixkv_ragged_ok", _probe, logger, "decode attention stays SDPA for this model"
    )


def probed_once(model, attr: str, probe, log: logging.Logger, otherwise: str) -> bool:
    """``probe(model) -> (ok, reason)``, run once per model and remembered on it as ``attr``; a
    probe that raises fails (a model it cannot run keeps the plain path). A failure is logged
    once on ``log`` as ``otherwise`` (what the model does instead) and the reason."""
    known = getattr(model, attr, None)
    if known is not None:
        return known
    try:
        ok, reason = probe(model)
    except Exception as e:
        ok, reason = False, f"the probe failed: {e!r}"
    if not ok:
        log.warning("radixkv: %s: %s", otherwise, reason)
    setattr(model, attr, ok)
    return ok


def _probe(model) -> tuple[bool, str | None]:
    import copy

    from transformers import DynamicCache

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = text.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    mask = torch.ones((2, 7), dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(
            input_ids=ids[:, :6],
            attention_mask=mask[:, :6],
            position_ids=positions[:, :6],
            past_key_values=cache,
        )
        step = dict(
            input_ids=ids[:, 6:], attention_mask=mask, position_ids=positions[:, 6:], logits_to_keep=1
        )
        want = model(past_key_values=copy.deepcopy(cache), **step).logits.float()
        _state.calls, _state.kernel_calls = 0, 0
        try:
            with columns(model, [0, 3], 7, probing=True) as kwargs:
                got = model(past_key_values=cache, **step, **kwargs).logits.float()
            calls, used = _state.calls, _state.kernel_calls
        finally:
            _state.calls = None
    layers = text.num_hidden_layers
    if calls != layers:
        return False, f"{calls} of its {layers} layers called transformers' attention function"
    if used != layers:
        return False, (
            f"the kernel ran in {used} of its {layers} layers: the step's column plan did not reach "
            "them (the model does not pass extra forward arguments on) or their call has options "
            "the kernel lacks (softcapping, sinks, a sliding window)"
        )
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
        return False, f"its logits differ from SDPA's by {(got - want).abs().max().item():.3g}"
    return True, None
