"""Recurrent state for one call: a row's prefill run in pieces that end where snapshots are wanted,
and the snapshots a decode passes on block boundaries.

A linear-attention / Mamba / conv layer's state summarises the whole prefix: it exists only
where a forward ended. So a row of a stateful model is *caught up* alone, from the deepest
snapshot the store holds for it (``Lease.snap``, at ``Lease.num_tokens``) to its last prompt
token but one, in forwards that end at:

- every multiple of the store's ``snapshot_interval`` (bounds what the next request over the
  same document recomputes: at most one interval);
- the junction, where the store's KV for the row ends (``Lease.kv_tokens``): the point where a
  stored prompt and this one part, so the next request that parts there reuses all of it;
- the prompt's last block boundary (the next chat turn reuses the whole history).

Then generate() feeds the last column of every row at once (left padding aligns the rows'
ends), and each decode step continues from per-row states. ``DecodeSnapshots`` copies a row's
states whenever its length reaches a block boundary, up to its first EOS, so the commit can
attach the deepest one: the reply is reused by the next turn up to its last whole block.

    snapshots = catch_up(model, layout, cache_arg, views, ids, start, stop, cuts)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_patch.layer import AppendLayer, StateLayer, pool_buffers
from hf_patch.model_spec import ModelLayout, accepts

# A model that continues only one token at a time after a snapshot (ModelLayout.continues_in_chunks
# False: Mamba-1 mixers) steps through at most this many tokens; a row further from its snapshot
# is computed again from the start in one forward (a decode step costs about a 64-token forward).
STEPWISE_TOKENS = 64
# Tokens between snapshots when the store names no interval (hf_patch.stores sets one).
DEFAULT_INTERVAL = 256


class RowCache(Cache):
    """A one-row cache over views of a batch cache's row (``hf_patch.layer.row_view``). A model
    without attention layers gets its length from here (transformers asks attention layers)."""

    def __init__(self, layers: list, length: int) -> None:
        super().__init__(layers=layers)
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if any(isinstance(layer, CacheLayerMixin) for layer in self.layers):
            return super().get_seq_length(layer_idx)
        return self.length


def state_views(layers: Sequence, layout: ModelLayout, row: int | None = None) -> list[torch.Tensor]:
    """The state tensors of ``layers`` in ``layout.state_entries`` order: whole ``[B, ...]``
    tensors, or row ``row``'s ``[...]`` views (what a snapshot reads into and is copied from)."""
    out = []
    for layer_idx, part, idx in layout.state_entries:
        t = layers[layer_idx].state_tensors(part)[idx]
        out.append(t if row is None else t[row])
    return out


def cut_points(start: int, stop: int, interval: int, junction: int, block_size: int) -> list[int]:
    """Snapshot positions in ``(start, stop]`` for a row caught up from ``start`` to ``stop``: the
    multiples of ``interval``, the ``junction`` and the last block boundary. ``block_size``: the
    store's, or a multiple of it where the model has a state only there (``snapshot_grain``:
    DeepSeek-V4); the junction is floored to it, ``interval`` must be a multiple of it.

    >>> cut_points(0, 100, 32, 48, 16)
    [32, 48, 64, 96]
    >>> cut_points(32, 47, 32, 32, 16)
    []
    >>> cut_points(0, 100, 0, 80, 16)  # no interval: a model that continues one token at a time
    [80, 96]
    >>> cut_points(0, 100, 32, 48, 32)  # a coarser grain: the junction is floored to it
    [32, 64, 96]
    """
    junction -= junction % block_size
    if not interval:  # every cut past the first is paid a token at a time: the junction only if near
        last = stop // block_size * block_size
        near = [junction] if start < junction < last and last - junction <= STEPWISE_TOKENS else []
        return near + ([last] if last > start else [])
    cuts = set(range((start // interval + 1) * interval, stop + 1, interval))
    if start < junction <= stop:
        cuts.add(junction)
    last = stop // block_size * block_size
    if last > start:
        cuts.add(last)
    return sorted(cuts)


@torch.no_grad()
def catch_up(
    model,
    layout: ModelLayout,
    views: list,
    ids: torch.Tensor,
    start: int,
    stop: int,
    cuts: Iterable[int],
    logits: int = 0,
    mask: torch.Tensor | None = None,
) -> tuple[dict[int, list[torch.Tensor]], torch.Tensor | None]:
    """Run one row's tokens ``ids[start:stop]`` (1-D, on the model's device) through ``model``
    on its row views (their KV and states those of ``ids[:start]``), in forwards that end at each
    of ``cuts``; return the states there (copies, ``layout.state_entries`` order) and, with
    ``logits`` > 0, the last forward's logits of the last ``logits`` positions ``[1, logits, V]``
    (scoring; the caller keeps every cut at or before ``stop - logits``).

    Positions continue from ``start``, as real token j sits at position j in any padded row.
    ``mask``: the row's own 1-D attention mask over ``ids`` (its pads included, as stock computes
    a padded row of a padding-dependent model): masked and positioned as generate() does.
    """
    cache = RowCache(views, start)
    keep = accepts(model, "logits_to_keep")
    snapshots: dict[int, list[torch.Tensor]] = {}
    tail: list[torch.Tensor] = []  # logits of positions [stop - logits, stop), as forwards reach them
    device = ids.device
    cut_set = set(cuts)
    ends = sorted(c for c in cut_set if start < c < stop) + [stop]
    if not layout.continues_in_chunks:  # after the first forward (from the initial state), tokens one by one
        first = ends[0] if start == 0 else start
        ends = ([first] if start == 0 else []) + list(range(first + 1, stop + 1))
    pos = start
    for end in ends:
        if end <= pos:
            continue
        need = max(0, end - max(pos, stop - logits)) if logits else 0
        extra = {"logits_to_keep": need or 1} if keep else {}  # no vocab matmul for the others
        if mask is not None:
            positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # generate()'s position_ids
            inputs = {
                "attention_mask": mask[:end].unsqueeze(0),
                "position_ids": positions[pos:end].unsqueeze(0),
            }
        elif layout.cache_arg == "cache_params":
            # The Mamba families multiply their hidden states by the mask as given: it must be the
            # forward's own length (a full-length one broadcasts the sequence, silently).
            inputs = {"attention_mask": torch.ones(1, end - pos, dtype=torch.long, device=device)}
        else:
            inputs = {
                "attention_mask": torch.ones(1, end, dtype=torch.long, device=device),
                "position_ids": torch.arange(pos, end, device=device).unsqueeze(0),
            }
        result = model(
            input_ids=ids[pos:end].unsqueeze(0),
            use_cache=True,
            **inputs,
            **{layout.cache_arg: cache},
            **extra,
        )
        if need:
            tail.append(result.logits[:, -need:])
        for view in views:
            if isinstance(view, StateLayer):
                view.mark_filled()
        pos = cache.length = end
        if end in cut_set:
            snapshots[end] = [t.clone() for t in state_views(views, layout, 0)]
    return snapshots, torch.cat(tail, dim=1) if tail else None


def mark_row_filled(views: list, length: int) -> None:
    """After preloading ``length`` tokens into row views: KV length set, states continued from."""
    for view in views:
        if isinstance(view, AppendLayer):
            view.set_length(length)
        if isinstance(view, StateLayer):
            view.mark_filled(length > 0)


class DecodeSnapshots:
    """Per-row copies of the states whenever a row's length reaches a block boundary during the
    decode, up to its first EOS (the commit cuts the row there): a forward pre-hook on the model.

    ``lengths[i]``: row i's tokens in the cache before generate()'s first forward. Only the
    deepest copy per row is kept. ``close()`` removes the hook.
    """

    def __init__(
        self, model, cache, layout: ModelLayout, lengths: Sequence[int], block_size: int, eos: Iterable[int]
    ) -> None:
        self.layout = layout
        self.block_size = block_size
        self.lengths = list(lengths)
        self.limits = [None] * len(self.lengths)  # a row's last valid length once its EOS was fed
        self.latest: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self.eos = torch.tensor(sorted(set(eos)), dtype=torch.long)
        self.fed = 0  # tokens generate() fed each row so far
        self._cache = weakref.ref(cache)
        self._handle = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    def _before_forward(self, module, args, kwargs) -> None:
        cache = self._cache()
        if cache is None or kwargs.get(self.layout.cache_arg) is not cache:
            return  # another call's forward on the same model (another thread, another cache)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.dim() != 2 or ids.shape[0] != len(self.lengths):
            return
        bs = self.block_size
        if self.fed:
            states = None
            for i, base in enumerate(self.lengths):
                length = base + self.fed
                limit = self.limits[i]
                if length % bs or (limit is not None and length > limit):
                    continue
                if states is None:
                    states = state_views(cache.layers, self.layout)
                self.latest[i] = (length, [t[i].clone() for t in states])
        if self.eos.numel() and self.fed:  # (the first forward feeds prompt tokens: no EOS of the reply)
            hits = torch.isin(ids.to("cpu"), self.eos)
            for i in torch.nonzero(hits.any(dim=1)).flatten().tolist():
                if self.limits[i] is None:
                    first = int(torch.nonzero(hits[i]).flatten()[0])
                    self.limits[i] = self.lengths[i] + self.fed + first + 1
        self.fed += ids.shape[1]
        cache.consumed += ids.shape[1]

    def close(self) -> None:
        self._handle.remove()


def usable_start(layout: ModelLayout, lease, stop: int) -> int:
    """The tokens of a row ``fill_row`` reads from ``lease`` (0: the row is computed from the start)."""
    # (a snapshot past the row's stop, matched for another keep, is not the state at stop)
    if lease is not None and 0 < lease.num_tokens <= stop:
        if layout.continues_in_chunks or stop - lease.num_tokens <= STEPWISE_TOKENS:
            return lease.num_tokens
    return 0


def fill_row(store, layout: ModelLayout, views: list, lease, stop: int, *, count: bool = True) -> int:
    """Read what ``lease`` serves of one row (at most ``stop`` tokens) into its row ``views``: the
    KV (and indexer keys) from the pool, the states from its snapshot; returns the tokens read, 0
    when computing the row from the start is better (a model that steps one token at a time
    after a snapshot, far from it) or nothing is usable. ``count``: a prompt's hit (not an
    in-batch prefix). The views then continue from there (``mark_row_filled``)."""
    start = usable_start(layout, lease, stop)
    if start:
        ks, vs = pool_buffers(views, layout)
        store.read([lease], start, [k[:, :, :start] for k in ks], [v[:, :, :start] for v in vs], count=count)
        if not store.read_state(lease, state_views(views, layout, 0)):
            start = 0  # no snapshot at a positive usable match: cannot happen; recompute then
    mark_row_filled(views, start)
    if layout.index_positions is not None and start:  # the indexer's position history so far
        view = views[layout.index_positions]
        view.indexer_position_ids = torch.arange(start, device=view.keys.device).expand(3, 1, start)
    return start
