"""Attention that reads each row's cached prefix from the block pool in place (issue 41).

The copy path (``Request._copy_prefix``) gives every row of a call its own ``[B, H, L, D]`` copy
of its cached prefix, held for the whole call: 16 rows over one document hold 16 copies of it.
Here the rows' cache layers (``layer.PagedLayer``) hold only the columns the call computes; the
prefix stays in the pool, pinned by the call's leases until it ends, and a registered
transformers attention function reads it through the call's block table (``PagedPlan``, built
once per call): rows whose prefixes are the same blocks form a group, whose queries (every row,
every query head of a KV head, every query token) attend to the group's prefix in one call
(``cuda_ext.cascade_attention.attend``: the prefix is read once, whatever the batch), merged by
log-sum-exp with each row's attention over its own columns, masked as stock masks them.

    plan = build_plan(layout, cache, pool_k, pool_v, block_size, rows, pads, common)
    with activate(model, plan):          # the model's attention is "radixkv_paged" within
        model(...)                        # generate()'s forwards, or scoring's

Off by default: the copy path is bit-exact with stock generate() on the CPU in the family
matrix, this path ~1e-7 off in fp32 (another summation order; docs/paged-attention.md).
``RADIXKV_PAGED_ATTENTION=1`` or ``RadixCache(paged=True)`` turns it on (the option wins over
the variable). Where it applies then (``unusable_reason``): a model in eval mode (on the CPU
as measured; elsewhere the plain-torch formula runs, unmeasured), attention ``"sdpa"``, one
config, full-attention KV in every layer (``step_models.unsupported_reason``: no sliding or
chunked windows, no recurrent, indexed, compressed or shared-KV layers), every lease's blocks
in the device pool; and ``verify(model)``: once per model, a two-row forward over a pooled
prefix must give the logits an uncached forward gives, every attention layer through this
function. Otherwise the call takes the copy path and the log says why, once per reason.

Inside a forward the function falls back, exactly, to a transient full copy and SDPA (one layer
at a time: the gathered prefix is freed when the layer returns) when a call is not plain softmax
attention (softcapping, sinks, a window, dropout, grad) or the mask hides a prefix column from
a query (a mask this module does not know); logged once.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import threading
from dataclasses import dataclass, field

import torch

from cuda_ext.cascade_attention import attend, merge
from hf_patch.layer import PagedLayer
from hf_patch.step_models import unsupported_reason

__all__ = ["NAME", "PagedPlan", "activate", "build_plan", "unusable_reason", "verify"]

logger = logging.getLogger(__name__)

NAME = "radixkv_paged"
OFF = "paged attention is off"  # (not logged: the default)
_ENV = "RADIXKV_PAGED_ATTENTION"

_active: contextvars.ContextVar[PagedPlan | None] = contextvars.ContextVar("radixkv_paged", default=None)
_registered = False
_logged: set[str] = set()
_log_lock = threading.Lock()
_counts = threading.local()  # probe: calls of the function, and of them the paged route


def log_copy_path(reason: str) -> None:
    """The call reads its prefix through a per-row copy: logged once per reason."""
    _log_once(f"attention reads a copy of the cached prefix (not the pool in place): {reason}")


def _log_once(message: str) -> None:
    with _log_lock:
        if message in _logged:
            return
        _logged.add(message)
    logger.warning("radixkv: %s", message)


@dataclass(frozen=True)
class _Span:
    """``length`` tokens from token ``offset`` of a list of blocks: a ``(first, count)`` run of
    consecutive ids (read as a view of the pool) or an int64 index tensor (one index_select)."""

    blocks: tuple[int, int] | torch.Tensor
    offset: int
    length: int

    @staticmethod
    def of(ids: tuple[int, ...], start: int, length: int, block_size: int) -> _Span:
        first, stop = start // block_size, -(-(start + length) // block_size)
        part = ids[first:stop]
        run = part == tuple(range(part[0], part[0] + len(part)))
        blocks = (part[0], len(part)) if run else torch.tensor(part, dtype=torch.int64)
        return _Span(blocks, start - first * block_size, length)

    def read(self, pool: torch.Tensor) -> torch.Tensor:
        """``[1, H, length, D]`` of ``pool`` ``[num_blocks, block_size, H, D]``."""
        if isinstance(self.blocks, tuple):
            first, count = self.blocks
            blocks = pool[first : first + count]
        else:
            blocks = pool.index_select(0, self.blocks.to(pool.device))
        flat = blocks.reshape(-1, pool.shape[2], pool.shape[3])[self.offset : self.offset + self.length]
        return flat.unsqueeze(0).transpose(1, 2)


@dataclass
class PagedPlan:
    """One call's block table, built once per call. Rows whose prefixes start in the same block
    form a cluster: the tokens all their block lists share (``clusters[c]``) are attended once
    for all of them; each row's tokens past those (``tails[r]``) alone. Also per row: its
    cluster (-1: no prefix), whole prefix (``spans``, for the exact fallback) and left pads."""

    cache: object  # the RadixCache whose PagedLayers hold the computed columns
    pool_k: list[torch.Tensor]  # per pool layer [num_blocks, block_size, H, Dk]
    pool_v: list[torch.Tensor]
    pool_layer: dict[int, int]  # model layer index -> pool layer index
    common: int  # the virtual columns every row's layer starts after
    clusters: list[_Span]
    row_cluster: torch.Tensor  # [B] int64
    tails: list[_Span | None]
    spans: list[_Span | None]
    pads: torch.Tensor  # [B] int64
    _members: list[torch.Tensor] = field(default_factory=list)
    _checked: tuple | None = None  # (mask, ok): the last mask whose prefix columns were checked

    def __post_init__(self) -> None:
        self._regroup()

    def _regroup(self) -> None:
        self._members = [torch.nonzero(self.row_cluster == c).flatten() for c in range(len(self.clusters))]
        self._checked = None

    def select(self, indices: torch.Tensor) -> None:
        """Rows become ``indices`` of the current ones (beam reordering, batch selection)."""
        indices = indices.to("cpu", torch.int64)
        self.row_cluster = self.row_cluster[indices]
        self.pads = self.pads[indices]
        picked = indices.tolist()
        self.tails = [self.tails[i] for i in picked]
        self.spans = [self.spans[i] for i in picked]
        self._regroup()

    def repeat(self, repeats: int) -> None:
        self.select(torch.arange(len(self.row_cluster)).repeat_interleave(repeats))

    def read(self, span: _Span, pool_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return span.read(self.pool_k[pool_layer]), span.read(self.pool_v[pool_layer])

    def full(self, pool_layer: int, key: torch.Tensor, value: torch.Tensor):
        """Every row's whole KV ``[B, H, common + own, D]`` (pads zero), for the exact fallback."""
        b = key.shape[0]
        outs = []
        for own in (key, value):
            full = own.new_zeros(b, own.shape[1], self.common + own.shape[2], own.shape[3])
            full[:, :, self.common :] = own
            outs.append(full)
        for r, span in enumerate(self.spans):
            if span is not None:
                pk, pv = self.read(span, pool_layer)
                pad = int(self.pads[r])
                outs[0][r, :, pad : pad + span.length] = pk[0]
                outs[1][r, :, pad : pad + span.length] = pv[0]
        return outs[0], outs[1]

    def prefix_visible(self, mask: torch.Tensor) -> bool:
        """Whether ``mask`` (bool ``[B, 1, q, common + own]``) shows each row's prefix columns to
        all its queries and hides its pad columns: what the paged route assumes."""
        if self._checked is not None and self._checked[0] is mask:
            return self._checked[1]
        cols = torch.arange(self.common, device=mask.device)
        pads = self.pads.to(mask.device)
        expected = (cols.unsqueeze(0) >= pads.unsqueeze(1)).unsqueeze(1).unsqueeze(1)  # [B, 1, 1, common]
        region = mask[..., : self.common]
        ok = bool((region == expected).all()) if region.dtype == torch.bool else False
        self._checked = (mask, ok)
        return ok


def _shared_blocks(lists: list[tuple[int, ...]]) -> int:
    """How many leading blocks every list has in common."""
    first = lists[0]
    n = min(len(x) for x in lists)
    for other in lists[1:]:
        k = 0
        while k < n and other[k] == first[k]:
            k += 1
        n = k
    return n


def build_plan(layout, cache, pool_k, pool_v, block_size: int, rows, pads, common: int) -> PagedPlan:
    """The call's block table. ``rows[i]``: row i's block ids (device pool) covering at least its
    prefix, ``common - pads[i]`` tokens (none when <= 0). O(B x blocks) once per call."""
    bs = block_size
    lengths = [max(0, common - pad) for pad in pads]
    lists = [tuple(ids[: -(-n // bs)]) for ids, n in zip(rows, lengths)]
    by_first: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            by_first.setdefault(lists[i][0], []).append(i)
    row_cluster = torch.full((len(rows),), -1, dtype=torch.int64)
    clusters: list[_Span] = []
    tails: list[_Span | None] = [None] * len(rows)
    spans = [_Span.of(lists[i], 0, n, bs) if n else None for i, n in enumerate(lengths)]
    for members in by_first.values():
        shared = min(_shared_blocks([lists[i] for i in members]) * bs, min(lengths[i] for i in members))
        clusters.append(_Span.of(lists[members[0]], 0, shared, bs))
        for i in members:
            row_cluster[i] = len(clusters) - 1
            if lengths[i] > shared:
                tails[i] = _Span.of(lists[i], shared, lengths[i] - shared, bs)
    return PagedPlan(
        cache=cache,
        pool_k=list(pool_k),
        pool_v=list(pool_v),
        pool_layer={layer: j for j, layer in enumerate(layout.kv_layers)},
        common=common,
        clusters=clusters,
        row_cluster=row_cluster,
        tails=tails,
        spans=spans,
        pads=torch.tensor(list(pads), dtype=torch.int64),
    )


# -- the registered functions ---------------------------------------------------------------------
def _ensure_registered() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(NAME, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)
    _registered = True


def _mask(*args, **kwargs):
    """SDPA's mask, always built (never skipped for ``is_causal``): the prefix columns are
    checked against it and the own columns cut from it."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _plain(module, dropout, query, key, kwargs) -> bool:
    for name in ("softcap", "sliding_window", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            return False
    return (
        dropout == 0.0
        and not module.training
        and getattr(module, "is_causal", True)
        and not (query.requires_grad or key.requires_grad)
        and query.shape[1] % key.shape[1] == 0
    )


# a RunningBatch forward's arguments (hf_patch.ragged_attention): only its function reads them
_RAGGED_KWARGS = frozenset({"radixkv_columns", "radixkv_packed", "radixkv_pool"})


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = getattr(_counts, "calls", None)
    if calls is not None:
        _counts.calls = calls + 1
    plan = _active.get()
    layer_idx = getattr(module, "layer_idx", None)
    layer = None
    if plan is not None and layer_idx is not None and layer_idx < len(plan.cache.layers):
        layer = plan.cache.layers[layer_idx]
    if not isinstance(layer, PagedLayer) or key is not layer.keys:
        if _RAGGED_KWARGS.intersection(kwargs):  # a RunningBatch step (another thread's) whose
            from hf_patch import ragged_attention  # switch this call's activate() replaced: its own

            return ragged_attention._attention(
                module, query, key, value, attention_mask, dropout, scaling, **kwargs
            )
        # not a paged layer's KV (a forward on another cache): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    pool_layer = plan.pool_layer[layer_idx]
    b = key.shape[0]
    mask = attention_mask
    if mask is not None and mask.shape[0] == 1 and b > 1:
        mask = mask.expand(b, *mask.shape[1:])
    if not (_plain(module, dropout, query, key, kwargs) and mask is not None and plan.prefix_visible(mask)):
        _log_once(
            f"paged attention: layer {layer_idx} of {type(module).__name__} reads a full copy of its "
            "prefix (a call with options the paged route lacks, or a mask that hides prefix columns)"
        )
        full_k, full_v = plan.full(pool_layer, key, value)
        return sdpa_attention_forward(
            module, query, full_k, full_v, attention_mask, dropout, scaling, **kwargs
        )
    if getattr(_counts, "calls", None) is not None:
        _counts.paged += 1
    hq, q, d = query.shape[1], query.shape[2], query.shape[3]
    hkv = key.shape[1]
    rep = hq // hkv
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(d)
    # grouped-query heads as more query rows of their KV head: [B, Hkv, rep * q, D]
    packed = query.reshape(b, hkv, rep * q, d)
    own_mask = mask[..., plan.common :]  # [B, 1, q, own]
    own_mask = own_mask.unsqueeze(2).expand(b, 1, rep, q, own_mask.shape[-1]).reshape(b, 1, rep * q, -1)
    additive = torch.zeros(own_mask.shape, dtype=query.dtype, device=query.device)
    additive.masked_fill_(~own_mask, float("-inf"))
    out, lse = attend(packed, key, value, additive, scale)  # [B, Hkv, rep*q, Dv], [B, Hkv, rep*q]
    for c, rows in enumerate(plan._members):
        n = rows.numel()
        if n == 0:
            continue
        pk, pv = plan.read(plan.clusters[c], pool_layer)
        if n == b:  # (every row: no gathers)
            gq = packed.transpose(0, 1).reshape(1, hkv, b * rep * q, d)
        else:
            rows = rows.to(query.device)
            gq = packed.index_select(0, rows).transpose(0, 1).reshape(1, hkv, n * rep * q, d)
        po, pl = attend(gq, pk, pv, None, scale)  # the shared prefix read once for all n rows
        po = po.reshape(hkv, n, rep * q, -1).transpose(0, 1)
        pl = pl.reshape(hkv, n, rep * q).transpose(0, 1)
        if n == b:
            out, lse = merge(po, pl, out, lse)
        else:
            mo, ml = merge(po, pl, out.index_select(0, rows), lse.index_select(0, rows))
            out.index_copy_(0, rows, mo)
            lse.index_copy_(0, rows, ml)
    for r, tail in enumerate(plan.tails):
        if tail is not None:  # the row's prefix tokens past its cluster's shared ones
            tk, tv = plan.read(tail, pool_layer)
            po, pl = attend(packed[r : r + 1], tk, tv, None, scale)
            out[r : r + 1], lse[r : r + 1] = merge(po, pl, out[r : r + 1], lse[r : r + 1])
    out = out.reshape(b, hq, q, -1).transpose(1, 2).contiguous()  # [B, q, Hq, Dv], as SDPA's
    return out, None


_switch_lock = threading.Lock()
_switched: dict[int, list] = {}  # id(config) -> [calls inside, the setting before the first]


@contextlib.contextmanager
def activate(model, plan: PagedPlan):
    """Within: ``model``'s attention is this module's, reading ``plan``'s pool (this thread's
    call). The config's setting is switched while any call of the model is inside (counted:
    concurrent calls from several threads share one switch, restored when the last leaves);
    a forward of another thread that is no paged call meanwhile gets SDPA from the function."""
    _ensure_registered()
    config = model.config
    token = _active.set(plan)
    with _switch_lock:
        entry = _switched.get(id(config))
        if entry is None:
            entry = _switched[id(config)] = [0, config._attn_implementation]
            config._attn_implementation = NAME
        entry[0] += 1
    try:
        yield plan
    finally:
        with _switch_lock:
            entry[0] -= 1
            if entry[0] == 0:
                del _switched[id(config)]
                config._attn_implementation = entry[1]
        _active.reset(token)


# -- where it applies -----------------------------------------------------------------------------
def setting() -> bool | None:
    """``RADIXKV_PAGED_ATTENTION``: ``0`` or unset / ``auto`` (the default): off; ``1``: on."""
    value = os.environ.get(_ENV, "").strip()
    if value in ("", "auto"):
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{_ENV} must be 0, 1 or auto, got {value!r}")
    return value == "1"


def unusable_reason(model, layout, choice: bool | None) -> str | None:
    """Why this call of ``model`` keeps the copy path, or None (the paged path applies).
    ``choice``: ``RadixCache(paged=)``; the env setting counts when it is None."""
    want = setting() if choice is None else choice
    if not want:  # the default: the copy path, bit-exact with stock where paged is ~1e-7 off
        return OFF
    config = model.config
    if model.training:
        return "the model is in training mode"
    impl = config._attn_implementation
    if impl == NAME:  # switched by a call of another thread: the setting underneath
        with _switch_lock:
            entry = _switched.get(id(config))
        impl = entry[1] if entry is not None else impl
    if impl != "sdpa":
        return f"the model's attention is {impl!r}, not 'sdpa'"
    if getattr(config, "sub_configs", None) or (
        hasattr(config, "get_text_config") and config.get_text_config() is not config
    ):
        return "a composite config (its sub-configs hold their own attention setting)"
    reason = unsupported_reason(model)
    if reason is not None:
        return reason
    if layout.stateful or set(layout.kinds) != {"kv"} or layout.index_layers:
        return "layers other than full-attention KV"
    if not verify(model):
        return "the model did not pass the paged-attention probe (logged)"
    return None


def verify(model) -> bool:
    """Once per model (remembered on it): a two-row forward (one row left-padded) over a prefix
    read from a small pool gives the logits an uncached forward gives, and every attention layer
    of the model took the paged route."""
    from hf_patch.ragged_attention import probed_once

    return probed_once(model, "_radixkv_paged_ok", _probe, logger, "paged attention stays off for this model")


@contextlib.contextmanager
def _hooks_suspended(model):
    """The model's own forward hooks off: the probe's forwards are the library's, so a caller's
    hooks (counting or recording forwards) see only the forwards of its own calls."""
    saved = []
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            if hooks:
                saved.append((hooks, dict(hooks)))
                hooks.clear()
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.update(items)


def _probe(model) -> tuple[bool, str | None]:
    with _hooks_suspended(model):
        return _run_probe(model)


def _run_probe(model) -> tuple[bool, str | None]:
    from hf_patch.cache import RadixCache
    from hf_patch.layer import allocate_layers
    from hf_patch.model_spec import model_layout

    layout = model_layout(model)
    config = model.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.get_text_config().vocab_size, (2, 11), generator=g)
    mask = torch.ones((2, 11), dtype=torch.long)
    mask[1, :3] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    device = model.device
    with torch.no_grad():
        want = (
            model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device))
            .logits[:, -3:]
            .float()
        )
        from transformers import DynamicCache

        pre = DynamicCache(config=config)
        common, pads, bs = 8, [0, 3], 4
        model(
            input_ids=ids[:, :common].to(device),
            attention_mask=mask[:, :common].to(device),
            position_ids=positions[:, :common].to(device),
            past_key_values=pre,
        )
        # a pool of 6 blocks: row 0's 8 tokens in blocks 3, 4 (a run); row 1's 5 in blocks 5, 1
        pool_k, pool_v = [], []
        for i in layout.kv_layers:
            k, v = pre.layers[i].keys, pre.layers[i].values
            pk = k.new_zeros(6, bs, k.shape[1], k.shape[3])
            pv = v.new_zeros(6, bs, v.shape[1], v.shape[3])
            for (row, blocks), pad in zip(((0, (3, 4)), (1, (5, 1))), pads):
                toks_k = k[row, :, pad:common].transpose(0, 1)
                toks_v = v[row, :, pad:common].transpose(0, 1)
                for j, blk in enumerate(blocks):
                    part_k, part_v = toks_k[j * bs : (j + 1) * bs], toks_v[j * bs : (j + 1) * bs]
                    pk[blk, : len(part_k)] = part_k
                    pv[blk, : len(part_v)] = part_v
            pool_k.append(pk)
            pool_v.append(pv)
        cache = RadixCache()
        cache.start(layout)
        cache.layers = [PagedLayer() for _ in cache.layers]
        allocate_layers(cache.layers, layout, 2, 8)
        for layer in cache.layers:
            layer.offset = common
        plan = build_plan(layout, cache, pool_k, pool_v, bs, [(3, 4), (5, 1)], pads, common)
        _counts.calls, _counts.paged = 0, 0
        try:
            with activate(model, plan):
                got = model(
                    input_ids=ids[:, common:].to(device),
                    attention_mask=mask.to(device),
                    position_ids=positions[:, common:].to(device),
                    past_key_values=cache,
                ).logits.float()
            calls, paged = _counts.calls, _counts.paged
        finally:
            _counts.calls = None
    layers = len(layout.kv_layers)
    if calls != layers:
        return False, f"{calls} of its {layers} layers called transformers' attention function"
    if paged != layers:
        return False, f"the paged route ran in {paged} of its {layers} layers (options it lacks)"
    if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
        return False, f"its logits differ from an uncached forward's by {(got - want).abs().max().item():.3g}"
    return True, None
