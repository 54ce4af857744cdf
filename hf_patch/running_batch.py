"""RunningBatch: rows that decode together one token per forward, admitted and removed between
steps, their KV kept across steps (a step loop over the model's forward, no generate() per step).

    batch = RunningBatch(model, store)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1)
    batch.admit(cache, ids, mask, first_tokens, keys=prefill_keys(model, cache, ids.shape[0]))
    logits = batch.step()               # [B, vocab] float32, one forward over [B, 1]
    batch.set_next(tokens)              # the tokens sampled from those logits
    batch.remove([i], commit=True)      # a finished row: its prompt + reply KV into the store

Layout: every layer's KV is ``[B, kv_heads, W, head_dim]``, rows left-padded to the common
width W; ``mask`` ``[B, W]`` marks real columns, ``ids`` ``[B, W]`` holds the token of each
column (``pad_id`` in padding), and ``pads[i]`` is row i's first real column. Real token j of a
row has position j (as generate() numbers a left-padded row), so KV computed for a row alone
(its prefill) is valid at any padding; padding columns hold zeros (finite: NaN * 0 still
poisons attention) and are masked. ``last[i]``: the token sampled for row i and not yet fed
(it has no KV); ``step()`` feeds it.

A row's store key is fixed at admission (``prefill_keys``: the prefill call's namespace,
shared prefix and adapter key parts, hf_patch.keys); a row admitted without one (cache_prompt
off, reuse off, an unkeyable call) is never committed. ``commit`` stores a row's fed tokens
up to its first EOS after its prompt (never padding, never the unfed last token), skipped when
the model's weights changed since admission or the store was flushed meanwhile (epoch).

Only full-attention decoders with 1-D positions (``supported(model)``): sliding windows,
M-RoPE and encoder-decoder models need state this layout does not keep. Not thread-safe: one
worker owns a batch. Memory: one ``[B, H, W + headroom, D]`` K and V buffer per layer;
admission and removal re-lay them out (one copy each), steps append in place.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

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
    if isinstance(rope, dict) and ("mrope_section" in rope or rope.get("rope_type") == "mrope"):
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
    """The rows decoding now (see the module). ``store``: where ``commit`` writes (None: never)."""

    def __init__(self, model, store=None, pad_id: int = 0, eos: Sequence[int] = ()):
        self.model, self.store, self.pad_id, self.eos = model, store, pad_id, set(eos)
        self.cache: Cache | None = None
        self.ids = torch.zeros((0, 0), dtype=torch.long)
        self.mask = torch.zeros((0, 0), dtype=torch.long)
        self.pads: list[int] = []
        self.last: list[int] = []
        self.prompt_lengths: list[int] = []  # real tokens of each row's prompt (EOS after it ends it)
        self._keys: list[tuple[RowKeys, int] | None] = []  # (prefill keys, row in that call)

    @property
    def size(self) -> int:
        return len(self.pads)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    def tokens(self, i: int) -> list[int]:
        """Row i's fed tokens (prompt and reply so far, no padding; ``last[i]`` not included)."""
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
        the new rows' indices (appended after the running ones). Copies ``kv``."""
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
        old_width, width = self.width, max(self.width, length)
        old = self.size
        start = old
        kv_old = [(layer.keys, layer.values) for layer in self.cache.layers] if self.cache else None
        self._relayout(
            old + rows,
            width,
            [(kv_old, slice(0, old), width - old_width, slice(0, old_width))] if old else [],
            (kv, width - length),
        )
        for r, p in enumerate((length - real).tolist()):  # the prefill's own padding: zeros
            for layer in self.cache.layers if p else ():
                for buf in layer.buffers():
                    buf[old + r, :, width - length : width - length + p] = 0
        shift = width - old_width
        new_ids = torch.full((old + rows, width), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros((old + rows, width), dtype=torch.long)
        new_ids[:old, shift:] = self.ids
        new_mask[:old, shift:] = self.mask
        new_ids[old:, width - length :] = torch.where(mask.bool(), ids.to("cpu", torch.long), self.pad_id)
        new_mask[old:, width - length :] = mask
        self.ids, self.mask = new_ids, new_mask
        self.pads = [p + shift for p in self.pads] + (width - real).tolist()
        self.last += [int(t) for t in first]
        self.prompt_lengths += real.tolist()
        self._keys += [(keys, r) if keys is not None else None for r in range(rows)]
        return list(range(start, old + rows))

    def remove(self, rows: Sequence[int], commit: bool = True) -> int:
        """Remove ``rows`` (committing each first unless ``commit`` is False); the rest keep
        their order. Columns that became padding in every row are dropped. Returns the tokens
        the commits added to the store."""
        drop = set(rows)
        added = sum(self.commit(i) for i in sorted(drop)) if commit else 0
        keep = [i for i in range(self.size) if i not in drop]
        if not keep:
            self.cache, self.pads, self.last, self.prompt_lengths, self._keys = None, [], [], [], []
            self.ids = torch.zeros((0, 0), dtype=torch.long)
            self.mask = torch.zeros((0, 0), dtype=torch.long)
            return added
        trim = min(self.pads[i] for i in keep)
        index = torch.tensor(keep, dtype=torch.long)
        kv_old = [(layer.keys, layer.values) for layer in self.cache.layers]
        width = self.width - trim
        self._relayout(len(keep), width, [(kv_old, index, 0, slice(trim, self.width))], None)
        self.ids, self.mask = self.ids[index, trim:], self.mask[index, trim:]
        self.pads = [self.pads[i] - trim for i in keep]
        self.last = [self.last[i] for i in keep]
        self.prompt_lengths = [self.prompt_lengths[i] for i in keep]
        self._keys = [self._keys[i] for i in keep]
        return added

    # -- decoding ---------------------------------------------------------------------------
    def step(self, **model_kwargs) -> torch.Tensor:
        """Feed every row's ``last`` token: one forward over ``[B, 1]`` with each row's own
        position and the 2-D mask; returns the next-token logits ``[B, vocab]`` float32."""
        if not self.size:
            raise ValueError("step: the batch has no rows")
        device = self.cache.layers[0].keys.device
        tokens = torch.tensor(self.last, dtype=torch.long).unsqueeze(1)
        positions = self.mask.sum(dim=1, keepdim=True)  # real tokens before this one
        mask = torch.cat([self.mask, torch.ones_like(tokens)], dim=1)
        with torch.no_grad():
            out = self.model(
                input_ids=tokens.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=1,
                **model_kwargs,
            )
        self.ids, self.mask = torch.cat([self.ids, tokens], dim=1), mask
        return out.logits[:, -1, :].to(dtype=torch.float32)

    def set_next(self, tokens: Sequence[int]) -> None:
        """The tokens sampled from the last ``step()``'s logits (fed by the next step)."""
        if len(tokens) != self.size:
            raise ValueError(f"set_next: {len(tokens)} tokens for {self.size} rows")
        self.last = [int(t) for t in tokens]

    # -- the store --------------------------------------------------------------------------
    def commit(self, i: int) -> int:
        """Store row i's fed tokens (prompt + reply, cut after the first EOS of its reply) under
        its key; 0 when it has none, is shorter than a block, or its KV is stale."""
        entry = self._keys[i]
        if entry is None or self.store is None or self.cache is None:
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

    def _relayout(self, rows: int, width: int, olds: list, new) -> None:
        """New zeroed layer buffers of ``rows`` x ``width`` (+ headroom) columns, filled from
        ``olds`` [(per-layer (k, v), row index, column offset, column slice)] placed at the first
        rows, then ``new`` ((per-layer (k, v)), column offset) at the last rows."""
        source = olds[0][0] if olds else new[0]
        layers = []
        for layer_index, (k0, v0) in enumerate(source):
            layer = AppendLayer()
            layer.allocate(rows, k0.shape[1], k0.shape[3], v0.shape[3], width + HEADROOM, k0.dtype, k0.device)
            kb, vb = layer.buffers()
            kb.zero_()
            vb.zero_()
            at = 0
            for kv, index, offset, cols in olds:
                k, v = kv[layer_index]
                k, v = k[index][:, :, cols], v[index][:, :, cols]
                kb[at : at + k.shape[0], :, offset : offset + k.shape[2]] = k
                vb[at : at + v.shape[0], :, offset : offset + v.shape[2]] = v
                at += k.shape[0]
            if new is not None:
                k, v = new[0][layer_index]
                offset = new[1]
                kb[at : at + k.shape[0], :, offset : offset + k.shape[2]] = k
                vb[at : at + v.shape[0], :, offset : offset + v.shape[2]] = v
            layer.set_length(width)
            layers.append(layer)
        self.cache = Cache(layers=layers)
