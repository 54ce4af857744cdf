"""One walk over a model's modules, kept until its structure changes: the per-call checks
(weights fingerprint, adapter keys, parameter placement) read flat lists instead of walking
``model.modules()`` on every generate() call.

A walk lists every parameter once (``model.parameters()`` order) with the slot holding it
(``owner._parameters``, name), the base parameters (those of no adapter), PEFT's adapter
holders and tuner layers, and each adapter's tensors. It is rebuilt when it may no longer
describe the model:

- a module, parameter, or PEFT-owned buffer was registered on one of the modules of a kept walk
  since it was built (torch's global registration hooks: ``module.x = Module/Parameter``,
  ``register_parameter``, ``ModuleDict[k] = m``: PEFT's injection, ``load_adapter``, ``unload``,
  tied weights, ``load_state_dict(assign=True)``). Registrations on other modules are ignored:
  Llama's forward slices ``self.layers[:n]``, which builds a new ModuleList on every call;
- a parameter slot no longer holds the listed parameter (``Module._apply`` replaces parameters in
  place of ``param.data = ...`` under ``torch.__future__.set_overwrite_module_params_on_conversion``,
  which no hook sees);
- the number of child modules changed (a deletion: ``del module.x``, PEFT's ``delete_adapter``,
  which no hook sees either).

Validating a walk costs one C-level pass over the parameter slots and the child-module dicts
(``intact``): ~15 us for 219 parameters / 319 modules, ~50 us with LoRA on every linear layer
(555 parameters, 1,999 modules) on this project's 2-core machine, against 1.2 ms / 13 ms for the
walk itself. Not seen (documented in docs/generate.md): a child module replaced by writing
``module._modules[name]`` directly with another module, leaving the count unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import threading
import weakref

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from hf_patch.keys.peft_layers import adapter_tensors, is_adapter_holder, is_tuner_layer

_counter = itertools.count(1)
_structure = 0  # bumped by every registration on a watched module
# id(walk) -> ids of the modules it lists: a registration on one of them bumps _structure. An id
# reused by a new object after its module died only costs a needless rebuild.
_watched: dict[int, frozenset[int]] = {}
_walks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Walk
_lock = threading.Lock()
_hooks: list = []

VERSION = operator.attrgetter("_version")
DATA_PTR = torch.Tensor.data_ptr
DTYPE = operator.attrgetter("dtype")


def _bump(module, _name, _value) -> None:
    global _structure
    key = id(module)
    for ids in tuple(_watched.values()):
        if key in ids:
            _structure = next(_counter)
            return


def _bump_for_peft_buffers(module, name, buffer) -> None:
    # Base buffers are no part of any key (rotary tables are re-registered by some models on
    # every forward: counting them would rebuild the walk each call); an adapter's are.
    if type(module).__module__.startswith("peft"):
        _bump(module, name, buffer)


def watch_structure() -> None:
    """Register the global registration hooks once (idempotent; hf_patch.install calls it)."""
    with _lock:
        if not _hooks:
            _hooks.append(register_module_module_registration_hook(_bump))
            _hooks.append(register_module_parameter_registration_hook(_bump))
            _hooks.append(register_module_buffer_registration_hook(_bump_for_peft_buffers))


@dataclasses.dataclass(eq=False)
class Walk:
    """What one pass over ``model.modules()`` found. Owns nothing: the lists reference the
    model's own dicts, modules and tensors (never the model object itself: no cycle through
    the WeakKeyDictionary that holds walks)."""

    structure: int  # _structure when the walk began
    slots: tuple[tuple[dict, str], ...]  # each parameter's (owner._parameters, name)
    params: tuple[torch.nn.Parameter, ...]  # every parameter once, model.parameters() order
    base: tuple[torch.nn.Parameter, ...]  # params minus every adapter holder's own tensors
    children: tuple[dict, ...]  # every module's _modules (a deletion shrinks their sizes)
    num_children: int
    holders: tuple[tuple[str, torch.nn.Module], ...]  # adapter holders (tuner layers + wrappers)
    tuners: tuple[tuple[str, torch.nn.Module], ...]  # tuner layers, module order
    # adapter name -> its tensors in every holder, in the order the adapter digest hashes them
    adapter_tensors: dict[str, tuple[torch.Tensor, ...]]
    memo: dict = dataclasses.field(default_factory=dict)  # per-walk caches (adapter digests)

    def intact(self) -> bool:
        """Whether the model still has this structure (see the module docstring). O(parameters
        + modules), C-level loops."""
        return (
            _structure == self.structure
            and sum(map(len, self.children)) == self.num_children
            and all(map(operator.is_, map(_slot_value, self.slots), self.params))
        )


def _slot_value(slot: tuple[dict, str]):
    return slot[0].get(slot[1])


def walk(model) -> Walk:
    """``model``'s current walk, rebuilt when it is not ``intact``."""
    if not _hooks:  # a walk nothing would invalidate must not be kept
        watch_structure()
    found = _walks.get(model)
    if found is not None and found.intact():
        return found
    fresh = _build(model)
    with _lock:
        _walks[model] = fresh
    return fresh


def _build(model) -> Walk:
    structure = _structure  # read first: a registration during the walk makes it stale at once
    modules = list(model.named_modules())
    holders = tuple((name, m) for name, m in modules if is_adapter_holder(m))
    tuners = tuple((name, m) for name, m in holders if is_tuner_layer(m))
    owned: dict[int, torch.Tensor] = {}
    per_adapter: dict[str, list[torch.Tensor]] = {}
    for _, layer in holders:
        for tname, t in adapter_tensors(layer):
            owned[id(t)] = t
            for part in tname.split("."):
                per_adapter.setdefault(part, []).append(t)
    seen: set[int] = set()
    slots, params, base = [], [], []
    for _, module in modules:
        for key, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            slots.append((module._parameters, key))
            params.append(p)
            if id(p) not in owned:
                base.append(p)
    children = tuple(m._modules for _, m in modules)
    built = Walk(
        structure=structure,
        slots=tuple(slots),
        params=tuple(params),
        base=tuple(base),
        children=children,
        num_children=sum(map(len, children)),
        holders=holders,
        tuners=tuners,
        adapter_tensors={name: tuple(ts) for name, ts in per_adapter.items()},
    )
    _watched[id(built)] = frozenset(id(m) for _, m in modules)
    weakref.finalize(built, _watched.pop, id(built), None)
    return built


def tensor_state(tensors) -> tuple:
    """Versions, storage addresses and dtypes of ``tensors``: what any write or replacement of
    their data changes. ``param.data = x`` (what ``.to()`` / ``.half()`` do) keeps the version
    and usually changes the address, but an allocator may hand the new data the address the old
    data just freed (CUDA's caching allocator, same sizes: ``.half()`` then ``.bfloat16()``): the
    dtype tells those apart."""
    return tuple(map(VERSION, tensors)), tuple(map(DATA_PTR, tensors)), tuple(map(DTYPE, tensors))
