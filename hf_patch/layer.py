"""AppendLayer: a cache layer that appends into a preallocated buffer instead of concatenating
(and the stateful layers built on it: StateLayer, StateAppendLayer, CompressedLayer).

Stock ``DynamicLayer.update`` runs ``torch.cat`` every step: an O(T) copy per token and
layer. This layer keeps ``[B, H, capacity, D]`` buffers, writes new K/V at the end and hands
attention views ``buf[:, :, :length]``. Capacity grows geometrically when exceeded, so the
amortised cost per appended token is O(1). Prefix reuse preloads the first columns straight
from the block pool into the same buffers (one copy, no concatenation afterwards).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionLayer

from radixkv import StateSpec


class AppendLayer(DynamicLayer):
    """Full-attention KV for one layer, ``[batch, kv_heads, seq, head_dim]``, growing in place."""

    is_sliding = False
    is_croppable = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None
        self.length = 0

    # -- buffer management ------------------------------------------------------------------
    def allocate(
        self,
        batch: int,
        num_kv_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Create empty buffers of ``capacity`` tokens (contents undefined until written)."""
        self.adopt(
            torch.empty(batch, num_kv_heads, capacity, k_head_dim, dtype=dtype, device=device),
            torch.empty(batch, num_kv_heads, capacity, v_head_dim, dtype=dtype, device=device),
        )

    def adopt(self, k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """Use ``[B, H, capacity, D]`` buffers (contents undefined until written), length 0.
        They may be views of a bigger tensor (``allocate_stacked``); the layer owns them now."""
        self._k_buf, self._v_buf = k_buf, v_buf
        self.dtype, self.device = k_buf.dtype, k_buf.device
        self.length = 0
        self.is_initialized = True
        self._refresh_views()

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full ``[B, H, capacity, D]`` buffers (for preloading columns in place)."""
        assert self._k_buf is not None and self._v_buf is not None
        return self._k_buf, self._v_buf

    def set_length(self, length: int) -> None:
        """Declare the first ``length`` columns valid (after writing them through ``buffers()``)."""
        assert self._k_buf is not None and 0 <= length <= self._k_buf.shape[2]
        self.length = length
        self._refresh_views()

    def _refresh_views(self) -> None:
        self.keys = self._k_buf[:, :, : self.length]
        self.values = self._v_buf[:, :, : self.length]

    def _ensure_capacity(self, needed: int) -> None:
        capacity = self._k_buf.shape[2]
        if needed <= capacity:
            return
        new_capacity = max(needed, 2 * capacity, 16)
        for name in ("_k_buf", "_v_buf"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], old.shape[1], new_capacity, old.shape[3])
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    # -- CacheLayerMixin API ----------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, q, dk = key_states.shape
        self.allocate(b, h, dk, value_states.shape[3], max(q, 16), key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        end = self.length + q
        self._ensure_capacity(end)
        self._k_buf[:, :, self.length : end] = key_states
        self._v_buf[:, :, self.length : end] = value_states
        self.length = end
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def reset(self) -> None:
        self._k_buf = self._v_buf = None
        self.keys = self.values = None
        self.length = 0
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._refresh_views()

    def _map_batch(self, fn) -> None:
        if self.is_initialized:
            self._k_buf = fn(self._k_buf)
            self._v_buf = fn(self._v_buf)
            self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self) -> None:
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self._k_buf.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))


class PagedLayer(AppendLayer):
    """Full-attention KV of a call whose cached prefix stays in the block pool (issue 41,
    hf_patch.paged_attention): the first ``offset`` columns of every row are virtual (a row's
    prefix, read in place through the call's block table, and its left pads), the buffers hold
    the columns the call computes from there on. ``keys`` / ``values`` (and what ``update``
    returns) are those computed columns ``[B, H, length, D]``; ``get_seq_length`` counts all."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.offset = 0

    def get_seq_length(self) -> int:
        return self.offset + self.length if self.is_initialized else self.offset

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.length + tokens_to_remove < 0:
            raise ValueError("a paged layer cannot be cropped into the prefix it reads from the pool")
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.offset = 0


def allocate_stacked(layers, batch: int, specs, capacity: int) -> None:
    """Give every layer empty buffers of ``capacity`` tokens, per ``specs`` (radixkv.LayerSpec).

    When every layer's K and V share shape and dtype on the CPU, the buffers are slices
    ``[l, 0]`` / ``[l, 1]`` of one ``[layers, 2, batch, heads, capacity, head_dim]`` tensor, so
    the store's CPU copies move all layers at once (cuda_ext.stacking); each layer's views are
    as before. A layer that outgrows its slice moves to a buffer of its own
    (``_ensure_capacity``); the shared one is freed when the last layer has moved, so growing
    past the capacity holds up to 1.5x the grown KV for that step (per-layer buffers: ~1x).
    Elsewhere (CUDA: one kernel launch moves all layers already) one buffer per layer.
    """
    first = specs[0]
    shape = (first.num_kv_heads, first.k_head_dim, first.k_head_dim, first.dtype, first.device)
    if first.device.type == "cpu" and all(
        (s.num_kv_heads, s.k_head_dim, s.v_head_dim, s.dtype, s.device) == shape for s in specs
    ):
        both = torch.empty(
            len(specs), 2, batch, first.num_kv_heads, capacity, first.k_head_dim,
            dtype=first.dtype, device=first.device,
        )  # fmt: skip
        for layer, pair in zip(layers[: len(specs)], both.unbind(0)):  # 1 view op a layer, not 4
            layer.adopt(*pair.unbind(0))
        return
    for layer, s in zip(layers, specs):
        layer.allocate(batch, s.num_kv_heads, s.k_head_dim, s.v_head_dim, capacity, s.dtype, s.device)


class StateLayer(LinearAttentionLayer):
    """A linear-attention / Mamba / conv layer's states, ``[batch, ...]`` tensors allocated up
    front (``allocate``) so a snapshot read from the store lands in them and the model's own
    ``update_conv_state`` / ``update_recurrent_state`` copy into them in place."""

    def allocate_states(self, batch: int, entries: Sequence[tuple[str, int, StateSpec]]) -> None:
        """Zeroed states ``[batch, *spec.shape]`` for each ``(part, state index, spec)`` of this
        layer (part ``"conv"`` or ``"recurrent"``); no previous state until ``mark_filled``.
        (Not ``allocate``: a StateAppendLayer's KV buffers are ``AppendLayer.allocate``'s.)"""
        for part, idx, spec in entries:
            t = torch.zeros(batch, *spec.shape, dtype=spec.dtype, device=spec.device)
            if part == "conv":
                self.conv_states[idx] = t
                self.is_conv_states_initialized[idx] = True
                self.conv_kernel_size[idx] = spec.shape[-1]
            else:
                self.recurrent_states[idx] = t
                self.is_recurrent_states_initialized[idx] = True
            self.dtype, self.device = spec.dtype, spec.device

    def mark_filled(self, filled: bool = True) -> None:
        """Declare the states those of the tokens so far (the model then continues from them)."""
        for idx in range(self.number_of_states):
            self.has_previous_state[idx] = filled

    def state_tensors(self, part: str) -> dict[int, torch.Tensor | None]:
        return self.conv_states if part == "conv" else self.recurrent_states

    def batch_repeat_interleave(self, repeats: int) -> None:
        for states in (self.conv_states, self.recurrent_states):
            for idx, t in states.items():
                if t is not None:
                    states[idx] = t.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for states in (self.conv_states, self.recurrent_states):
            for idx, t in states.items():
                if t is not None:
                    states[idx] = t[indices]


class StateAppendLayer(StateLayer, AppendLayer):
    """Both in one layer (Falcon-H1, Zamba): recurrent states and full-attention KV growing in
    place. Dispatches ``lazy_initialization`` as transformers' LinearAttentionAndFullAttentionLayer
    does: two positional tensors are K and V."""

    is_compileable = False

    def __init__(self, number_of_states: int = 1, **kwargs) -> None:
        AppendLayer.__init__(self)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:
            AppendLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        AppendLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        AppendLayer.reorder_cache(self, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        StateLayer.batch_repeat_interleave(self, repeats)
        AppendLayer.batch_repeat_interleave(self, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        StateLayer.batch_select_indices(self, indices)
        AppendLayer.batch_select_indices(self, indices)

    def offload(self) -> None:
        LinearAttentionLayer.offload(self)
        AppendLayer.offload(self)

    def prefetch(self) -> None:
        LinearAttentionLayer.prefetch(self)
        AppendLayer.prefetch(self)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a layer with recurrent state cannot be cropped back to an earlier token")

    def get_max_length(self) -> int:
        return -1


class CompressedLayer(AppendLayer):
    """A DeepSeek-V4 attention layer's cache (stock: ``DeepseekV4HCACache`` / ``DeepseekV4CSACache``,
    or ``DynamicSlidingWindowLayer`` for a sliding-only layer), laid out for the store.

    Per row, as stock keeps them: the sliding window, the last ``window - 1`` K=V keys ``[B, 1,
    window - 1, head_dim]`` (the newest last, zeros before the first), which ``update`` extends
    with the new tokens for attention, and ``get_mask_sizes`` sized to match; per compressor
    (``model_spec.CompressorSpec``) the open window's kv and gate projections ``[B, rate,
    proj_dim]`` (``fill`` tokens of them) and, CSA, the overlap ``[B, rate, overlap_dim]`` kv and
    gate. The window and the overlaps are the snapshot (``state_tensors``); at a window boundary
    the open windows are empty.

    Per token, for the block pool: the compressed entries. Entry w of a compressor lies in the
    columns of its window's tokens ``[w * rate, (w + 1) * rate)``, ``share`` values each from
    ``offset`` of a ``width``-wide packed vector, zeros where no entry lies; the pool keeps two
    tensors per layer, so the vector's first ``k_width`` values are this layer's K buffer
    ``[B, 1, capacity, k_width]`` and the rest its V buffer. The entries are also kept unpacked
    ``[B, count, entry_dim]`` for the model (rebuilt from the buffers after a preload). A
    sliding-only layer has no per-token part (``width`` 0, no buffers). A window lies within one
    block: the store's block size is a multiple of every rate (``hf_patch.stores.build_store``).
    Cost per forward of q tokens: stock's (a ``window + q`` concatenation; a closing window
    concatenates the entries), plus writing the new entries into the buffers.
    """

    is_sliding = True
    is_croppable = False
    is_compileable = False

    def __init__(
        self, compressors: Sequence = (), window: int = 2, window_spec: StateSpec | None = None
    ) -> None:
        super().__init__()
        self.compressors = {c.name: c for c in compressors}
        self.sliding_window = window
        self.window_spec = window_spec  # (1, window - 1, head_dim): one row's window
        total = sum(c.share for c in compressors)
        self.width = max(2, total) if total else 0
        self.k_width = (self.width + 1) // 2
        self.count = dict.fromkeys(self.compressors, 0)  # entries emitted, per compressor
        self.fill = dict.fromkeys(self.compressors, 0)  # tokens of its open window
        self.window_k: torch.Tensor | None = None
        self.buffer_kv: dict[str, torch.Tensor] = {}
        self.buffer_gate: dict[str, torch.Tensor] = {}
        self.overlap_kv: dict[str, torch.Tensor] = {}
        self.overlap_gate: dict[str, torch.Tensor] = {}
        self._entries: dict[str, torch.Tensor] = {}

    # -- allocation and per-row views ------------------------------------------------------------
    def allocate_states(self, batch: int, entries: Sequence = ()) -> None:
        """Zeroed per-row tensors: the window, and per compressor its open window (and overlap).
        (``entries``, the layout's state entries of this layer, are the window and overlaps.)"""
        spec = self.window_spec
        self.window_k = torch.zeros(batch, *spec.shape, dtype=spec.dtype, device=spec.device)
        for c in self.compressors.values():
            for store in (self.buffer_kv, self.buffer_gate):
                store[c.name] = torch.zeros(batch, c.rate, c.proj_dim, dtype=c.dtype, device=c.device)
            if c.overlap_dim:
                for store in (self.overlap_kv, self.overlap_gate):
                    store[c.name] = torch.zeros(batch, c.rate, c.overlap_dim, dtype=c.dtype, device=c.device)
        self.is_initialized = True

    def state_tensors(self, part: str) -> dict[int, torch.Tensor]:
        """``"window"``: ``{0: [B, 1, window - 1, head_dim]}``; ``"overlap"``: each CSA compressor's
        overlap kv then gate, ``[B, rate, overlap_dim]``."""
        if part == "window":
            return {0: self.window_k}
        assert part == "overlap", part
        out = []
        for name in self.overlap_kv:
            out += [self.overlap_kv[name], self.overlap_gate[name]]
        return dict(enumerate(out))

    def row_tensors(self) -> list[torch.Tensor]:
        """Every per-row tensor but the per-token buffers (``[B, ...]``)."""
        return [
            self.window_k, *self.buffer_kv.values(), *self.buffer_gate.values(),
            *self.state_tensors("overlap").values(),
        ]  # fmt: skip

    def row_view(self, row: int, first: int) -> CompressedLayer:
        """A one-row layer over row ``row``, its per-token buffers from column ``first`` (length 0,
        no entries): what its forwards write lands in this layer's tensors."""
        view = CompressedLayer(tuple(self.compressors.values()), self.sliding_window, self.window_spec)
        if self._k_buf is not None:
            k, v = self.buffers()
            view.adopt(k[row : row + 1, :, first:], v[row : row + 1, :, first:])
        view.window_k = self.window_k[row : row + 1]
        for mine, theirs in ((self.buffer_kv, view.buffer_kv), (self.buffer_gate, view.buffer_gate),
                             (self.overlap_kv, view.overlap_kv), (self.overlap_gate, view.overlap_gate)):  # fmt: skip
            for name, t in mine.items():
                theirs[name] = t[row : row + 1]
        view.is_initialized = True
        return view

    def set_length(self, length: int) -> None:
        """The first ``length`` tokens valid: window, entries, the open windows' projections and
        overlaps written (a row's tokens counted from its view's first column); each compressor
        has emitted ``length // rate`` entries and holds ``length % rate`` tokens."""
        if self._k_buf is not None:
            super().set_length(length)
        self.length = length
        for c in self.compressors.values():
            self.count[c.name], self.fill[c.name] = divmod(length, c.rate)
        self._entries.clear()

    def get_seq_length(self) -> int:
        return self.length

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Without a preload (a call run as with a plain cache): allocate for this batch."""
        b, q = key_states.shape[0], key_states.shape[2]
        if self.window_k is None:
            self.allocate_states(b)
        if self.width:
            k, w = self.k_width, self.width
            self.allocate(b, 1, k, w - k, max(q, 16), key_states.dtype, key_states.device)

    # -- what the model calls ----------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Stock's: the window's keys then the new K=V keys ``[B, 1, q, head_dim]`` (``value_states``
        is the same tensor) for attention; the window moves on by ``q``."""
        if self.window_k is None or (self.width and self._k_buf is None):
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[2]
        if self.width:
            self._ensure_capacity(end)
            for buf in (self._k_buf, self._v_buf):
                buf[:, :, start:end].zero_()  # entries land here once their windows close
        size = self.window_k.shape[2]
        held = min(start, size)
        full = torch.cat([self.window_k[:, :, size - held :], key_states], dim=2)
        keep = min(full.shape[2], size)
        self.window_k[:, :, size - keep :] = full[:, :, full.shape[2] - keep :]
        self.length = end
        if self._k_buf is not None:
            self._refresh_views()
        return full, full

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """DynamicSlidingWindowLayer's: the keys ``update`` hands attention."""
        kv_offset = max(self.length - self.sliding_window + 1, 0)
        full = self.length >= self.sliding_window
        return (self.sliding_window - 1 if full else self.length) + query_length, kv_offset

    def store_compression_weights(self, name: str, kv: torch.Tensor, gate: torch.Tensor):
        """Stock's: the open window's tokens then ``kv`` / ``gate`` ``[B, n, proj_dim]``; return the
        whole windows among them and the first one's position; keep the rest as the open window."""
        c = self.compressors[name]
        first_window_position = self.count[name] * c.rate
        n = self.fill[name]
        if n:
            kv = torch.cat([self.buffer_kv[name][:, :n], kv], dim=1)
            gate = torch.cat([self.buffer_gate[name][:, :n], gate], dim=1)
        usable = kv.shape[1] // c.rate * c.rate
        rest = kv.shape[1] - usable
        self.buffer_kv[name][:, :rest] = kv[:, usable:]
        self.buffer_gate[name][:, :rest] = gate[:, usable:]
        self.fill[name] = rest
        return kv[:, :usable], gate[:, :usable], first_window_position

    def update_overlap_state(
        self, name: str, chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Stock's (CSA): the previous window's overlap slices (None before a first window closed),
        and this forward's last window's ``[B, rate, head_dim]`` kv / gate saved in their place."""
        prior = (None, None)
        if self.count[name]:
            prior = (self.overlap_kv[name].clone(), self.overlap_gate[name].clone())
        self.overlap_kv[name].copy_(chunk_kv[:, -1, :, :head_dim])
        self.overlap_gate[name].copy_(chunk_gate[:, -1, :, :head_dim])
        return prior

    def update_compressor_states(self, name: str, compressed: torch.Tensor) -> torch.Tensor:
        """Append new entries ``[B, n, entry_dim]`` (packed into the buffers too); return all."""
        c = self.compressors[name]
        before, new = self.count[name], compressed.shape[1]
        if new == 0:
            return self._unpacked(c) if before else compressed
        b = compressed.shape[0]
        packed = F.pad(compressed, (0, c.share * c.rate - c.entry_dim)).reshape(b, new * c.rate, c.share)
        self._write(slice(before * c.rate, (before + new) * c.rate), c.offset, packed)
        entries = torch.cat([self._unpacked(c), compressed], dim=1) if before else compressed
        self.count[name] = before + new
        self._entries[name] = entries
        return entries

    def _write(self, cols: slice, lo: int, values: torch.Tensor) -> None:
        """Packed values ``[B, n, m]`` into columns ``cols``, packed positions ``[lo, lo + m)``."""
        k, hi = self.k_width, lo + values.shape[-1]
        if lo < k:
            self._k_buf[:, 0, cols, lo : min(hi, k)] = values[..., : min(hi, k) - lo]
        if hi > k:
            self._v_buf[:, 0, cols, max(lo, k) - k : hi - k] = values[..., max(lo, k) - lo :]

    def _unpacked(self, c) -> torch.Tensor:
        """Compressor ``c``'s ``count`` entries ``[B, count, entry_dim]`` (from the buffers once per
        preload)."""
        entries = self._entries.get(c.name)
        count = self.count[c.name]
        if entries is None or entries.shape[1] != count:
            k, lo, hi, cols = self.k_width, c.offset, c.offset + c.share, slice(0, count * c.rate)
            parts = []
            if lo < k:
                parts.append(self._k_buf[:, 0, cols, lo : min(hi, k)])
            if hi > k:
                parts.append(self._v_buf[:, 0, cols, max(lo, k) - k : hi - k])
            packed = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
            b = packed.shape[0]
            entries = packed.reshape(b, count, c.rate * c.share)[..., : c.entry_dim].contiguous()
            self._entries[c.name] = entries
        return entries

    # -- batch bookkeeping -------------------------------------------------------------------------
    def _map_batch(self, fn) -> None:
        if self._k_buf is not None:
            super()._map_batch(fn)
        if self.window_k is not None:
            self.window_k = fn(self.window_k)
        for store in (self.buffer_kv, self.buffer_gate, self.overlap_kv, self.overlap_gate, self._entries):
            for name, t in store.items():
                store[name] = fn(t)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a DeepSeek-V4 compressed layer cannot be cropped back to an earlier token")

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self.window_k = None
        for store in (self.buffer_kv, self.buffer_gate, self.overlap_kv, self.overlap_gate, self._entries):
            store.clear()
        self.count = dict.fromkeys(self.compressors, 0)
        self.fill = dict.fromkeys(self.compressors, 0)


def row_view(layer, row: int, pad: int):
    """A one-row layer over row ``row`` of a batch layer: KV views of its columns from ``pad`` on
    (length 0), state views ``[row:row+1]`` (no previous state). What a forward over that row
    alone writes lands in the batch layer's buffers (no copy afterwards). A layer that holds
    nothing (transformers' DummyLayer) is its own view."""
    if isinstance(layer, CompressedLayer):
        return layer.row_view(row, pad)
    if not isinstance(layer, (AppendLayer, StateLayer)):
        return layer
    if isinstance(layer, StateLayer):
        view = type(layer)(number_of_states=layer.number_of_states)
    else:
        view = type(layer)()
    if isinstance(layer, AppendLayer) and layer._k_buf is not None:
        k, v = layer.buffers()
        view.adopt(k[row : row + 1, :, pad:], v[row : row + 1, :, pad:])
    if isinstance(layer, IndexedAppendLayer) and layer._index_buf is not None:
        view._index_buf = layer._index_buf[row : row + 1, pad:]
        view.is_indexer_initialized = True
        view._refresh_index()
    if isinstance(layer, StateLayer):
        for states, ready in ((layer.conv_states, layer.is_conv_states_initialized),
                              (layer.recurrent_states, layer.is_recurrent_states_initialized)):  # fmt: skip
            target = view.conv_states if states is layer.conv_states else view.recurrent_states
            flags = (
                view.is_conv_states_initialized
                if states is layer.conv_states
                else view.is_recurrent_states_initialized
            )
            for idx, t in states.items():
                if t is not None:
                    target[idx] = t[row : row + 1]
                    flags[idx] = ready[idx]
        view.conv_kernel_size = dict(layer.conv_kernel_size)
        view.dtype, view.device = layer.dtype, layer.device
    return view


class IndexedAppendLayer(AppendLayer):
    """Full-attention KV plus a sparse-attention indexer's keys (DeepSeek-V3.2's DSA and its kin:
    transformers' DynamicIndexedLayer): ``[batch, capacity, index_head_dim]``, growing in place
    like the KV. The store keeps them as one more pool layer of one head, the key dims split
    in two halves as its K and V (``index_halves``), so they page exactly like KV."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._index_buf: torch.Tensor | None = None
        self.index_length = 0
        self.indexer_keys: torch.Tensor | None = None
        self.indexer_position_ids: torch.Tensor | None = None  # Qwen4-Exp keeps [3, B, T] here
        self.is_indexer_initialized = False

    def allocate_index(self, batch: int, dim: int, capacity: int, dtype, device) -> None:
        self._index_buf = torch.empty(batch, capacity, dim, dtype=dtype, device=device)
        self.index_length = 0
        self.is_indexer_initialized = True
        self._refresh_index()

    def _refresh_index(self) -> None:
        self.indexer_keys = self._index_buf[:, : self.index_length]

    def index_halves(self, full: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer keys as a pool layer's K and V: ``[B, 1, capacity (or length), dim // 2 + rest]``."""
        buf = self._index_buf if full else self._index_buf[:, : self.index_length]
        split = -(-buf.shape[-1] // 2)
        view = buf.unsqueeze(1)
        return view[..., :split], view[..., split:]

    def set_length(self, length: int) -> None:
        super().set_length(length)
        if self._index_buf is not None:
            self.index_length = length
            self._refresh_index()

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        b, q, d = indexer_key_states.shape
        if self._index_buf is None:
            self.allocate_index(b, d, max(q, 16), indexer_key_states.dtype, indexer_key_states.device)
        end = self.index_length + q
        if end > self._index_buf.shape[1]:
            new = self._index_buf.new_empty(b, max(end, 2 * self._index_buf.shape[1]), d)
            new[:, : self.index_length] = self._index_buf[:, : self.index_length]
            self._index_buf = new
        self._index_buf[:, self.index_length : end] = indexer_key_states
        self.index_length = end
        self._refresh_index()
        return self.indexer_keys

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        if self._index_buf is not None:
            self._index_buf = fn(self._index_buf)
            self._refresh_index()
        if self.indexer_position_ids is not None:
            self.indexer_position_ids = fn(self.indexer_position_ids.transpose(0, 1)).transpose(0, 1)

    def reset(self) -> None:
        super().reset()
        self._index_buf = self.indexer_keys = self.indexer_position_ids = None
        self.index_length = 0
        self.is_indexer_initialized = False


def pool_buffers(layers: Sequence, layout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every pool layer's whole ``[B, H, capacity, D]`` K and V buffers, in the pool's order
    (``ModelLayout``: the KV layers, then the indexer keys' halves)."""
    ks, vs = [], []
    for i in layout.kv_layers:
        k, v = layers[i].buffers()
        ks.append(k)
        vs.append(v)
    for i in layout.index_layers:
        k, v = layers[i].index_halves()
        ks.append(k)
        vs.append(v)
    return ks, vs


def pool_tensors(layers: Sequence, layout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """As ``pool_buffers``, the filled columns only (``[B, H, length, D]``: what a commit copies)."""
    ks = [layers[i].keys for i in layout.kv_layers]
    vs = [layers[i].values for i in layout.kv_layers]
    for i in layout.index_layers:
        k, v = layers[i].index_halves(full=False)
        ks.append(k)
        vs.append(v)
    return ks, vs


def make_layers(layout) -> list:
    """One empty cache layer per model layer, of the kind ``layout`` (hf_patch.model_spec.ModelLayout)
    says the model keeps there: KV (with indexer keys where it has them), states, both, or nothing."""
    states: dict[int, int] = {}
    windows: dict[int, StateSpec] = {}
    for (layer_idx, part, idx), spec in zip(layout.state_entries, layout.state_specs):
        states[layer_idx] = max(states.get(layer_idx, 0), idx + 1)
        if part == "window":
            windows[layer_idx] = spec
    indexed = set(layout.index_layers)
    out = []
    for i, kind in enumerate(layout.kinds):
        if kind == "kv":
            out.append(IndexedAppendLayer() if i in indexed else AppendLayer())
        elif kind == "state":
            out.append(StateLayer(number_of_states=states[i]))
        elif kind == "kv+state":
            out.append(StateAppendLayer(number_of_states=states[i]))
        elif kind == "compressed":  # DeepSeek-V4
            out.append(CompressedLayer(layout.compressors[i], layout.sliding_window, windows[i]))
        else:
            out.append(DummyLayer())
    return out


def allocate_layers(layers: Sequence, layout, batch: int, capacity: int) -> None:
    """Empty buffers of ``capacity`` tokens for every KV and indexer layer, zeroed states
    ``[batch, ...]`` for every state layer (``make_layers``' layers)."""
    kv_specs = layout.specs[: len(layout.kv_layers)]
    if kv_specs:
        allocate_stacked([layers[i] for i in layout.kv_layers], batch, kv_specs, capacity)
    for i, spec in zip(layout.index_layers, layout.specs[len(layout.kv_layers) :]):
        layers[i].allocate_index(batch, spec.k_head_dim + spec.v_head_dim, capacity, spec.dtype, spec.device)
    per_layer: dict[int, list] = {}
    for (layer_idx, part, idx), spec in zip(layout.state_entries, layout.state_specs):
        per_layer.setdefault(layer_idx, []).append((part, idx, spec))
    for layer_idx, entries in per_layer.items():
        layers[layer_idx].allocate_states(batch, entries)
