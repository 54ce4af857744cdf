"""Save a model's cached prefixes to disk and restore them, for the same model only.

    hf_patch.save_cache(model, "kv.safetensors")                 # the default store's prefixes
    store = hf_patch.build_store(model, restore="kv.safetensors") # after a restart

radixkv writes the file (``KVStore.save`` / ``restore``, see radixkv/persist/) and knows
no models: it stores an opaque ``identity`` and refuses a restore that presents another.
This module builds that identity from what the KV depends on:

- ``model_class``: the module and name of the model's class;
- ``config_sha256``: a hash of the model config (without fields that do not change the KV:
  paths, versions, output flags; the dtype is checked by the store's layout);
- ``weights_sha256``: per parameter (sorted by name), its name, dtype, shape and a sample of
  up to ``WEIGHT_SAMPLE`` elements at fixed, evenly spaced positions. A fine-tune or another
  checkpoint changes every element of the tensors it touches, so a few thousand per tensor
  tell them apart; an edit of single elements between the sampled ones is not seen. Cost:
  one small gather per parameter, no pass over the weights.


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

import hashlib
import json
import os
import threading
from collections.abc import Collection, Hashable

import torch

from hf_patch.keys.adapters import base_named_parameters
from hf_patch.keys.weights import flush_if_weights_changed, model_scope, stale_adapter_filter
from hf_patch.model_spec import check_store_fits, default_store
from radixkv import KeyedNamespace, KVStore, RestoreResult, SaveResult

WEIGHT_SAMPLE = 4096
# Config fields that do not change what the model computes for a token.
_CONFIG_IGNORED = {
    "transformers_version",
    "dtype",
    "torch_dtype",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}


def config_sha256(model) -> str:
    config = model.config.to_dict()
    kept = {k: v for k, v in config.items() if not k.startswith("_") and k not in _CONFIG_IGNORED}
    text = json.dumps(kept, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@torch.no_grad()
def weights_sha256(model, sample: int = WEIGHT_SAMPLE) -> str:
    """Hash of every base parameter's name, dtype, shape and ``sample`` evenly spaced elements
    (adapter parameters left out: hf_patch.keys.adapters.base_named_parameters)."""
    digest = hashlib.sha256()
    for name, param in sorted(base_named_parameters(model), key=lambda item: item[0]):
        if param.device.type == "meta":
            raise ValueError(
                f"parameter {name} is on the meta device (offloaded); its weights cannot be fingerprinted"
            )
        flat = param.detach().reshape(-1)
        n = flat.numel()
        if n > sample:
            # Integer positions, computed on the CPU: the same on every device and run.
            positions = torch.arange(sample, dtype=torch.int64) * (n - 1) // (sample - 1)
            flat = flat[positions.to(flat.device)]
        values = flat.cpu().contiguous().view(torch.uint8)
        digest.update(f"{name}|{param.dtype}|{tuple(param.shape)}|".encode())
        digest.update(values.numpy().tobytes())
    return digest.hexdigest()


def model_identity(model) -> dict[str, str]:
    """What a saved cache of ``model`` must match to be restored into it (JSON-able)."""
    cls = type(model)
    return {
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "config_sha256": config_sha256(model),
        "weights_sha256": weights_sha256(model),
    }


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
    store = _store(model, store)
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
    store = _store(model, store)
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
