"""RunningBatch: rows that decode together one token per forward, admitted and removed between
steps, their KV kept across steps (a step loop over the model's forward, no generate() per step).

    batch = RunningBatch(model, store, pad_id, eos)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1)
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    slots = batch.admit(kv, ids, mask, first_tokens, prefill_keys(model, cache, ids.shape[0]))
    logits = batch.step()               # [slots, vocab] float32, one forward over [slots, 1]
    batch.set_next(tokens)              # the tokens sampled from those logits, one per slot
    batch.remove([i], commit=True)      # a finished row: its prompt + reply KV into the store
    moved = batch.compact()             # now and then: new slot j holds old slot moved[j]

Layout: every layer's KV is ``[B, kv_heads, W, head_dim]`` over B slots (a slot holds a row or
is free), rows left-padded to the common width W; ``mask`` ``[B, W]`` marks real columns,
``ids`` ``[B, W]`` holds the token of each column (``pad_id`` in padding), and ``pads[i]`` is
slot i's first real column. Real token j of a
row has position j (as generate() numbers a left-padded row), so KV computed for a row alone
(its prefill) is valid at any padding; padding columns hold zeros (finite: NaN * 0 still
poisons attention) and are masked. ``last[i]``: the token sampled for row i and not yet fed
(it has no KV); ``step()`` feeds it.

A row's store key is fixed at admission (``prefill_keys``: the prefill call's namespace,
shared prefix and adapter key parts, hf_patch.keys); a row admitted without one (cache_prompt
off, reuse off, an unkeyable call) is never committed. ``commit`` stores a row's fed tokens
up to its first EOS after its prompt (never padding, never the unfed last token), skipped when
the model's weights changed since admission or the store was flushed meanwhile (epoch).

Only full-attention decoders with 1-D positions (``unsupported_reason(model)`` is None):
sliding windows, M-RoPE and encoder-decoder models need state this layout does not keep. Not
thread-safe: one worker owns a batch. Memory: one ``[B, H, W + headroom, D]`` K and V buffer
per layer; steps append in place, admission and removal write one slot (see the class for
when the whole batch is re-laid out).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from hf_patch import ragged_attention
from hf_patch.cache import RadixCache
from hf_patch.call import key_parts
from hf_patch.keys.adapters import unkeyable_reason
from hf_patch.keys.weights import fingerprint
from hf_patch.layer import AppendLayer
from hf_patch.request import KeyParts

__all__ = ["RowKeys", "RunningBatch", "prefill_keys", "unsupported_reason"]

logger = logging.getLogger(__name__)

HEADROOM = 64  # columns allocated beyond the width at each re-layout (steps append in place)


def unsupported_reason(model) -> str | None:
    """Why ``model`` cannot decode in a RunningBatch, or None: it must be a decoder-only model
    whose layers are all full attention with 1-D rotary or learned positions."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no config"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    layer_types = getattr(text, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return f"layers of types {sorted(set(layer_types))} (only full attention is supported)"
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "a sliding-window attention model"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    inner = getattr(model, "model", None)
    if (isinstance(rope, dict) and ("mrope_section" in rope or rope.get("rope_type") == "mrope")) or any(
        hasattr(m, "get_rope_index") for m in (model, inner) if m is not None
    ):
        return "M-RoPE (3-D positions)"
    if getattr(model, "get_input_embeddings", None) is None:
        return "the model has no input embeddings"
    return None


@dataclass(frozen=True)
class RowKeys:
    """A prefill call's key parts (``keys``: one entry per row of that call) and the store epoch
    and weights fingerprint when its KV was computed."""

    keys: KeyParts
    epoch: int
    weights: int


def prefill_keys(model, cache, rows: int) -> RowKeys | None:
    """The key parts of the ``rows`` rows a prefill generate() just ran on ``cache``, for
    committing their replies later; None when ``cache`` is no RadixCache with a store (then
    nothing is committed) or the call was unkeyable. Call right after that generate()."""
    if not isinstance(cache, RadixCache) or cache.store is None or unkeyable_reason(model) is not None:
        return None
    keys = key_parts(model, cache, torch.Size((rows, 0)), 1)
    return RowKeys(keys, cache.store.epoch, fingerprint(model))


class RunningBatch:
    """The rows decoding now (see the module). ``store``: where ``commit`` writes (None: never).

    Rows live in slots (index i of every tensor): a removed row's slot is masked and reused by
    the next admission (its columns overwritten), so admitting and removing a row copies that
    row only. A full re-layout (one copy of the whole KV) happens only when a newcomer's prompt
    is wider than the batch, when every slot is taken, or in `compact` (many free slots, or
    many leading columns that are padding in every live row)."""

    def __init__(self, model, store=None, pad_id: int = 0, eos: Sequence[int] = ()):
        self.model, self.store, self.pad_id, self.eos = model, store, pad_id, set(eos)
        self.cache: Cache | None = None
        self.ids = torch.zeros((0, 0), dtype=torch.long)
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.live: list[bool] = []  # per slot: a row decodes there
        self.pads: list[int] = []  # per slot: the row's first real column
        self.last: list[int] = []  # per slot: the token to feed next (pad_id in a free slot)
        self.prompt_lengths: list[int] = []  # real tokens of each row's prompt (EOS after it ends it)
        self._keys: list[tuple[RowKeys, int] | None] = []  # (prefill keys, row in that call)

    @property
    def size(self) -> int:
        """Slots (live or free): the batch dimension of a step."""
        return len(self.live)

    @property
    def rows(self) -> list[int]:
        """The live slots."""
        return [i for i, alive in enumerate(self.live) if alive]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def tokens(self, i: int) -> list[int]:
        """Slot i's fed tokens (prompt and reply so far, no padding; ``last[i]`` not included)."""
        return self.ids[i, self.pads[i] :].tolist()

    # -- membership -------------------------------------------------------------------------
    def admit(
        self,
        kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        ids: torch.Tensor,
        mask: torch.Tensor,
        first: Sequence[int],
        keys: RowKeys | None = None,
    ) -> list[int]:
        """Splice in R rows whose prompt KV was just computed: ``kv`` per layer ``(k, v)`` each
        ``[R, H, T, D]`` (a prefill cache's layers, left-padded as ``mask`` ``[R, T]`` says),
        ``ids`` ``[R, T]`` their tokens, ``first`` the token sampled for each (not fed yet).
        ``keys``: the prefill's key parts (``prefill_keys``), None: never committed. Returns
        the slot of each new row (free slots first; live slots keep theirs). Copies ``kv``."""
        rows, length = ids.shape
        if len(kv) != self._num_layers() or len(first) != rows or tuple(mask.shape) != (rows, length):
            raise ValueError(
                f"admit: {len(kv)} layers, {len(first)} first tokens and mask {list(mask.shape)} "
                f"for ids {list(ids.shape)} (the model has {self._num_layers()} layers)"
            )
        if kv and kv[0][0].shape[2] != length:
            raise ValueError(f"admit: KV of {kv[0][0].shape[2]} columns for {length} tokens")
        mask = mask.to("cpu", torch.long)
        real = mask.sum(dim=1)
        expected = torch.arange(length).unsqueeze(0) >= (length - real).unsqueeze(1)
        if not torch.equal(mask.bool(), expected):
            raise ValueError("admit: the mask is not plain left padding")
        free = [i for i, alive in enumerate(self.live) if not alive]
        if self.cache is None or length > self.width or len(free) < rows:
            # one re-layout: wide enough for the newcomers, a slot for each
            grow = max(0, rows - len(free))
            self._relayout(list(range(self.size)), 0, max(self.width, length), self.size + grow, kv)
            free = [i for i, alive in enumerate(self.live) if not alive]
        width = self.width
        slots = free[:rows]
        ids = torch.where(mask.bool(), ids.to("cpu", torch.long), self.pad_id)
        for r, slot in enumerate(slots):
            pad = width - int(real[r])
            for layer, (k, v) in zip(self.cache.layers, kv):
                for buf, src in zip(layer.buffers(), (k, v)):
                    buf[slot, :, :pad] = 0  # padding: finite zeros, masked
                    buf[slot, :, pad:width] = src[r, :, length - int(real[r]) :]
            self.ids[slot] = self.pad_id
            self.ids[slot, width - length :] = ids[r]
            self.mask[slot] = 0
            self.mask[slot, pad:] = 1
            self.live[slot], self.pads[slot], self.last[slot] = True, pad, int(first[r])
            self.prompt_lengths[slot] = int(real[r])
            self._keys[slot] = (keys, r) if keys is not None else None
        return slots

    def remove(self, slots: Sequence[int], commit: bool = True) -> int:
        """Free ``slots`` (committing each row first unless ``commit`` is False); the other rows
        keep their slots. Returns the tokens the commits added to the store."""
        added = 0
        for i in sorted(set(slots)):
            if not 0 <= i < self.size or not self.live[i]:
                raise ValueError(f"remove: slot {i} holds no row")
            if commit:
                added += self.commit(i)
            self.live[i], self.last[i], self._keys[i] = False, self.pad_id, None
            self.mask[i] = 0
            self.ids[i] = self.pad_id
        return added

    def compact(self) -> list[int] | None:
        """Drop free slots and the leading columns that are padding in every live row when that
        saves enough (free slots outnumber live ones, or a quarter of the columns and at least
        64 are padding everywhere): one copy of the live rows' KV. Returns the old slot of each
        new slot, or None when nothing changed (slots stay as they are)."""
        live = self.rows
        if not live:
            if self.cache is not None:
                self.clear()
                return []
            return None
        trim = min(self.pads[i] for i in live)
        sparse = self.size - len(live) > max(2, len(live))
        wide = trim >= max(64, self.width // 4)
        if not (sparse or wide):
            return None
        self._relayout(live, trim, self.width - trim, len(live), None)
        return live

    # -- decoding ---------------------------------------------------------------------------
    def step(self, **model_kwargs) -> torch.Tensor:
        """Feed every slot's ``last`` token: one forward over ``[slots, 1]`` with each row's own
        position and the 2-D mask; returns the next-token logits ``[slots, vocab]`` float32 (a
        free slot's row is meaningless: it attends to its own fed token only)."""
        if not any(self.live):
            raise ValueError("step: the batch has no rows")
        device = self.cache.layers[0].keys.device
        tokens = torch.tensor(self.last, dtype=torch.long).unsqueeze(1)
        positions = self.mask.sum(dim=1, keepdim=True)  # real tokens before this one
        mask = torch.cat([self.mask, torch.ones_like(tokens)], dim=1)
        width = self.width
        starts = [pad if alive else width for pad, alive in zip(self.pads, self.live)]
        with torch.no_grad(), ragged_attention.columns(self.model, starts, width + 1) as ragged:
            out = self.model(
                input_ids=tokens.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
                **model_kwargs,
                **ragged,
            )
        free = torch.tensor([not alive for alive in self.live])
        mask[free, -1] = 0  # a free slot's column stays masked (its fed token was no row's)
        self.ids, self.mask = torch.cat([self.ids, tokens], dim=1), mask
        return out.logits[:, -1, :].to(dtype=torch.float32)

    def set_next(self, tokens: Sequence[int]) -> None:
        """The tokens sampled from the last ``step()``'s logits, one per slot (fed next)."""
        if len(tokens) != self.size:
            raise ValueError(f"set_next: {len(tokens)} tokens for {self.size} slots")
        self.last = [int(t) if alive else self.pad_id for t, alive in zip(tokens, self.live)]

    # -- the store --------------------------------------------------------------------------
    def commit(self, i: int) -> int:
        """Store slot i's fed tokens (prompt + reply, cut after the first EOS of its reply) under
        its key; 0 when it has none, is shorter than a block, or its KV is stale."""
        entry = self._keys[i]
        if entry is None or self.store is None or self.cache is None or not self.live[i]:
            return 0
        keys, row = entry
        if fingerprint(self.model) != keys.weights:
            logger.warning("radixkv: weights changed while a row decoded; its KV is not cached")
            return 0
        pad = self.pads[i]
        ids = self.ids[i, pad:]
        prompt = self.prompt_lengths[i]
        end = len(ids)
        for j, t in enumerate(ids[prompt:].tolist()):
            if t in self.eos:
                end = prompt + j + 1
                break
        key = keys.keys.row(row, ids[:end], 0)
        if key.tokens.num_tokens < self.store.block_size:
            return 0
        layers = self.cache.layers
        return self.store.commit(
            key.tokens,
            [layer.keys[i : i + 1, :, pad : pad + end] for layer in layers],
            [layer.values[i : i + 1, :, pad : pad + end] for layer in layers],
            key.namespace,
            epoch=keys.epoch,
        )

    # -- layout -----------------------------------------------------------------------------
    def _num_layers(self) -> int:
        if self.cache is not None:
            return len(self.cache.layers)
        config = self.model.config
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return config.num_hidden_layers

    def clear(self) -> None:
        """Drop every row and the KV (nothing committed)."""
        self.cache = None
        self.ids = torch.zeros((0, 0), dtype=torch.long)
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.live, self.pads, self.last, self.prompt_lengths, self._keys = [], [], [], [], []

    def _relayout(self, keep: list[int], trim: int, width: int, slots: int, like) -> None:
        """New zeroed buffers of ``slots`` x ``width`` (+ headroom) columns; new slot j holds old
        slot ``keep[j]``'s columns ``trim:`` right-aligned; the rest are free. ``like``: per-layer
        (k, v) to shape the buffers after when the batch has none yet."""
        old_width = self.width
        shift = width - (old_width - trim)  # new column = old column - trim + shift
        source = [(layer.keys, layer.values) for layer in self.cache.layers] if self.cache else like
        index = torch.tensor(keep, dtype=torch.long)
        layers = []
        for k0, v0 in source:
            layer = AppendLayer()
            layer.allocate(
                slots, k0.shape[1], k0.shape[3], v0.shape[3], width + HEADROOM, k0.dtype, k0.device
            )
            for buf, old in zip(layer.buffers(), (k0, v0)):
                buf.zero_()
                if keep and self.cache is not None:
                    buf[: len(keep), :, shift:width] = old[index.to(old.device), :, trim:old_width]
            layer.set_length(width)
            layers.append(layer)
        self.cache = Cache(layers=layers)
        ids = torch.full((slots, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((slots, width), dtype=torch.long)
        if keep:
            ids[: len(keep), shift:] = self.ids[index, trim:]
            mask[: len(keep), shift:] = self.mask[index, trim:]
        self.ids, self.mask = ids, mask
        free = slots - len(keep)
        self.live = [self.live[i] for i in keep] + [False] * free
        self.pads = [self.pads[i] - trim + shift for i in keep] + [width] * free
        self.last = [self.last[i] for i in keep] + [self.pad_id] * free
        self.prompt_lengths = [self.prompt_lengths[i] for i in keep] + [0] * free
        self._keys = [self._keys[i] for i in keep] + [None] * free
