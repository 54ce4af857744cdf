"""The work of ``hf_patch.save_cache`` / ``restore_cache`` on a given store (``hf_patch.persistence``
picks the store; ``hf_patch.stores.build_store`` restores through here while building one).

The file's identity is ``hf_patch.identity.model_identity``; hf_patch keys the store by
``(model scope, namespace)``, the file holds the namespaces without the scope and a restore puts
them under the restoring model's scope. See ``hf_patch.persistence`` for the whole story.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Hashable

from hf_patch.identity import model_identity
from hf_patch.keys.weights import flush_if_weights_changed, model_scope, stale_adapter_filter
from radixkv import KeyedNamespace, KVStore, RestoreResult, SaveResult


def save_store_of(
    model,
    path: str | os.PathLike,
    store: KVStore,
    namespaces: Collection[Hashable] | None = None,
    *,
    max_bytes: int | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    max_rate: float | None = None,
) -> SaveResult:
    """``hf_patch.save_cache`` on a given ``store`` (its docstring has the contract); here so the
    store builder and the cache files share ``hf_patch.identity`` without importing each other."""
    flush_if_weights_changed(store, model)
    epoch = store.epoch  # a flush while the identity is computed: the tree may hold other weights' KV
    scope = model_scope(model)
    wanted = None if namespaces is None else set(namespaces)

    def mine(ns: Hashable) -> bool:
        if type(ns) is not tuple or len(ns) != 2 or ns[0] != scope:
            return False
        user = ns[1].namespace if isinstance(ns[1], KeyedNamespace) else ns[1]  # an adapter's root
        return wanted is None or user in wanted

    return store.save(
        path,
        mine,
        identity=model_identity(model),
        rename=lambda ns: ns[1],
        epoch=epoch,
        max_bytes=max_bytes,
        deadline=deadline,
        cancel=cancel,
        max_rate=max_rate,
    )


def restore_store_of(model, path: str | os.PathLike, store: KVStore, *, evict: bool = False) -> RestoreResult:
    """Merge the prefixes saved in ``path`` into ``store`` (default: ``model``'s default store).

    Raises radixkv.CacheFileMismatch when the file was saved for another model class, config,
    weights or KV layout, radixkv.CorruptCacheFile when it is damaged, RuntimeError when the
    weights changed (the store was flushed) while the file was read; the store is then
    unchanged. See ``KVStore.restore`` for merging, a pool too small and ``evict`` (the file's
    prefixes may evict or demote the store's least recently used unpinned blocks). Prefixes of
    PEFT adapters that ``model`` does not hold now with the same weights are left out (counted
    as dropped): load the adapters first.
    """
    # Record the current weights first: KV cached under older ones goes now, and the first
    # generate() after the restore does not take the restored KV for stale.
    flush_if_weights_changed(store, model)
    # Read before the identity: a flush after it (weights changed while the file is read) makes
    # the file's KV stale, and the store then refuses it.
    epoch = store.epoch
    scope = model_scope(model)
    # Prefixes of adapters not loaded now (or with other weights) are left out of the restore:
    # they could never be served, and with ``evict`` they would have evicted useful blocks.
    stale = stale_adapter_filter(model)
    return store.restore(
        path,
        identity=model_identity(model),
        rename=lambda ns: (scope, ns),
        epoch=epoch,
        evict=evict,
        namespaces=lambda ns: not stale(ns),
    )
