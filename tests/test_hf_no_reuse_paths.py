"""generate() paths where prefix reuse cannot apply: they must still equal stock generate(),
report zero cached tokens for every row, and leave the store consistent and untouched."""

from __future__ import annotations

import pytest
import torch

import hf_patch
from tests.hf_models import (
    assert_same_as_stock,
    build,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    store_for,
    tokens,
)

BS = 4
PROMPT = tokens(41, seed=80)


def warm():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    return model, store, store.stats()


def assert_store_untouched(store, before):
    after = store.stats()
    assert after["hit_tokens"] == before["hit_tokens"]
    assert after["cached_blocks"] == before["cached_blocks"]
    assert after["pinned_blocks"] == 0
    store.check_invariants()


@pytest.mark.parametrize("kind", ["assistant_model", "prompt_lookup"])
def test_assisted_decoding(kind):
    model, store, before = warm()
    if kind == "assistant_model":
        extra = {"assistant_model": build("llama-sdpa", seed=5)}  # same vocab, other weights
    else:
        extra = {"prompt_lookup_num_tokens": 3}
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store, max_new_tokens=8, **extra)
    assert_store_untouched(store, before)
    # A normal call afterwards still reuses the store.
    later, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert later.cached_tokens == [40]
    # One entry per row, like every other call ([] would break `cached_tokens[0]` in a server).
    assert cache.cached_tokens == [0]


def test_inputs_embeds():
    model, store, before = warm()
    embeds = model.get_input_embeddings()(ids(PROMPT)).detach()
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    reference = model.generate(inputs_embeds=embeds, **kwargs)
    cache = hf_patch.RadixCache(store=store)
    out = model.generate(inputs_embeds=embeds, past_key_values=cache, **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    for a, b in zip(out.logits, reference.logits):
        assert (a - b).abs().max().item() <= 1e-5
    assert_store_untouched(store, before)
    assert cache.cached_tokens == [0]


def test_inputs_embeds_batch():
    model, store, before = warm()
    embeds = model.get_input_embeddings()(ids(PROMPT, PROMPT[::-1])).detach()
    kwargs = dict(max_new_tokens=4, do_sample=False)
    reference = model.generate(inputs_embeds=embeds, **kwargs)
    cache = hf_patch.RadixCache(store=store)
    out = model.generate(inputs_embeds=embeds, past_key_values=cache, **kwargs)
    assert torch.equal(out, reference)
    assert_store_untouched(store, before)
    assert cache.cached_tokens == [0, 0]


def test_prompt_hidden_states_are_those_of_the_whole_prompt():
    """output_hidden_states / output_attentions describe every prompt token in stock generate();
    with reuse the first step would only cover the uncached suffix, a silently different output."""
    model, store, _ = warm()
    kwargs = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_hidden_states=True)
    reference = model.generate(ids(PROMPT), **kwargs)
    out = model.generate(ids(PROMPT), past_key_values=hf_patch.RadixCache(store=store), **kwargs)
    assert torch.equal(out.sequences, reference.sequences)
    for step, (ours, theirs) in enumerate(zip(out.hidden_states, reference.hidden_states)):
        for layer, (a, b) in enumerate(zip(ours, theirs)):
            assert a.shape == b.shape, (
                f"step {step} layer {layer}: {tuple(a.shape)} vs stock {tuple(b.shape)}"
            )
            assert (a - b).abs().max().item() <= 1e-5
