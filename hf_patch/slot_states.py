"""SlotStates: the recurrent / conv states of a RunningBatch's slots (models whose layout is
attention KV plus state: ``ModelLayout.stateful``), and the snapshots its rows pass on the way.

    states = SlotStates(layout, block_size, eos)
    states.allocate(layers, slots, old_layers, keep)  # at each re-layout: new slot j = old keep[j]
    states.admit(layers, slot, rows, r, length)       # row r of a prefill's states [R, ...] into slot
    states.after_step(layers, fed)                    # fed[slot] = (length, token) for the keyed rows
    snaps = states.snapshots(slot, end)               # {position: states} for store.commit

A slot's state is ``[...]`` row ``slot`` of one ``[B, ...]`` tensor per state entry
(``layout.state_entries``: layer, "conv" | "recurrent", index), held by the batch's
``StateLayer``s, which the model's decode reads and updates in place (transformers'
``causal_conv1d_update`` and ``update_recurrent_state``). A row's state must be the state after
its real tokens only: a prefill that computed each row alone (a RadixCache call:
hf_patch.request catches every row up alone, and generate() feeds the last column, which is
real in every left-padded row), or a plain cache over rows without padding
(``prefill_tensors`` in hf_patch.running_batch refuses the rest).

Snapshots (as ``hf_patch.recurrent.DecodeSnapshots`` takes them in generate()): whenever a
keyed row's length reaches a multiple of the block size, a copy of its states, the deepest kept
per slot, none after an EOS it was fed (the commit cuts the row there). A row's commit attaches
it, so the next turn of a chat reuses the history up to the reply's last whole block.
Memory: one copy of a row's states per slot at most (the bytes of ``layout.state_specs``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from hf_patch.layer import StateLayer
from hf_patch.model_spec import ModelLayout
from hf_patch.recurrent import state_views

__all__ = ["SlotStates"]


class SlotStates:
    """Per-slot states and snapshots (see the module). ``block_size``: where snapshots may lie
    (the store's); ``eos``: the ids that end a row's reply."""

    def __init__(self, layout: ModelLayout, block_size: int, eos: Iterable[int] = ()) -> None:
        if not layout.stateful:
            raise ValueError("SlotStates: the layout keeps no recurrent state")
        self.layout, self.block_size, self.eos = layout, block_size, set(eos)
        self.latest: list[tuple[int, list[torch.Tensor]] | None] = []  # per slot: deepest snapshot
        self.ended: list[bool] = []  # per slot: fed an EOS of its reply (no snapshot after it)
        self._per_layer: dict[int, list] = {}
        for (layer_idx, part, idx), spec in zip(layout.state_entries, layout.state_specs):
            self._per_layer.setdefault(layer_idx, []).append((part, idx, spec))

    def allocate(self, layers: Sequence, slots: int, old: Sequence | None, keep: Sequence[int]) -> None:
        """Zeroed ``[slots, ...]`` states in the state layers of ``layers`` (new, empty), new slot
        j holding old slot ``keep[j]``'s states from ``old`` (the previous layers, or None), all
        marked as continued from (a free slot's zeros are finite: it computes nothing of use)."""
        for layer_idx, entries in self._per_layer.items():
            layers[layer_idx].allocate_states(slots, entries)
        if old is not None and keep:
            index = torch.tensor(list(keep), dtype=torch.long)
            for new, prev in zip(state_views(layers, self.layout), state_views(old, self.layout)):
                new[: len(keep)] = prev[index.to(prev.device)]
        for layer in layers:
            if isinstance(layer, StateLayer):
                layer.mark_filled()
        free = slots - len(keep)
        self.latest = [self.latest[i] if i < len(self.latest) else None for i in keep] + [None] * free
        self.ended = [self.ended[i] if i < len(self.ended) else False for i in keep] + [False] * free

    def admit(self, layers: Sequence, slot: int, rows: Sequence[torch.Tensor], r: int) -> None:
        """Slot ``slot`` takes row ``r`` of ``rows`` (one ``[R, ...]`` tensor per state entry)."""
        for t, src in zip(state_views(layers, self.layout), rows):
            t[slot] = src[r].to(t.device, t.dtype)
        self.latest[slot], self.ended[slot] = None, False

    def free(self, slot: int) -> None:
        self.latest[slot], self.ended[slot] = None, False

    def after_step(self, layers: Sequence, fed: Mapping[int, tuple[int, int]]) -> None:
        """After a step: ``fed[slot] = (length, token)``, the row's fed tokens now and the one
        this step fed; a row whose length is a block multiple (and that was fed no EOS of its
        reply before) keeps a copy of its states."""
        views = None
        for slot, (length, token) in fed.items():
            if self.ended[slot]:
                continue
            if length % self.block_size == 0:
                if views is None:
                    views = state_views(layers, self.layout)
                self.latest[slot] = (length, [t[slot].clone() for t in views])
            if token in self.eos:
                self.ended[slot] = True

    def snapshots(self, slot: int, end: int) -> dict[int, list[torch.Tensor]]:
        """The snapshots a commit of slot ``slot``'s first ``end`` tokens attaches."""
        latest = self.latest[slot]
        return {latest[0]: latest[1]} if latest is not None and latest[0] <= end else {}

    @staticmethod
    def rows_of(cache_layers: Sequence, layout: ModelLayout) -> list[torch.Tensor]:
        """A prefill cache's states ``[R, ...]`` per state entry (its layers: radixkv's
        StateLayers or transformers' own LinearAttentionLayers)."""
        out = []
        for layer_idx, part, idx in layout.state_entries:
            layer = cache_layers[layer_idx]
            t = (layer.conv_states if part == "conv" else layer.recurrent_states).get(idx)
            if t is None:
                raise ValueError(f"the prefill cache holds no {part} state {idx} in layer {layer_idx}")
            out.append(t)
        return out
