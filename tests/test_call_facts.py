"""What a cached generate() call recomputes about its model: the forward's argument names are
read once per forward function (hf_patch.forward_args), and an instance-level forward (a
wrapper, accelerate's hooks) is read on its own."""

from __future__ import annotations

import inspect

import torch

import hf_patch
from hf_patch.forward_args import forward_parameters
from hf_patch.model_spec import accepts, cache_arg
from tests.hf_models import (
    assert_same_as_stock,
    build,
    expected_full_hit,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    store_for,
    tokens,
)

BS = 4
PROMPT = tokens(26, seed=4302)


def test_a_cached_call_reads_no_signature(monkeypatch):
    model = build("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    calls = []
    original = inspect.signature

    def counting(obj, *args, **kwargs):
        calls.append(obj)
        return original(obj, *args, **kwargs)

    monkeypatch.setattr(inspect, "signature", counting)
    stock = len(calls)
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        model.generate(ids(PROMPT), past_key_values=cache, max_new_tokens=3, do_sample=False)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    # stock generate() reads signatures of its own (model.forward for model inputs); hf_patch's
    # questions (cache argument, keyed inputs, mm_encoder_outputs) add none of them
    ours = [c for c in calls[stock:] if getattr(c, "__name__", "") == "forward"]
    calls.clear()
    with torch.no_grad():
        model.generate(ids(PROMPT), max_new_tokens=3, do_sample=False)
    assert len(ours) == len([c for c in calls if getattr(c, "__name__", "") == "forward"])


def test_an_instance_forward_is_read_on_its_own():
    model = build("llama-sdpa")
    assert accepts(model, "past_key_values") and cache_arg(model) == "past_key_values"
    original = model.forward

    def wrapper(input_ids=None, cache_params=None, **kwargs):  # a forward of another shape
        return original(input_ids=input_ids, **kwargs)

    model.forward = wrapper
    try:
        assert forward_parameters(model) == frozenset({"input_ids", "cache_params", "kwargs"})
        assert cache_arg(model) == "cache_params"
    finally:
        del model.forward
    assert cache_arg(model) == "past_key_values"
    assert "logits_to_keep" in forward_parameters(model)
