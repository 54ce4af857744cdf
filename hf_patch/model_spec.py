"""What a model's KV looks like and whether radixkv can serve it (its stores: ``hf_patch.stores``).

Every transformers-version-specific check about models lives here, so a new release means
reading one file.
"""

from __future__ import annotations

import inspect
import logging
import threading
import weakref

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from radixkv import KVStore, LayerSpec

logger = logging.getLogger(__name__)

_specs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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
