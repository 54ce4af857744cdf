"""What a model's KV looks like and whether radixkv can serve it (its stores: ``hf_patch.stores``).

Every transformers-version-specific check about models lives here, so a new release means
reading one file.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
import weakref

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicCache,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from hf_patch.forward_args import forward_parameters
from hf_patch.keys.model_walk import DATA_PTR, DTYPE, walk
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
    DynamicIndexedLayer: "kv",  # + the DSA indexer's per-token keys: one more pool layer (ModelLayout)
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
class CompressorSpec:
    """One compressor of a DeepSeek-V4 attention layer (``hf_patch.layer.CompressedLayer``).

    ``name``: its key in the stock cache layer (``"compressor"``; CSA layers also ``"indexer"``).
    Every ``rate`` tokens close a window that emits one compressed entry of ``entry_dim``; the
    tokens of the open window wait as kv and gate projections of ``proj_dim`` each (the
    buffer); ``overlap_dim`` > 0 (CSA): the last closed window's ``[rate, overlap_dim]`` kv and
    gate slices enter the next window's entry (the snapshot holds them). In the block pool,
    entry w lies in the V columns of its window's ``rate`` tokens, ``share`` =
    ceil(entry_dim / rate) values each, from ``offset`` of the token's packed vector. So that a
    block holds entries of its own windows only, the store's block size is a multiple of every rate
    (``hf_patch.stores.build_store``, ``check_store_fits``): a window straddling two blocks
    would put parts of an entry that depends on the later block's tokens into the earlier
    block, which another prompt sharing only that block would read.
    """

    name: str
    rate: int
    entry_dim: int
    proj_dim: int
    overlap_dim: int
    share: int
    offset: int
    dtype: torch.dtype  # of the projections (buffer, overlap); entries have the layer's KV dtype
    device: torch.device


@dataclasses.dataclass(frozen=True)
class ModelLayout:
    """What a model keeps between forwards, per layer, as radixkv stores it.

    ``kinds[i]``: ``"kv"`` (per-token K and V), ``"state"`` (recurrent / conv state of fixed
    size), ``"kv+state"`` (both in one layer: Falcon-H1, Zamba), ``"compressed"`` (DeepSeek-V4:
    per-token sliding K and compressed entries, plus a fixed-size state) or ``"none"``. The block pool
    holds the KV layers, in model order (``kv_layers``, ``specs``); a snapshot holds every
    state tensor (``state_entries[j] = (layer, "conv" | "recurrent", state index)``, shapes
    ``state_specs[j]`` without the batch dim); then one pool layer per ``index_layers`` entry.
    ``cache_arg``: the forward's cache argument
    (``cache_params`` for the Mamba families, else ``past_key_values``).
    """

    kinds: tuple[str, ...]
    specs: tuple[LayerSpec, ...]
    kv_layers: tuple[int, ...]
    state_entries: tuple[tuple[int, str, int], ...] = ()
    state_specs: tuple[StateSpec, ...] = ()
    # KV layers that also keep a sparse-attention indexer's keys (DeepSeek-V3.2's DSA): each is
    # one more pool layer after the KV layers' (``specs``: one head, the key dims split in two
    # halves as its K and V). ``index_positions``: the layer where the model keeps the indexer's
    # position history (Qwen4-Exp), or None.
    index_layers: tuple[int, ...] = ()
    index_positions: int | None = None
    cache_arg: str = "past_key_values"
    # False: a multi-token forward from a cached state is wrong (Mamba-1 mixers); only one
    # token at a time may follow a snapshot (hf_patch.recurrent.catch_up)
    continues_in_chunks: bool = True
    # DeepSeek-V4 (every layer of kind "compressed"): per layer, its compressors (none for a
    # sliding-only layer), and the sliding window all its layers share
    compressors: tuple[tuple[CompressorSpec, ...], ...] = ()
    sliding_window: int = 0
    # Snapshots (and so reuse) only at multiples of this many tokens: where every compressor's
    # window is closed (DeepSeek-V4: the compress rates' lcm); 1: at any block boundary
    snapshot_grain: int = 1
    # A left-padded row's outputs depend on its padding in stock (DeepSeek-V4: compression
    # windows start at column 0, pads included): generate() computes such a row as stock does,
    # from its first column, and neither reuses nor caches it (hf_patch.request)
    padding_dependent: bool = False

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
    compressed = _compressed_classes()
    for i, layer in enumerate(layers):
        if type(layer) not in _LAYER_KINDS and type(layer) not in compressed:
            raise _refuse(
                model,
                f"layer {i} keeps {type(layer).__name__} state, a cache layer kind radixkv has not been "
                "checked against",
            )


def _compressed_classes() -> tuple[type, ...]:
    """DeepSeek-V4's compressed cache layer classes (HCA, CSA), once its modeling module is loaded
    (it registers them with DynamicCache; a model of the family implies it); () before."""
    module = sys.modules.get("transformers.models.deepseek_v4.modeling_deepseek_v4")
    names = ("DeepseekV4HCACache", "DeepseekV4CSACache")
    return tuple(getattr(module, n) for n in names if hasattr(module, n)) if module is not None else ()


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
    return name in forward_parameters(model)


def cache_arg(model) -> str:
    """The name under which ``model.forward`` takes its cache (generate() picks it by name too)."""
    return (
        "cache_params"
        if accepts(model, "cache_params") and not accepts(model, "past_key_values")
        else ("past_key_values")
    )


def _placement(model) -> tuple:
    """The (dtype, device) pairs of the model's parameters: what ``.to()``/``.half()`` change.
    Memoised on the model's walk while no parameter's address or dtype changed (``.to()`` gives
    every converted parameter new storage, which an allocator may place where the old storage
    was: the dtype tells those apart): one read per parameter, no ``str`` of each."""
    w = walk(model)
    addresses = (tuple(map(DATA_PTR, w.params)), tuple(map(DTYPE, w.params)))
    memo = w.memo.get("placement")
    if memo is not None and memo[0] == addresses:
        return memo[1]
    placement = tuple(sorted({(str(p.dtype), str(p.device)) for p in w.params}))
    w.memo["placement"] = (addresses, placement)
    return placement


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
    """Per-layer KV shapes and recurrent-state shapes, read off a one-token probe forward
    (DeepSeek-V4: a longer one, ``_compressed_layout``).

    A probe is exact for every family (GQA, explicit head_dim, K/V dims that differ, layers
    dispatched to several devices, conv kernels and state sizes) where reading config fields
    would need a case per family. Memoised per model and per parameter placement, so a model
    moved to another dtype or device after its first call is probed again (one read of each
    parameter's address per call).
    """
    placement = _placement(model)
    with _lock:
        cached = _specs.get(model)
    if cached is not None and cached[0] == placement:
        return cached[1]
    check_supported(model)
    text_config = model.config.get_text_config(decoder=True)
    compressed = _compressed_classes()
    if compressed and any(type(layer) in compressed for layer in DynamicCache(config=text_config).layers):
        layout = _compressed_layout(model, text_config, compressed)
    else:
        layout = _probed_layout(model, text_config)
    with _lock:
        _specs[model] = (placement, layout)
    return layout


def _probed_layout(model, text_config) -> ModelLayout:
    """``model_layout`` of every family but DeepSeek-V4: one token through a probe cache."""
    probe = _ProbeCache(config=text_config)
    if all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in probe.layers):
        probe = DynamicCache()  # plain KV: full layers, as RadixCache keeps them
    arg = cache_arg(model)
    token = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    model(input_ids=token, **{arg: probe}, use_cache=True)
    kinds, specs, kv_layers, entries, state_specs = [], [], [], [], []
    index_layers, index_specs, index_positions = [], [], None
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
        if isinstance(layer, DynamicIndexedLayer) and layer.is_indexer_initialized:
            keys = layer.indexer_keys  # [1, 1, index_head_dim]
            dim = keys.shape[-1]
            if keys.dim() != 3 or keys.shape[1] != 1 or dim < 2:
                raise _refuse(
                    model, f"layer {i} wrote indexer keys of shape {tuple(keys.shape)} for one token"
                )
            index_layers.append(i)
            index_specs.append(LayerSpec(1, -(-dim // 2), dim // 2, keys.dtype, keys.device))
        if getattr(layer, "indexer_position_ids", None) is not None:
            index_positions = i
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
    return ModelLayout(
        kinds=tuple(kinds),
        specs=tuple(specs + index_specs),
        kv_layers=tuple(kv_layers),
        state_entries=tuple(entries),
        state_specs=tuple(state_specs),
        index_layers=tuple(index_layers),
        index_positions=index_positions,
        cache_arg=arg,
        continues_in_chunks=chunks,
    )


def _compressed_layout(model, text_config, classes: tuple[type, ...]) -> ModelLayout:
    """DeepSeek-V4 (docs/models.md#deepseek-v4): every layer a sliding K=V window; CSA / HCA
    layers add compressors, whose windows of ``compress_rate`` tokens each emit one entry.

    Read off a probe of lcm(rates) + 1 tokens through stock's own cache: every compressor has
    closed a window (entries, CSA overlap) and holds one token in its buffer, so each tensor's
    shape and dtype is the model's own. Per token in the block pool: each compressed layer's
    entries, spread over their windows' tokens (``hf_patch.layer.CompressedLayer``). The
    snapshot: every layer's window of ``sliding_window - 1`` keys and each CSA compressor's
    overlap (kv, gate). At multiples of the grain every buffer is empty, so that is all the
    state there is; snapshots (and so reuse) are restricted to them.
    """
    probe = DynamicCache(config=text_config)
    grain = math.lcm(*(layer.compress_rate for layer in probe.layers if type(layer) in classes))
    token = torch.zeros(1, grain + 1, dtype=torch.long, device=model.device)
    model(input_ids=token, past_key_values=probe, use_cache=True)  # no_grad: model_layout's
    specs, kv_layers, compressors, entries, state_specs, windows = [], [], [], [], [], set()
    for i, layer in enumerate(probe.layers):
        if not isinstance(layer, DynamicSlidingWindowLayer) or layer.keys is None or layer.keys.shape[1] != 1:
            raise _refuse(
                model,
                f"layer {i} keeps {type(layer).__name__}, where radixkv serves DeepSeek-V4 sliding-window "
                "layers with one shared K=V head",
            )
        keys, window = layer.keys, layer.sliding_window
        if window < 2:
            raise _refuse(model, f"has a sliding window of {window}: no key is kept between forwards")
        windows.add(window)
        entries.append((i, "window", 0))
        state_specs.append(StateSpec((1, window - 1, keys.shape[3]), keys.dtype, keys.device))
        comps, offset, overlaps = [], 0, 0
        for name in tuple(layer.compressed_kv) if type(layer) in classes else ():
            rate, entry = layer.compress_rate, layer.compressed_kv[name]  # [1, n // rate, entry_dim]
            buffer = layer.buffer_kv[name]  # [1, n % rate = 1, proj_dim]
            overlap = getattr(layer, "overlap_kv", {}).get(name)  # CSA: [1, rate, overlap_dim]
            if entry.dtype != keys.dtype:
                raise _refuse(
                    model,
                    f"layer {i}'s {name} emits {entry.dtype} entries for {keys.dtype} keys; radixkv's "
                    "block pool holds one dtype per layer",
                )
            share = -(-entry.shape[-1] // rate)
            comps.append(
                CompressorSpec(
                    name, rate, entry.shape[-1], buffer.shape[-1], 0 if overlap is None else overlap.shape[-1],
                    share, offset, buffer.dtype, buffer.device,
                )
            )  # fmt: skip
            offset += share
            if overlap is not None:
                for part in (overlap, layer.overlap_gate[name]):
                    entries.append((i, "overlap", overlaps))
                    state_specs.append(_state_spec(part))
                    overlaps += 1
        compressors.append(tuple(comps))
        if comps:  # the packed entries, split over the pool's two tensors (CompressedLayer.width)
            width = max(2, offset)
            kv_layers.append(i)
            specs.append(LayerSpec(1, (width + 1) // 2, width // 2, keys.dtype, keys.device))
    if len(windows) != 1:
        raise _refuse(model, f"has layers of sliding windows {sorted(windows)}, where one mask serves all")
    return ModelLayout(
        kinds=("compressed",) * len(probe.layers),
        specs=tuple(specs),
        kv_layers=tuple(kv_layers),
        state_entries=tuple(entries),
        state_specs=tuple(state_specs),
        cache_arg="past_key_values",
        continues_in_chunks=True,
        compressors=tuple(compressors),
        sliding_window=windows.pop(),
        snapshot_grain=grain,
        padding_dependent=True,
    )


def layer_specs(model) -> tuple[LayerSpec, ...]:
    """The block pool's layers for ``model``: the KV shapes of its KV-bearing layers, in order."""
    return model_layout(model).specs


def check_store_fits(store: KVStore, model, layout: ModelLayout | None = None) -> None:
    """Refuse, naming the difference, a store shaped for another model (``layout``: its
    ``model_layout`` if the caller has it already)."""
    layout = model_layout(model) if layout is None else layout
    specs = layout.specs
    if store.block_size % layout.snapshot_grain:
        raise ValueError(
            f"this KVStore's block size ({store.block_size}) is not a multiple of {layout.snapshot_grain}, "
            f"which {type(model).__name__} needs (its compression windows must not straddle blocks)"
        )
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
