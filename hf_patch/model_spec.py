"""What a model's KV looks like and whether radixkv can serve it (its stores: ``hf_patch.stores``).

Every transformers-version-specific check about models lives here, so a new release means
reading one file.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import weakref

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

from radixkv import KVStore, LayerSpec, StateSpec

logger = logging.getLogger(__name__)

_specs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


# What radixkv serves, per stock cache layer class (an allowlist: a layer type added by a later
# release is refused until someone checks it). Sliding / chunked layers only differ by the mask,
# which generate() builds from positions: RadixCache keeps full KV there. Linear-attention /
# Mamba / conv layers keep recurrent state, which the store snapshots at tree nodes.
_LAYER_KINDS = {
    DynamicLayer: "kv",
    DummyLayer: "none",  # no cache at all (Nemotron-H's MLP / MoE layers); shared KV is refused above
    DynamicSlidingWindowLayer: "kv",
    LinearAttentionLayer: "state",
    LinearAttentionAndFullAttentionLayer: "kv+state",
    LinearAttentionAndSlidingWindowAttentionLayer: "kv+state",
}
DOCS = "docs/models.md"
# Mixers whose multi-token forward ignores a cached state (transformers 5.23's Mamba-1 selective
# scan starts from zeros: "initial hidden state is not supported"): after a snapshot, such a
# model may only continue one token at a time, as its own decode does.
_NO_INITIAL_STATE_MIXERS = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"})


class UnsupportedModelError(ValueError):
    """The model's cache cannot be rebuilt from what radixkv stores (a layer kind it does not know)."""


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What a model keeps between forwards, per layer, as radixkv stores it.

    ``kinds[i]``: ``"kv"`` (per-token K and V), ``"state"`` (recurrent / conv state of fixed
    size), ``"kv+state"`` (both in one layer: Falcon-H1, Zamba) or ``"none"``. The block pool
    holds the KV layers, in model order (``kv_layers``, ``specs``); a snapshot holds every
    state tensor (``state_entries[j] = (layer, "conv" | "recurrent", state index)``, shapes
    ``state_specs[j]`` without the batch dim). ``cache_arg``: the forward's cache argument
    (``cache_params`` for the Mamba families, else ``past_key_values``).
    """

    kinds: tuple[str, ...]
    specs: tuple[LayerSpec, ...]
    kv_layers: tuple[int, ...]
    state_entries: tuple[tuple[int, str, int], ...] = ()
    state_specs: tuple[StateSpec, ...] = ()
    cache_arg: str = "past_key_values"
    # False: a multi-token forward from a cached state is wrong (Mamba-1 mixers); only one
    # token at a time may follow a snapshot (hf_patch.recurrent.catch_up)
    continues_in_chunks: bool = True

    @property
    def stateful(self) -> bool:
        return bool(self.state_specs)

    @property
    def num_layers(self) -> int:
        return len(self.kinds)


def _refuse(model, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{type(model).__name__} {what}; see {DOCS} for the model kinds radixkv serves"
    )


def check_supported(model) -> None:
    """Raise UnsupportedModelError for models whose reuse could not be correct."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder model; radixkv serves decoder-only LMs"
        )
    text_config = config.get_text_config(decoder=True)
    if getattr(text_config, "num_kv_shared_layers", 0) and not _shares_through_update(text_config):
        raise _refuse(
            model,
            f"shares KV between layers (num_kv_shared_layers={text_config.num_kv_shared_layers}); "
            "a prefix cache of per-layer KV would be wrong for it",
        )
    if not model._supports_default_dynamic_cache():
        raise _refuse(
            model,
            "keeps its own state instead of a transformers Cache object (MiniMax, RWKV, xLSTM, ...); "
            "radixkv cannot snapshot it",
        )
    try:
        layers = DynamicCache(config=text_config).layers
    except KeyError as e:  # a layer type DynamicCache has no class for (DeepSeek-V4's compressed caches)
        raise _refuse(model, f"uses cache layers of type {e} that DynamicCache does not build") from None
    for i, layer in enumerate(layers):
        if type(layer) not in _LAYER_KINDS:
            raise _refuse(
                model,
                f"layer {i} keeps {type(layer).__name__} state, a cache layer kind radixkv has not been "
                "checked against",
            )


# Per family, the modules that keep a recurrent state of their own instead of in the cache, and
# which attributes: named by the refusal (docs/models.md#recurrentgemma says why not served).
_STATE_ON_MODULES = {"RecurrentGemmaRecurrentBlock": "conv1d_state and rg_lru.recurrent_states"}


def _state_outside_cache(model, layer_idx: int, cache_layer) -> UnsupportedModelError:
    """The refusal of a model whose probe left cache layer ``layer_idx`` empty: its state lives
    elsewhere (RecurrentGemma: on its modules), so radixkv could neither snapshot nor restore it."""
    for name, module in model.named_modules():
        attrs = _STATE_ON_MODULES.get(type(module).__name__)
        if attrs is not None and f"layers.{layer_idx}." in f"{name}.":
            return _refuse(
                model,
                f"layer {layer_idx} keeps its recurrent state on the model's modules ({name}: {attrs}), "
                f"not in the cache ({type(cache_layer).__name__} stayed empty): one state per model object, "
                "reassigned by every forward, which radixkv cannot snapshot or restore per row",
            )
    return _refuse(
        model,
        f"layer {layer_idx} keeps its recurrent state outside the cache ({type(cache_layer).__name__} "
        "stayed empty in a probe forward)",
    )


def _shares_through_update(text_config) -> bool:
    """KV sharing transformers expresses as ``kv_sharing_modes`` (Gemma 3n, Gemma 4): a "store"
    layer hands the KV its cache's ``update`` returned to the "reuse" layers of its type in the
    same forward, and the reuse layers are DummyLayers. RadixCache keeps full KV in the store
    layers, so the reuse layers read the whole prefix, as stock's full-length update gives them."""
    try:
        modes = getattr(text_config, "kv_sharing_modes", None)
    except (AttributeError, TypeError, ValueError):
        return False
    return bool(modes) and set(modes) <= {None, "store", "reuse"} and "store" in modes


def accepts(model, name: str) -> bool:
    """Whether ``model.forward`` takes the argument ``name`` (generate() asks the same way)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def cache_arg(model) -> str:
    """The name under which ``model.forward`` takes its cache (generate() picks it by name too)."""
    return (
        "cache_params"
        if accepts(model, "cache_params") and not accepts(model, "past_key_values")
        else ("past_key_values")
    )


def _placement(model) -> tuple:
    """The (dtype, device) pairs of the model's parameters: what ``.to()``/``.half()`` change."""
    return tuple(sorted({(str(p.dtype), str(p.device)) for p in model.parameters()}))


class _ProbeCache(DynamicCache):
    """DynamicCache(config) whose length is 0 even without attention layers (transformers raises
    there: a model that asks, such as RecurrentGemma, would fail the probe instead of being read)."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if not any(isinstance(layer, CacheLayerMixin) for layer in self.layers):
            return 0
        return super().get_seq_length(layer_idx)


def _state_spec(tensor: torch.Tensor) -> StateSpec:
    return StateSpec(tuple(tensor.shape[1:]), tensor.dtype, tensor.device)


@torch.no_grad()
def model_layout(model) -> ModelLayout:
    """Per-layer KV shapes and recurrent-state shapes, read off a one-token probe forward.

    A probe is exact for every family (GQA, explicit head_dim, K/V dims that differ, layers
    dispatched to several devices, conv kernels and state sizes) where reading config fields
    would need a case per family. Memoised per model and per parameter placement, so a model
    moved to another dtype or device after its first call is probed again (one pass over the
    parameters per call).
    """
    placement = _placement(model)
    with _lock:
        cached = _specs.get(model)
    if cached is not None and cached[0] == placement:
        return cached[1]
    check_supported(model)
    text_config = model.config.get_text_config(decoder=True)
    probe = _ProbeCache(config=text_config)
    if not any(isinstance(layer, (LinearAttentionCacheLayerMixin, DummyLayer)) for layer in probe.layers):
        probe = DynamicCache()  # plain KV: full layers, as RadixCache keeps them
    arg = cache_arg(model)
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    model(input_ids=token, **{arg: probe}, use_cache=True)
    kinds, specs, kv_layers, entries, state_specs = [], [], [], [], []
    for i, layer in enumerate(probe.layers):
        kind = _LAYER_KINDS.get(type(layer), "kv")
        has_kv = getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False)
        if "kv" in kind and not has_kv:
            kind = kind.replace("kv+", "").replace("kv", "none")
        if "kv" in kind:
            kv_layers.append(i)
            specs.append(
                LayerSpec(
                    num_kv_heads=layer.keys.shape[1],
                    k_head_dim=layer.keys.shape[3],
                    v_head_dim=layer.values.shape[3],
                    dtype=layer.keys.dtype,
                    device=layer.keys.device,
                )
            )
            if layer.keys.shape[2] != 1:
                # KV column j must belong to prompt token j: a model that adds its own columns
                # (CPM-Ant prepends learned prompt tokens) would be preloaded at the wrong offsets.
                raise _refuse(
                    model,
                    f"wrote {layer.keys.shape[2]} KV columns for one input token; "
                    "radixkv needs exactly one KV column per token",
                )
        if "state" in kind:
            for idx in range(layer.number_of_states):
                for part, tensors, ready in (
                    ("conv", layer.conv_states, layer.is_conv_states_initialized),
                    ("recurrent", layer.recurrent_states, layer.is_recurrent_states_initialized),
                ):
                    if ready[idx]:
                        entries.append((i, part, idx))
                        state_specs.append(_state_spec(tensors[idx]))
            if not any(e[0] == i for e in entries):
                # The cache has a state layer here, but the forward kept its state elsewhere
                # (RecurrentGemma: on its modules): nothing radixkv could snapshot or restore.
                raise _state_outside_cache(model, i, layer)
        kinds.append(kind)
    if not kv_layers and not state_specs:
        raise _refuse(model, "wrote no KV and no recurrent state in a probe forward")
    chunks = not any(type(m).__name__ in _NO_INITIAL_STATE_MIXERS for m in model.modules())
    layout = ModelLayout(
        tuple(kinds), tuple(specs), tuple(kv_layers), tuple(entries), tuple(state_specs), arg, chunks
    )
    with _lock:
        _specs[model] = (placement, layout)
    return layout


def layer_specs(model) -> tuple[LayerSpec, ...]:
    """The block pool's layers for ``model``: the KV shapes of its KV-bearing layers, in order."""
    return model_layout(model).specs


def check_store_fits(store: KVStore, model) -> None:
    """Refuse, naming the difference, a store shaped for another model."""
    layout = model_layout(model)
    specs = layout.specs
    states = store.states.specs if store.states is not None else ()
    if tuple(states) != layout.state_specs:
        raise ValueError(
            "this KVStore was built for a model of another shape (recurrent state: store has "
            f"{len(states)} state tensors, model needs {len(layout.state_specs)}"
            + (", or other shapes)" if len(states) == len(layout.state_specs) else ")")
        )
    if tuple(store.pool.layers) != specs:
        have, want = store.pool.layers, specs
        if len(have) != len(want):
            detail = f"{len(have)} layers in the store, {len(want)} in the model"
        else:
            i = next(i for i, (a, b) in enumerate(zip(have, want)) if a != b)
            detail = f"layer {i}: store has {have[i]}, model needs {want[i]}"
        raise ValueError(f"this KVStore was built for a model of another shape ({detail})")
