"""What a model's KV looks like, whether radixkv can serve it, and its default store.

Every transformers-version-specific check about models lives here, so a new release means
reading one file.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import weakref

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from radixkv import BlockPool, KVStore, LayerSpec
from radixkv.store.tier import host_pool_for

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16
DEFAULT_BUDGET_BYTES = 1 << 30  # 1 GiB of KV per model unless RADIXKV_CACHE_TOKENS/BYTES say otherwise

_specs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_default_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


# Sliding / chunked layers only differ by the mask, which generate() builds from positions.
_PLAIN_KV_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)


class UnsupportedModelError(ValueError):
    """The model's cache cannot be rebuilt from a KV prefix (recurrent state, shared KV, ...)."""


def check_supported(model) -> None:
    """Raise UnsupportedModelError for models whose reuse could not be correct."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; radixkv serves decoder-only LMs"
        )
    text_config = config.get_text_config(decoder=True)
    if getattr(text_config, "num_kv_shared_layers", 0):
        raise UnsupportedModelError(
            f"{type(model).__name__} shares KV between layers (num_kv_shared_layers="
            f"{text_config.num_kv_shared_layers}); a prefix cache of per-layer KV would be wrong for it"
        )
    if not model._supports_default_dynamic_cache():
        raise UnsupportedModelError(
            f"{type(model).__name__} does not use a KV Cache object (recurrent/state-space model); "
            "its state at a prefix is not KV and cannot be reused"
        )
    layers = DynamicCache(config=text_config).layers
    for i, layer in enumerate(layers):
        # An allowlist, not a denylist: subclasses of DynamicLayer carry state that plain KV does
        # not rebuild (Falcon-H1's hybrid conv/recurrent state, the DSA indexer keys of GLM-MoE-DSA
        # / DeepSeek-V3.2, DeepSeek-V4's compressed cache), and a layer type added by a later
        # release must be refused until someone checks it, not served wrong.
        if type(layer) not in _PLAIN_KV_LAYERS:
            raise UnsupportedModelError(
                f"{type(model).__name__} layer {i} keeps {type(layer).__name__} state "
                "(recurrent/linear-attention, indexer or shared KV); radixkv can only reuse plain attention KV"
            )


def accepts(model, name: str) -> bool:
    """Whether ``model.forward`` takes the argument ``name`` (generate() asks the same way)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _placement(model) -> tuple:
    """The (dtype, device) pairs of the model's parameters: what ``.to()``/``.half()`` change."""
    return tuple(sorted({(str(p.dtype), str(p.device)) for p in model.parameters()}))


@torch.no_grad()
def layer_specs(model) -> tuple[LayerSpec, ...]:
    """Per-layer KV shape, dtype and device, read off a one-token probe forward.

    A probe is exact for every family (GQA, explicit head_dim, K/V dims that differ, layers
    dispatched to several devices) where reading config fields would need a case per family.
    Memoised per model and per parameter placement, so a model moved to another dtype or
    device after its first call is probed again (one pass over the parameters per call).
    """
    placement = _placement(model)
    with _lock:
        cached = _specs.get(model)
    if cached is not None and cached[0] == placement:
        return cached[1]
    check_supported(model)
    probe = DynamicCache()
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    model(input_ids=token, past_key_values=probe, use_cache=True)
    specs = tuple(
        LayerSpec(
            num_kv_heads=layer.keys.shape[1],
            k_head_dim=layer.keys.shape[3],
            v_head_dim=layer.values.shape[3],
            dtype=layer.keys.dtype,
            device=layer.keys.device,
        )
        for layer in probe.layers
    )
    if not specs:
        raise UnsupportedModelError(f"{type(model).__name__} wrote no KV in a probe forward")
    columns = {layer.keys.shape[2] for layer in probe.layers}
    if columns != {1}:
        # KV column j must belong to prompt token j: a model that adds its own columns (CPM-Ant
        # prepends learned prompt tokens) would be preloaded at the wrong offsets.
        raise UnsupportedModelError(
            f"{type(model).__name__} wrote {sorted(columns)} KV columns for one input token; "
            "radixkv needs exactly one KV column per token"
        )
    with _lock:
        _specs[model] = (placement, specs)
    return specs


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"environment variable {name} must be positive, got {value}")
    return value


def build_store(
    model,
    block_size: int | None = None,
    budget_tokens: int | None = None,
    budget_bytes: int | None = None,
    restore: str | os.PathLike | None = None,
    *,
    host_cache_tokens: int | None = None,
    host_cache_bytes: int | None = None,
) -> KVStore:
    """A new KVStore shaped for ``model``.

    Budget: ``budget_tokens`` or ``budget_bytes`` (at most one), else the environment's
    ``RADIXKV_CACHE_TOKENS`` / ``RADIXKV_CACHE_BYTES``, else 1 GiB. Block size: argument,
    else ``RADIXKV_BLOCK_SIZE``, else 16. The pool is preallocated with ``torch.empty``.
    ``restore``: a file written by ``hf_patch.save_cache`` for this model, loaded into the new
    store (raises radixkv.CacheFileError, building nothing, when it is damaged or another model's).

    Host tier (none by default): ``host_cache_tokens`` or ``host_cache_bytes``, else
    ``RADIXKV_HOST_CACHE_TOKENS`` / ``RADIXKV_HOST_CACHE_BYTES``: a CPU pool of that size
    behind the device pool (page-locked when the model is on CUDA); blocks evicted from the
    device are demoted there instead of dropped.
    """
    if budget_tokens is not None and budget_bytes is not None:
        raise ValueError("give at most one of budget_tokens= and budget_bytes=")
    if host_cache_tokens is not None and host_cache_bytes is not None:
        raise ValueError("give at most one of host_cache_tokens= and host_cache_bytes=")
    if host_cache_tokens is None and host_cache_bytes is None:
        host_cache_tokens = _env_int("RADIXKV_HOST_CACHE_TOKENS")
        host_cache_bytes = None if host_cache_tokens else _env_int("RADIXKV_HOST_CACHE_BYTES")
    block_size = block_size or _env_int("RADIXKV_BLOCK_SIZE") or DEFAULT_BLOCK_SIZE
    if budget_tokens is None and budget_bytes is None:
        budget_tokens = _env_int("RADIXKV_CACHE_TOKENS")
        budget_bytes = None if budget_tokens else (_env_int("RADIXKV_CACHE_BYTES") or DEFAULT_BUDGET_BYTES)
    specs = layer_specs(model)
    pool = BlockPool.from_budget(specs, block_size, tokens=budget_tokens, bytes=budget_bytes)
    host = None
    if host_cache_tokens is not None or host_cache_bytes is not None:
        host = host_pool_for(pool, tokens=host_cache_tokens, bytes=host_cache_bytes)
    store = KVStore(pool, host)
    logger.info(
        "radixkv store for %s: %d blocks x %d tokens, %.1f MiB, %d layers%s",
        type(model).__name__,
        pool.num_blocks,
        block_size,
        pool.nbytes / 2**20,
        len(specs),
        f"; host tier {host.num_blocks} blocks, {host.nbytes / 2**20:.1f} MiB" if host is not None else "",
    )
    if restore is not None:
        from hf_patch.persistence import restore_cache  # it imports this module

        restore_cache(model, restore, store)
    return store


def default_store(model) -> KVStore:
    """The store ``RadixCache()`` uses for ``model``: built on first use, one per model object.

    A model converted since (``.half()``, ``.to(device)``) gets a new store of its new shape;
    the old one is dropped with its KV, which the converted weights would not reproduce.
    """
    specs = layer_specs(model)
    with _lock:
        store = _default_stores.get(model)
    if store is not None and tuple(store.pool.layers) == specs:
        return store
    if store is not None:
        logger.warning("radixkv: %s changed dtype/device; replacing its default store", type(model).__name__)
    fresh = build_store(model)
    with _lock:
        store = _default_stores.get(model)
        if store is None or tuple(store.pool.layers) != specs:
            _default_stores[model] = store = fresh
    return store


def check_store_fits(store: KVStore, model) -> None:
    """Refuse, naming the difference, a store shaped for another model."""
    specs = layer_specs(model)
    if tuple(store.pool.layers) != specs:
        have, want = store.pool.layers, specs
        if len(have) != len(want):
            detail = f"{len(have)} layers in the store, {len(want)} in the model"
        else:
            i = next(i for i, (a, b) in enumerate(zip(have, want)) if a != b)
            detail = f"layer {i}: store has {have[i]}, model needs {want[i]}"
        raise ValueError(f"this KVStore was built for a model of another shape ({detail})")
