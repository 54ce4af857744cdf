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

from transformers.cache_utils import Cache

from hf_patch.layer import AppendLayer
from radixkv import KVStore


class RadixCache(Cache):
    """A prefix-reusing cache for decoder-only models.

    Args:
        store: the KVStore to share; default: one store per model, built on first use from
            the model's shape (budget: ``RADIXKV_CACHE_TOKENS`` / ``RADIXKV_CACHE_BYTES``, 1 GiB).
        namespace: any hashable; equal prompts under different namespaces never share KV
            (tenants, adapters). Derive it on the server, never from a client field.
    """

    def __init__(self, store: KVStore | None = None, namespace: Hashable = None) -> None:
        super().__init__(layer_class_to_replicate=AppendLayer)
        if store is not None and not isinstance(store, KVStore):
            raise TypeError(f"store must be a radixkv.KVStore, got {type(store).__name__}")
        hash(namespace)  # fail now, not deep inside a generate call
        self.store = store
        self.namespace = namespace
        self.cached_tokens: list[int] = []
        self._request = None  # hf_patch.request.Request while a generate() call runs

    def start(self, num_layers: int) -> None:
        """Forget the previous call's KV and make one empty layer per model layer."""
        self.layers = [AppendLayer() for _ in range(num_layers)]
        self.cached_tokens = []

    def __repr__(self) -> str:
        return f"RadixCache(namespace={self.namespace!r}, layers={len(self.layers)}, cached_tokens={self.cached_tokens})"
