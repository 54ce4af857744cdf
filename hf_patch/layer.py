"""AppendLayer: a cache layer that appends into a preallocated buffer instead of concatenating.

Stock ``DynamicLayer.update`` runs ``torch.cat`` every step: an O(T) copy per token and
layer. This layer keeps ``[B, H, capacity, D]`` buffers, writes new K/V at the end and hands
attention views ``buf[:, :, :length]``. Capacity grows geometrically when exceeded, so the
amortised cost per appended token is O(1). Prefix reuse preloads the first columns straight
from the block pool into the same buffers (one copy, no concatenation afterwards).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

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
        for i, layer in enumerate(layers[: len(specs)]):
            layer.adopt(both[i, 0], both[i, 1])
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


def row_view(layer, row: int, pad: int):
    """A one-row layer over row ``row`` of a batch layer: KV views of its columns from ``pad`` on
    (length 0), state views ``[row:row+1]`` (no previous state). What a forward over that row
    alone writes lands in the batch layer's buffers (no copy afterwards). A layer that holds
    nothing (transformers' DummyLayer) is its own view."""
    if not isinstance(layer, (AppendLayer, StateLayer)):
        return layer
    view = (
        type(layer)(number_of_states=layer.number_of_states)
        if isinstance(layer, StateLayer)
        else AppendLayer()
    )
    if isinstance(layer, AppendLayer) and layer._k_buf is not None:
        k, v = layer.buffers()
        view.adopt(k[row : row + 1, :, pad:], v[row : row + 1, :, pad:])
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
