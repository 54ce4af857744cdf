"""Weight changes seen without walking the model on every call (hf_patch.keys.model_walk).

Every way training or surgery changes what the model computes must stop stale KV from being
served: each test caches a prompt, mutates the model, and checks the next call equals stock
generate() of the mutated model with nothing read from the store. And a call on an unchanged
model walks no modules (the per-call checks read the kept walk's flat lists).
"""

from __future__ import annotations

import sys

import pytest
import torch

peft = pytest.importorskip("peft")  # a dev dependency: CI always has it
from peft import LoraConfig, get_peft_model  # noqa: E402

import hf_patch  # noqa: E402
from hf_patch.keys import model_walk  # noqa: E402
from tests.hf_models import (  # noqa: E402
    assert_same_as_stock,
    build,
    expected_full_hit,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    store_for,
    tokens,
)

BS = 4
PROMPT = tokens(26, seed=4301)
FULL = expected_full_hit(len(PROMPT), BS)


def _cached_then(model, mutate, *, flushes: int | None = 1):
    """Cache PROMPT, check a repeat hits, mutate, check the next call is stock's and hits nothing,
    and (``flushes``) how many times the store was flushed by it."""
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert cache.cached_tokens == [FULL]
    before = store.stats()["flushes"]
    mutate(model)
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert cache.cached_tokens == [0]
    if flushes is not None:
        assert store.stats()["flushes"] == before + flushes
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)  # the new weights' own KV is reused
    assert cache.cached_tokens == [FULL]
    return store


def _first(model, part: str) -> torch.nn.Parameter:
    return next(p for n, p in model.named_parameters() if part in n)


def _sgd_step(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids(PROMPT), labels=ids(PROMPT)).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _foreach_adamw_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model(ids(PROMPT), labels=ids(PROMPT)).loss.backward()
    optimizer.step()


def _copy_under_no_grad(model):
    with torch.no_grad():
        p = _first(model, "layers.1.self_attn.k_proj")
        p.copy_(torch.randn_like(p))


def _load_state_dict(model):
    model.load_state_dict(build("llama-sdpa", seed=7).state_dict())


def _load_state_dict_assign(model):
    model.load_state_dict(build("llama-sdpa", seed=7).state_dict(), assign=True)


def _set_data(model):
    p = _first(model, "layers.0.self_attn.v_proj")
    p.data = torch.randn_like(p)  # new storage, version unchanged


def _parameter_replaced(model):
    layer = model.model.layers[0].self_attn.q_proj
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))


def _slot_written_directly(model):
    # What Module._apply does under set_overwrite_module_params_on_conversion: no hook sees it.
    layer = model.model.layers[1].mlp.up_proj
    layer._parameters["weight"] = torch.nn.Parameter(torch.randn_like(layer.weight))


@pytest.mark.parametrize(
    "mutate",
    [
        _sgd_step,
        _foreach_adamw_step,
        _copy_under_no_grad,
        _load_state_dict,
        _load_state_dict_assign,
        _set_data,
        _parameter_replaced,
        _slot_written_directly,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_a_base_weight_change_is_never_served_stale(mutate):
    _cached_then(build("llama-sdpa"), mutate)


def test_a_dtype_change_gets_a_store_of_its_own():
    """``.to(dtype)``: the default store is replaced (its KV has the old dtype)."""
    model = build("llama-sdpa")
    full = expected_full_hit(len(PROMPT), 16)  # the default store's block size
    for dtype, expect in (
        (torch.float32, 0),
        (torch.float32, full),
        (torch.float64, 0),
        (torch.float64, full),
    ):
        model.to(dtype)
        cache, _ = assert_same_as_stock(model, ids(PROMPT))
        assert cache.cached_tokens == [expect]
        assert hf_patch.default_store(model).pool.layers[0].dtype == dtype


def _lora_model():
    torch.manual_seed(11)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(build("llama-sdpa"), config).eval()


def _adapter_step(model):
    """A LoRA training step as TRL takes it: only the adapter's parameters are trained."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(input_ids=ids(PROMPT), labels=ids(PROMPT)).loss.backward()
    optimizer.step()


def _adapter_copy(model):
    with torch.no_grad():
        p = _first(model, "lora_B.default")
        p.copy_(torch.randn_like(p))


def _adapter_rescaled(model):
    for _, layer in hf_patch.keys.adapters.tuner_layers(model.get_base_model()):
        layer.scaling["default"] = layer.scaling["default"] * 3  # what LoraLayer.set_scale writes


def _merge(model):
    model.merge_adapter()


@pytest.mark.parametrize(
    ("mutate", "flushes"),
    [(_adapter_step, 0), (_adapter_copy, 0), (_adapter_rescaled, 0), (_merge, 1)],
    ids=["optimizer-step", "copy_", "scaling", "merge"],
)
def test_an_adapter_change_is_never_served_stale(mutate, flushes):
    """Adapter weights are keyed by their digest: a trained adapter misses its old prefixes
    without flushing the base model's; a merge writes the base weights and flushes."""
    _cached_then(_lora_model(), mutate, flushes=flushes)


def _count_walks(monkeypatch) -> list:
    """Calls of ``named_modules`` made from hf_patch (stock generate() makes its own: ``model.device``
    is ``next(model.parameters())``)."""
    calls = []
    original = torch.nn.Module.named_modules

    def counting(self, *args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.endswith("torch/nn/modules/module.py"):
            frame = frame.f_back  # the recursion, parameters(), named_parameters()
        if frame is not None and "/hf_patch/" in frame.f_code.co_filename.replace("\\", "/"):
            calls.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "named_modules", counting)
    return calls


@pytest.mark.parametrize("with_lora", [False, True], ids=["base", "lora"])
def test_a_call_on_an_unchanged_model_walks_no_modules(monkeypatch, with_lora):
    model = _lora_model() if with_lora else build("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    calls = _count_walks(monkeypatch)
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        model.generate(ids(PROMPT), past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.cached_tokens == [FULL]
    assert calls == []
    _copy_under_no_grad(model.get_base_model() if with_lora else model)  # in place: no walk either
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        model.generate(ids(PROMPT), past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.cached_tokens == [0]
    assert calls == []


def test_the_walk_is_rebuilt_after_any_structural_change():
    model = build("llama-sdpa")
    first = model_walk.walk(model)
    assert model_walk.walk(model) is first
    mlp = model.model.layers[0].mlp
    act = mlp.act_fn
    del mlp.act_fn  # a deletion: no registration hook fires
    second = model_walk.walk(model)
    assert second is not first
    mlp.act_fn = act  # a registration
    third = model_walk.walk(model)
    assert third is not second and model_walk.walk(model) is third
    lora = _lora_model()  # PEFT's injection registers modules
    base = lora.get_base_model()
    walked = model_walk.walk(base)
    assert len(walked.tuners) == 4 and len(walked.adapter_tensors["default"]) == 8
    assert {id(p) for p in walked.base}.isdisjoint(id(t) for t in walked.adapter_tensors["default"])
    lora.delete_adapter("default")  # removes modules from ModuleDicts: children shrink
    assert model_walk.walk(base) is not walked


def test_new_data_of_another_dtype_at_the_old_address_is_seen():
    """``param.data = x`` keeps the version; a caching allocator (CUDA's) may place ``x`` where
    the old data was (``.half()`` then ``.bfloat16()``: same sizes). Here the new data is a view of
    the old storage as another dtype: same address, same version, only the dtype differs."""
    from hf_patch.keys.weights import fingerprint
    from hf_patch.model_spec import _placement

    model = build("llama-sdpa", seed=3).half()
    before, placement = fingerprint(model), _placement(model)
    for p in model.parameters():
        p.data = p.data.view(torch.bfloat16)
    assert fingerprint(model) != before
    assert placement == (("torch.float16", "cpu"),) and _placement(model) == (("torch.bfloat16", "cpu"),)
