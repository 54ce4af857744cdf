"""hf_patch.pin_prompts: task prompts computed once, pinned for good, equal to stock generate()."""

from __future__ import annotations

import pytest
import torch

import hf_patch
from tests.hf_models import (
    assert_same_as_stock,
    block_floor,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    tokens,
)

BS = 4


def same_as_stock(model, input_ids, store, **kwargs):
    """assert_same_as_stock, whose check of zero pins cannot hold beside task pins: ours instead."""
    out = assert_same_as_stock(model, input_ids, store, check_invariants=False, **kwargs)
    store.check_invariants()
    stats = store.stats()
    assert stats["pinned_blocks"] + stats.get("host_pinned_blocks", 0) == (
        stats["task_pinned_blocks"] + stats["task_pinned_host_blocks"]
    ), "a finished request left blocks pinned"
    return out


@pytest.mark.parametrize("family", ("llama-sdpa", "qwen2-sliding", "gemma3-text-sliding"))
@pytest.mark.parametrize("host_tier", (False, True), ids=("device-only", "with-host-tier"))
def test_a_pinned_task_prompt_is_a_full_hit_after_a_flood(family, host_tier):
    model = shared(family)
    store = hf_patch.build_store(
        model, block_size=BS, budget_tokens=96, host_cache_tokens=64 if host_tier else None
    )
    system = tokens(30, seed=400)
    assert hf_patch.pin_prompts(model, {"support": system}, store=store) == {"support": block_floor(30, BS)}
    stats = store.stats()
    assert stats["task_prompts"] == 1 and stats["task_pinned_blocks"] == 30 // BS
    for i in range(8):  # unrelated traffic: far more than the rest of both tiers holds
        same_as_stock(model, ids(tokens(40, seed=410 + i)), store, max_new_tokens=3)
    assert store.stats()["evicted_blocks"] > 0
    question = system + tokens(7, seed=420)
    cache, _ = same_as_stock(model, ids(question), store)
    assert cache.cached_tokens == [block_floor(30, BS)]  # the pinned blocks, computed by a plain forward
    assert store.stats()["task_pinned_blocks"] == 30 // BS


def test_pinning_more_than_the_pool_holds_is_refused_before_computing():
    model = shared("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=32)  # 8 blocks
    big = {"a": tokens(20, seed=430), "b": tokens(16, seed=431)}  # 5 + 4 blocks
    with pytest.raises(ValueError, match="need 9 blocks of 4 tokens .* the device pool has 8 blocks"):
        hf_patch.pin_prompts(model, big, store=store)
    assert store.tasks.ids() == [] and store.stats()["inserted_tokens"] == 0
    shared_prefix = {"a": big["a"], "b": big["a"][:12] + tokens(4, seed=432)}  # 5 + 1 new blocks
    assert hf_patch.pin_prompts(model, shared_prefix, store=store) == {"a": 20, "b": 16}
    assert store.stats()["task_pinned_blocks"] == 6
    with pytest.raises(ValueError, match=r"need 3 blocks .* \(plus 6 pinned by other task prompts\)"):
        hf_patch.pin_prompts(model, {"c": tokens(12, seed=433)}, store=store)
    store.check_invariants()


@pytest.mark.parametrize(
    "prompts, message",
    [
        ({"short": [5, 6]}, "'short': 2 tokens is less than one block of 4"),
        ({"text": "hello there"}, "'text': token ids must be a sequence of ints"),
        ({"floats": torch.ones(8)}, "'floats': token ids must be a 1-D integer tensor"),
        ({"bools": [True] * 8}, "'bools': token ids must be ints"),
    ],
)
def test_malformed_prompts_are_refused_naming_the_task(prompts, message):
    model = shared("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=64)
    with pytest.raises(ValueError, match=message):
        hf_patch.pin_prompts(model, prompts, store=store)
    assert store.tasks.ids() == []


def test_replace_unpin_and_namespaces():
    model = shared("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=64)
    first, second = tokens(16, seed=440), tokens(16, seed=441)
    hf_patch.pin_prompts(model, {"t": first}, store=store, namespace="tenant-a")
    hf_patch.pin_prompts(model, {"t": torch.tensor([second])}, store=store, namespace="tenant-a")
    assert store.stats()["task_pinned_blocks"] == 4  # the first prompt's pin was released
    prompt = second + tokens(5, seed=442)
    cache, _ = same_as_stock(model, ids(prompt), store, namespace="tenant-a")
    assert cache.cached_tokens == [16]
    cache, _ = same_as_stock(model, ids(prompt), store, namespace="tenant-b")
    assert cache.cached_tokens == [0]  # pinned under another namespace: never shared
    hf_patch.unpin_prompts(model, ["t"], store=store)
    assert store.stats()["task_prompts"] == 0 and store.stats()["pinned_blocks"] == 0
    with pytest.raises(KeyError, match="'t'"):
        hf_patch.unpin_prompts(model, ["t"], store=store)
    store.check_invariants()


def test_a_flush_while_a_prompt_is_computed_pins_no_stale_kv():
    # Another thread changes the weights and flushes the store (its next generate() does) while
    # pin_prompts runs the forward pass: the KV just computed is of the old weights.
    from tests.hf_models import build

    model = build("llama-sdpa", seed=3)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=96)
    system = tokens(12, seed=440)

    def weights_change_meanwhile(module, args, output):
        handle.remove()
        with torch.no_grad():
            next(model.parameters()).mul_(1.5)
        hf_patch.keys.weights.flush_if_weights_changed(store, model)

    handle = model.register_forward_hook(weights_change_meanwhile)
    with pytest.raises(RuntimeError, match="flushed"):
        hf_patch.pin_prompts(model, {"support": system}, store=store)
    assert store.tasks.ids() == [] and store.stats()["cached_blocks"] == 0
    cache, _ = same_as_stock(model, ids(system + tokens(5, seed=441)), store, max_new_tokens=3)
    assert cache.cached_tokens == [0]
