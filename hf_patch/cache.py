"""RadixCache: the transformers ``Cache`` a user passes to ``generate()`` to get prefix reuse.

    out = model.generate(ids, attention_mask=mask, past_key_values=RadixCache(), max_new_tokens=64)
    cache.cached_tokens  # per returned sequence: prompt tokens served from the store in that call

The object is a plain per-call container of ``AppendLayer``s; what persists between calls
lives in a ``radixkv.KVStore``. Each ``generate()`` call starts the layers empty (so passing
the same object twice is fine), matches the prompt against the store, preloads the matched
prefix, and commits the finished sequences when generate returns.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_patch.keys import SharedPrefix
from hf_patch.layer import AppendLayer, make_layers
from radixkv import KVStore


def _extra_ids_tensor(extra_ids) -> torch.Tensor:
    """``extra_ids`` as a CPU int64 ``[batch, seq]`` tensor holding the uint64 bit patterns."""
    if not isinstance(extra_ids, torch.Tensor):
        try:
            extra_ids = torch.tensor(
                [[x if x < 1 << 63 else x - (1 << 64) for x in row] for row in extra_ids], dtype=torch.int64
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"extra_ids must be [batch, seq] integers: {e}") from None
    if extra_ids.dim() != 2 or extra_ids.dtype.is_floating_point or extra_ids.dtype == torch.bool:
        raise ValueError(
            f"extra_ids must be a [batch, seq] integer tensor, got {extra_ids.dtype} {tuple(extra_ids.shape)}"
        )
    if extra_ids.dtype == torch.uint64:
        extra_ids = extra_ids.view(torch.int64)
    return extra_ids.to("cpu", torch.int64)


def _snapshot_hints(value) -> list[int] | list[list[int]] | None:
    """``snapshot_at`` checked: None, a list of ints >= 0, or a list of such lists."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"snapshot_at must be a list of token positions (or one list per row), got {value!r}")
    per_row = bool(value) and all(isinstance(v, (list, tuple)) for v in value)
    for v in (p for row in value for p in row) if per_row else value:
        if type(v) is not int or v < 0:
            raise ValueError(f"snapshot_at positions must be ints >= 0, got {v!r}")
    return [list(row) for row in value] if per_row else list(value)


class RadixCache(Cache):
    """A prefix-reusing cache for decoder-only models.

    Args:
        store: the KVStore to share; default: one store per model, built on first use from
            the model's shape (budget: ``RADIXKV_CACHE_TOKENS`` / ``RADIXKV_CACHE_BYTES``, 1 GiB).
        namespace: any hashable; equal prompts under different namespaces never share KV
            (tenants, salts). Derive it on the server, never from a client field. A *list*
            gives one namespace per input row (rows of different tenants in one batch).
            The active PEFT adapter is keyed on its own (hf_patch.keys.adapters).
        extra_ids: TensorRT-LLM's per-token extra ids, ``[batch, seq]`` integers aligned with
            ``input_ids`` (0 for plain tokens; the same nonzero id for tokens whose embedding
            is the same, e.g. one prompt table): equal (id, extra id) pairs reuse, others do not.
            With ``inputs_embeds`` they are what makes the prompt reusable at all.
        shared_prefix: ``SharedPrefix(namespace, length)`` (or a list, one per row, None for
            none): the row's first ``length`` tokens are keyed under the public
            ``namespace`` (a task prompt pinned once for every tenant), the rest stay private
            to the row's own namespace.
        snapshot_at: models with recurrent layers: prompt positions (tokens from the row's first,
            pads not counted) where a later prompt is likely to part from this one, e.g. where a
            system prompt or an earlier turn ends; a snapshot is taken at each (floored to the
            block size), so the next request that shares exactly that much reuses all of it.
            A list of ints for every row, or a list of such lists, one per row. Ignored by
            attention-only models (their KV is usable at every block).
        paged: whether attention reads the cached prefix from the pool in place
            (hf_patch.paged_attention: one copy of a shared prefix whatever the batch, ~1e-7
            from stock's logits in fp32) rather than from a per-row copy (bit-exact with stock
            on the CPU). None (default): ``RADIXKV_PAGED_ATTENTION`` (``1``: in place where it
            applies; unset: the copy); True / False: this call's choice.
    """

    def __init__(
        self,
        store: KVStore | None = None,
        namespace: Hashable | list[Hashable] = None,
        *,
        extra_ids=None,
        shared_prefix: SharedPrefix | list[SharedPrefix | None] | None = None,
        snapshot_at: list[int] | list[list[int]] | None = None,
        paged: bool | None = None,
    ) -> None:
        super().__init__(layer_class_to_replicate=AppendLayer)
        if store is not None and not isinstance(store, KVStore):
            raise TypeError(f"store must be a radixkv.KVStore, got {type(store).__name__}")
        for ns in namespace if isinstance(namespace, list) else [namespace]:
            hash(ns)  # fail now, not deep inside a generate call
        for sp in shared_prefix if isinstance(shared_prefix, list) else [shared_prefix]:
            if sp is not None and not isinstance(sp, SharedPrefix):
                raise TypeError(f"shared_prefix must be a hf_patch.SharedPrefix, got {type(sp).__name__}")
        self.store = store
        self.namespace = namespace
        self.extra_ids = None if extra_ids is None else _extra_ids_tensor(extra_ids)
        self.shared_prefix = shared_prefix
        self.snapshot_at = _snapshot_hints(snapshot_at)
        if paged is not None and not isinstance(paged, bool):
            raise TypeError(f"paged must be None, True or False, got {paged!r}")
        self.paged = paged
        self.paged_plan = None  # hf_patch.paged_attention.PagedPlan while a paged call runs
        self.cached_tokens: list[int] = []
        self._request = None  # hf_patch.request.Request while a generate() call runs
        self.consumed = 0  # tokens the layers hold, for a model without attention layers

    def start(self, layout) -> None:
        """Forget the previous call's KV and make one empty layer per model layer, of the kind
        ``layout`` (hf_patch.model_spec.ModelLayout) says the model keeps there."""
        self.layers = make_layers(layout)
        self.cached_tokens = []
        self.consumed = 0
        self.paged_plan = None

    # Rows move: a paged call's block table moves with its layers' computed columns.
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.paged_plan is not None:
            self.paged_plan.select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.paged_plan is not None:
            self.paged_plan.repeat(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.paged_plan is not None:
            self.paged_plan.select(torch.arange(len(self.paged_plan.row_cluster))[indices])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.layers and not any(isinstance(layer, CacheLayerMixin) for layer in self.layers):
            return self.consumed  # only recurrent layers (Mamba): no layer counts tokens
        return super().get_seq_length(layer_idx)

    def __repr__(self) -> str:
        return f"RadixCache(namespace={self.namespace!r}, layers={len(self.layers)}, cached_tokens={self.cached_tokens})"
