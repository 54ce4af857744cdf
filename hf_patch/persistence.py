"""Save a model's cached prefixes to disk and restore them, for the same model only.

    hf_patch.save_cache(model, "kv.safetensors")                 # the default store's prefixes
    store = hf_patch.build_store(model, restore="kv.safetensors") # after a restart

radixkv writes the file (``KVStore.save`` / ``restore``, see radixkv/persist/) and knows
no models: it stores an opaque ``identity`` and refuses a restore that presents another.
The identity is ``hf_patch.identity.model_identity`` (model class, config hash, sampled
weights hash; the same one the sidecar client keys by), and ``hf_patch.cache_files`` does the
work on a given store; this module picks the store (the model's default one unless given).

Models with recurrent layers (Mamba, linear attention, conv; hf_patch.model_spec): their store's
file carries every node's recurrent-state snapshot beside its KV (format 3, docs/cache-files.md),
and its layout names the snapshot tensors' shapes and dtypes (``hf_patch.identity.kv_layout``), so
a restore brings back prefixes a stateful match can serve, and a file of another layout is
refused. A plain model's identity and layout are what they were: its files stay valid.

PEFT adapters are not part of the identity: ``weights_sha256`` covers the base model's weights
only (hf_patch.keys.adapters.base_named_parameters: adapter parameters left out, wrapped layers under
their plain names), so a model with adapters loaded and the same model without them share cache
files. Each adapter's prefixes sit under a namespace carrying its name and weights digest; a
restore keeps them only for adapters the model holds now with the same weights (load adapters
first) and leaves the rest out before any room is taken (``stale_adapter_filter``). Files written while the identity still
hashed adapter weights (with an ``adapter_keys`` field) no longer match and are refused.

Namespaces: hf_patch keys the store by ``(model scope, namespace)``, where the scope is a
per-process number (hf_patch.keys.weights) and the namespace a ``KeyedNamespace`` when a PEFT
adapter computed the KV (its name and weights digest ride along). The file holds those
namespaces without the scope; a restore puts them under the restoring model's scope, so they
hit in a new process, and an adapter's KV only for the same adapter weights.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Hashable

from hf_patch.cache_files import restore_store_of, save_store_of
from hf_patch.model_spec import check_store_fits
from hf_patch.stores import default_store
from radixkv import KVStore, RestoreResult, SaveResult


def _store(model, store: KVStore | None) -> KVStore:
    if store is None:
        return default_store(model)
    check_store_fits(store, model)
    return store


def save_cache(
    model,
    path: str | os.PathLike,
    store: KVStore | None = None,
    namespaces: Collection[Hashable] | None = None,
    *,
    max_bytes: int | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
    max_rate: float | None = None,
) -> SaveResult:
    """Write ``model``'s prefixes in ``store`` (default: its default store) to ``path``, atomically.

    ``namespaces``: a list/set of RadixCache namespaces to save; None saves all of this
    model's. Another model's prefixes in a shared store are never written. KV cached under
    weights that have changed since is flushed first, never saved under the new identity.
    Raises RuntimeError, writing nothing, if the weights change (the store is flushed) while
    their identity is computed. ``max_bytes``, ``deadline``, ``cancel``, ``max_rate``: see
    ``KVStore.save`` (the most recent prefixes that fit; radixkv.SaveAborted once the deadline
    passes; a bandwidth cap for saves in the background of requests).
    """
    return save_store_of(
        model,
        path,
        _store(model, store),
        namespaces,
        max_bytes=max_bytes,
        deadline=deadline,
        cancel=cancel,
        max_rate=max_rate,
    )


def restore_cache(
    model, path: str | os.PathLike, store: KVStore | None = None, *, evict: bool = False
) -> RestoreResult:
    """Merge the prefixes saved in ``path`` into ``store`` (default: ``model``'s default store).

    Raises radixkv.CacheFileMismatch when the file was saved for another model class, config,
    weights or KV layout, radixkv.CorruptCacheFile when it is damaged, RuntimeError when the
    weights changed (the store was flushed) while the file was read; the store is then
    unchanged. See ``KVStore.restore`` for merging, a pool too small and ``evict`` (the file's
    prefixes may evict or demote the store's least recently used unpinned blocks). Prefixes of
    PEFT adapters that ``model`` does not hold now with the same weights are left out (counted
    as dropped): load the adapters first.
    """
    return restore_store_of(model, path, _store(model, store), evict=evict)
