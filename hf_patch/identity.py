"""A model's identity: what a cached block's KV depends on beyond its key tokens, in one place.

Imported by everything that must tell two models apart across processes: the store builder,
the cache files (``hf_patch.cache_files``) and the sidecar client (``radixkv.sidecar``).

- ``model_identity(model)``: ``model_class`` (module and name of the class), ``config_sha256``
  (the config without fields that do not change the KV: paths, versions, output flags; the dtype
  is part of the layout) and ``weights_sha256`` (per base parameter, sorted by name: its name,
  dtype, shape and a sample of up to ``WEIGHT_SAMPLE`` elements at fixed, evenly spaced
  positions). A fine-tune or another checkpoint changes every element of the tensors it touches,
  so a few thousand per tensor tell them apart; an edit of single elements between the sampled
  ones is not seen. Cost: one small gather per parameter, no pass over the weights. PEFT adapter
  parameters are left out (``hf_patch.keys.adapters.base_named_parameters``): each adapter's KV
  sits under a namespace carrying its name and weights digest. Cache files store this dict as
  it is (their format depends on its three fields).
- ``kv_layout(specs, block_size, state_specs)``: block size and per-layer KV shapes and dtypes
  (devices left out), plus the recurrent-state snapshot tensors' shapes and dtypes for a model
  with recurrent layers: the layout cache files check too.
- ``identity_digest(identity, layout)``: 32 bytes naming both, the root of a model's keys in a
  sidecar (two models, or one model before and after a weight change, never share a block).
- ``current_identity(model)``: ``model_identity`` memoised per model until its weights change
  (``hf_patch.keys.weights.fingerprint``): the sidecar client asks on every request.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections.abc import Sequence

import torch

from hf_patch.keys.adapters import base_named_parameters
from hf_patch.keys.weights import fingerprint
from radixkv import LayerSpec, StateSpec

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

_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (fingerprint, identity)
_lock = threading.Lock()


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


def kv_layout(specs: Sequence[LayerSpec], block_size: int, state_specs: Sequence[StateSpec] = ()) -> dict:
    """Block size and per-layer KV shapes as JSON (devices left out): what a block's bytes mean;
    for a model with recurrent layers also ``states``, the shape and dtype of each snapshot
    tensor (``hf_patch.model_spec.ModelLayout.state_specs``). Equal to the layout a cache file
    of the model's store holds (``radixkv.persist.manifest.layout_of``). A model without
    recurrent layers gets the dict it always got (no ``states`` key): its identity digest, the
    sidecar keys built on it and its cache files stay valid."""
    out = {
        "block_size": block_size,
        "layers": [
            {
                "num_kv_heads": s.num_kv_heads,
                "k_head_dim": s.k_head_dim,
                "v_head_dim": s.v_head_dim,
                "dtype": str(s.dtype).removeprefix("torch."),
            }
            for s in specs
        ],
    }
    if state_specs:
        out["states"] = [
            {"shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch.")} for s in state_specs
        ]
    return out


def identity_digest(identity: dict, layout: dict) -> bytes:
    """32 bytes naming a model identity and a KV layout together (sha256 of canonical JSON)."""
    text = json.dumps({"identity": identity, "layout": layout}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


def current_identity(model) -> dict[str, str]:
    """``model_identity(model)``, recomputed only after the weights changed (O(parameters) check)."""
    now = fingerprint(model)
    with _lock:
        memo = _memo.get(model)
    if memo is not None and memo[0] == now:
        return memo[1]
    identity = model_identity(model)
    with _lock:
        _memo[model] = (now, identity)
    return identity
