"""Which PEFT adapter computes each row's KV: the adapter part of the cache key.

A LoRA (DoRA, IA3, LoHa, LoKr, ...) adapter that is not merged changes every token's K and V, so
the KV of one prompt differs per adapter. PEFT injects tuner layers (``BaseTunerLayer``) into the
transformers model itself; generate() runs on that model, so the wrapper sees them here:

- the active adapters (``set_adapter``), or none inside ``with model.disable_adapter():``;
- ``adapter_names=[...]`` (mixed-adapter batches): PEFT's generate pops the argument and hands it
  to every tuner layer through a forward pre-hook; the per-row names are read from that hook;
- each adapter's **weights digest**: sha256 over its parameters' bytes and its plain settings
  (rank, alpha, scaling, dora...), layer by layer. An adapter deleted and re-created under the
  same name with other weights gets another digest. Digests are cached per parameter object and
  autograd version, and per adapter on the model's walk (hf_patch.keys.model_walk) until one of its
  tensors (version, address) or settings changes: a call reads flat lists, walks no modules.

Merging (``merge_adapter``) writes the adapter into the base weights through ``.data``, which no
version counter sees: the merged adapter lists are part of the weights fingerprint
(hf_patch.keys.weights), so a merge or unmerge flushes the store like any other weight change.

Prompt learning (prompt tuning, p-tuning, prefix tuning) replaces the model's
``prepare_inputs_for_generation``: ``unkeyable_reason`` names it, and the call then runs without
reuse. Not seen: forward hooks or patched ``forward`` methods that change activations (steering);
pass no RadixCache for such calls, or a namespace of their own.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import threading
import weakref

import torch

from hf_patch.keys.model_walk import Walk, tensor_state, walk
from hf_patch.keys.peft_layers import (  # noqa: F401  (re-exported: their home before peft_layers)
    _base_part,
    _tuner_type,
    adapter_tensors,
    is_adapter_holder,
    is_tuner_layer,
)

BASE = "__base__"  # PEFT's name for "no adapter" in adapter_names


_PLAIN = (int, float, str, bool, type(None))
# id(tensor) -> (weakref to it, (version, data_ptr), digest). Not a WeakKeyDictionary: tensors
# compare elementwise, so a dictionary keyed by them cannot resolve a hash collision.
_digests: dict[int, tuple] = {}
_lock = threading.Lock()


def tuner_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """``(qualified name, layer)`` of every PEFT tuner layer in ``model``, in module order."""
    if _tuner_type() is None:
        return []
    return list(walk(model).tuners)


def adapter_holders(model) -> list[tuple[str, torch.nn.Module]]:
    """Every adapter holder (``is_adapter_holder``) in ``model``, in module order."""
    if _tuner_type() is None:
        return []
    return list(walk(model).holders)


def base_named_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """``model``'s parameters without any adapter's, named as in the model without PEFT
    (``q_proj.base_layer.weight`` -> ``q_proj.weight``, ``embed_tokens.original_module.weight``
    -> ``embed_tokens.weight``): the base model's weights, whatever adapters are loaded."""
    layers = adapter_holders(model)
    skip = {id(p) for _, layer in layers for _, p in adapter_tensors(layer)}
    # Longest first: a layer wrapped inside another's wrapped module is renamed inside out.
    wrapped = sorted((f"{name}.{_base_part(layer)}." for name, layer in layers), key=len, reverse=True)
    out = []
    for name, p in model.named_parameters():
        if id(p) in skip:
            continue
        changed = True
        while changed:  # a wrapper may wrap a wrapped layer
            changed = False
            for prefix in wrapped:
                if name.startswith(prefix):
                    name = prefix[: prefix.rstrip(".").rindex(".") + 1] + name[len(prefix) :]
                    changed = True
                    break
        out.append((name, p))
    return out


def adapter_names(model) -> list[str]:
    """Every adapter some tuner layer of ``model`` holds, in first-seen order."""
    names: list[str] = []
    for _, layer in tuner_layers(model):
        for attr in layer.adapter_layer_names:
            for name in getattr(layer, attr, {}) or {}:
                if name not in names:
                    names.append(name)
    return names


def adapter_digests(model) -> dict[str, str]:
    """``{adapter name: weights digest}`` for every adapter ``model`` holds now (the digests its
    rows are keyed by)."""
    w = walk(model)
    return {name: adapter_digest(w, name) for name in adapter_names(model)}


def unwrap_peft(model):
    """The transformers model a PEFT wrapper runs, its tuner layers injected (the model PEFT's
    generate() calls, so its KV is keyed by the same model scope), or ``model`` itself: not a
    PEFT wrapper, or prompt learning, whose wrapper's own forward adds virtual tokens."""
    config = getattr(model, "active_peft_config", None)
    if config is not None and hasattr(model, "get_base_model") and not config.is_prompt_learning:
        return model.get_base_model()
    return model


def _forget(ref: weakref.ref, ident: int) -> None:
    with _lock:
        if ident in _digests and _digests[ident][0] is ref:
            del _digests[ident]


def _tensor_digest(t: torch.Tensor) -> bytes:
    """sha256 of ``t``'s dtype, shape and bytes; recomputed only after ``t`` changed."""
    key = (t._version, t.data_ptr())
    with _lock:
        cached = _digests.get(id(t))
    if cached is not None and cached[0]() is t and cached[1] == key:
        return cached[2]
    data = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{data.dtype}|{tuple(data.shape)}|".encode())
    h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    digest = h.digest()
    ident = id(t)
    ref = weakref.ref(t, lambda r: _forget(r, ident))
    with _lock:
        _digests[ident] = (ref, key, digest)
    return digest


def _adapter_digest(layers: list[tuple[str, torch.nn.Module]], adapter: str) -> str:
    """sha256 over ``adapter``'s tensors and plain settings in every tuner layer or wrapper
    (``adapter_holders``) holding it."""
    h = hashlib.sha256()
    for name, layer in layers:
        for tname, t in adapter_tensors(layer):
            if adapter in tname.split("."):
                h.update(f"{name}.{tname}|".encode())
                h.update(_tensor_digest(t))
        for attr, value in sorted(vars(layer).items()):
            if isinstance(value, dict) and adapter in value:
                setting = value[adapter]
                shown = repr(setting) if isinstance(setting, _PLAIN) else type(setting).__qualname__
                h.update(f"{name}.{attr}={shown}|".encode())
    return h.hexdigest()[:32]


def adapter_digest(w: Walk, adapter: str) -> str:
    """``_adapter_digest(w.holders, adapter)``, memoised on the walk while the adapter's tensors
    (versions, addresses) and settings (the same dict objects holding the same value objects, no
    attribute added to a holder) are unchanged. O(its tensors + settings), C-level loops."""
    slots = w.memo.get(("settings", adapter))
    if slots is None:
        found = [
            (vars(layer), attr, value)
            for _, layer in w.holders
            for attr, value in sorted(vars(layer).items())
            if isinstance(value, dict) and adapter in value
        ]
        lens = tuple(len(vars(layer)) for _, layer in w.holders)
        slots = w.memo[("settings", adapter)] = (
            (*(tuple(col) for col in zip(*found)), lens) if found else ((), (), (), lens)
        )
    owners, attrs, dicts, lens = slots
    if tuple(len(vars(layer)) for _, layer in w.holders) != lens or not all(
        map(operator.is_, map(dict.get, owners, attrs), dicts)
    ):
        del w.memo[("settings", adapter)]  # an attribute added or replaced: find the settings again
        w.memo.pop(("digest", adapter), None)
        return adapter_digest(w, adapter)
    try:
        values = tuple(map(operator.itemgetter(adapter), dicts))
    except KeyError:  # a setting of the adapter removed
        del w.memo[("settings", adapter)]
        w.memo.pop(("digest", adapter), None)
        return adapter_digest(w, adapter)
    tensors = tensor_state(w.adapter_tensors.get(adapter, ()))
    cached = w.memo.get(("digest", adapter))
    if cached is not None and cached[0] == tensors and all(map(operator.is_, cached[1], values)):
        return cached[2]
    digest = _adapter_digest(w.holders, adapter)
    w.memo[("digest", adapter)] = (tensors, values, digest)
    return digest


def _hook_adapter_names(layers) -> list[str] | None:
    """The ``adapter_names`` PEFT's generate handed its tuner layers through a pre-hook, or None."""
    for _, layer in layers:
        for hook in layer._forward_pre_hooks.values():
            if isinstance(hook, functools.partial) and "adapter_names" in (hook.keywords or {}):
                return list(hook.keywords["adapter_names"])
    return None


def unkeyable_reason(model) -> str | None:
    """Why this call's KV may depend on something the key cannot see, or None."""
    if "prepare_inputs_for_generation" in vars(model):
        owner = type(getattr(model.prepare_inputs_for_generation, "__self__", None)).__name__
        return (
            f"prepare_inputs_for_generation is replaced by {owner} (PEFT prompt learning?): the inputs "
            "the model receives cannot be seen"
        )
    return None


def mixed_batch(model) -> bool:
    """Whether PEFT runs this call with ``adapter_names`` (one adapter per row). Forwards over
    fewer rows (in-batch sharing's one-row prefix forwards) would then fail or use the wrong
    adapter."""
    return _hook_adapter_names(tuner_layers(model)) is not None


def row_adapters(model, num_rows: int, rows_per_prompt: int = 1) -> list[tuple]:
    """Each row's adapter key parts: ``()`` for the base model, else
    ``("adapter", name, digest, ...)`` for the adapter(s) computing it.

    Raises ValueError when ``adapter_names`` has neither one entry per row nor per prompt.
    """
    if _tuner_type() is None:
        return [()] * num_rows
    w = walk(model)
    layers = w.tuners
    if not layers:
        return [()] * num_rows
    if any(layer.disable_adapters for _, layer in layers):
        return [()] * num_rows
    digests: dict[str, str] = {}

    def key(names) -> tuple:
        names = [n for n in names if n != BASE]
        if not names:
            return ()
        for n in names:
            if n not in digests:
                digests[n] = adapter_digest(w, n)
        return ("adapter", *(part for n in names for part in (n, digests[n])))

    per_row = _hook_adapter_names(layers)
    if per_row is not None:
        if len(per_row) * rows_per_prompt == num_rows:
            per_row = [n for n in per_row for _ in range(rows_per_prompt)]
        if len(per_row) != num_rows:
            raise ValueError(
                f"adapter_names has {len(per_row)} entries for {num_rows} rows "
                f"({num_rows // max(1, rows_per_prompt)} prompts)"
            )
        return [key([n]) for n in per_row]
    active = []
    for _, layer in layers:
        for n in layer.active_adapters:
            if n not in active and n not in layer.merged_adapters:
                active.append(n)
    return [key(active)] * num_rows
