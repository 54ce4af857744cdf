"""Every supported model family: RadixCache generate() equals stock generate() in every reuse scenario.

Greedy tokens must be identical and fp32 logits within 1e-5 of stock generate() called with no
cache argument, on a cold store, a warm one, a fully cached prompt, a partly cached one, a
chat turn that extends the previous answer, an unrelated prompt, and one RadixCache object
passed twice.
"""

from __future__ import annotations

import pytest
import torch

import hf_patch
from tests.hf_models import (
    FAMILIES,
    assert_same_as_stock,
    block_floor,
    build,
    expected_full_hit,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    stock,
    store_for,
    tokens,
)

BS = 4  # small blocks: more hits on short prompts
PROMPT = tokens(41, seed=1)
families = pytest.mark.parametrize("family", FAMILIES)


@families
def test_cold_then_fully_cached(family):
    model, store = shared(family), store_for(shared(family), BS)
    ref = stock(model, ids(PROMPT))
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store, reference=ref)
    assert cache.cached_tokens == [0]
    assert store.stats()["inserted_tokens"] > 0, "a cold call cached nothing"
    # Same prompt again: everything is cached, yet one token must still be computed.
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store, reference=ref)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    # A block-aligned prompt that is entirely cached: its last block must be recomputed.
    aligned = PROMPT[:40]
    cache, _ = assert_same_as_stock(model, ids(aligned), store)
    assert cache.cached_tokens == [36]


@families
def test_partly_cached_prompt(family):
    model, store = shared(family), store_for(shared(family), BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    shared_len = 30  # not a block multiple: only whole blocks are reused
    prompt = PROMPT[:shared_len] + tokens(14, seed=2)
    cache, _ = assert_same_as_stock(model, ids(prompt), store)
    assert cache.cached_tokens == [block_floor(shared_len, BS)]


@families
def test_warm_store_longer_prompt(family):
    """A cached prompt followed by new text (system prompt + user turn)."""
    model, store = shared(family), store_for(shared(family), BS)
    system = PROMPT[:24]
    assert_same_as_stock(model, ids(system), store)
    cache, _ = assert_same_as_stock(model, ids(system + tokens(20, seed=3)), store)
    assert cache.cached_tokens == [24]


@families
def test_multi_turn_reuses_previous_answer(family):
    model, store = shared(family), store_for(shared(family), BS)
    # min_new_tokens: the answer must be long enough to span a block past the prompt.
    _, turn1 = assert_same_as_stock(model, ids(PROMPT), store, max_new_tokens=8, min_new_tokens=8)
    answer = turn1.sequences[0].tolist()
    assert len(answer) == len(PROMPT) + 8
    turn2 = ids(answer + tokens(9, seed=4))
    # An explicit mask: the answer may contain the pad id, and generate() would mask it out.
    cache, _ = assert_same_as_stock(model, turn2, store, attention_mask=torch.ones_like(turn2))
    # The last sampled token has no KV; everything before it is cached.
    assert cache.cached_tokens == [block_floor(len(answer) - 1, BS)]
    assert cache.cached_tokens[0] > block_floor(len(PROMPT), BS), "the generated answer was not reused"


@families
def test_unrelated_prompts_do_not_hit(family):
    model, store = shared(family), store_for(shared(family), BS)
    assert_same_as_stock(model, ids(tokens(40, seed=5, high=60)), store)
    cache, _ = assert_same_as_stock(model, ids(tokens(40, seed=6, low=60)), store)
    assert cache.cached_tokens == [0]
    assert store.stats()["hit_tokens"] == 0


@families
def test_same_cache_object_twice(family):
    model, store = shared(family), store_for(shared(family), BS)
    cache = hf_patch.RadixCache(store=store)
    ref = stock(model, ids(PROMPT))
    assert_same_as_stock(model, ids(PROMPT), cache=cache, reference=ref)
    assert cache.cached_tokens == [0]
    assert_same_as_stock(model, ids(PROMPT), cache=cache, reference=ref)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    other = tokens(37, seed=7)  # a different prompt through the same object: no leftovers
    assert_same_as_stock(model, ids(other), cache=cache)
    assert cache.cached_tokens == [0]


@pytest.mark.parametrize("block_size", [1, 2, 16])
@pytest.mark.parametrize("family", ["llama-sdpa", "qwen2-sliding", "gpt2"])
def test_block_sizes(family, block_size):
    model, store = shared(family), store_for(shared(family), block_size)
    prompt = tokens(50, seed=8)
    assert_same_as_stock(model, ids(prompt), store)
    cache, _ = assert_same_as_stock(model, ids(prompt[:37] + tokens(9, seed=9)), store)
    assert cache.cached_tokens == [block_floor(37, block_size)]
    cache, _ = assert_same_as_stock(model, ids(prompt), store)
    assert cache.cached_tokens == [expected_full_hit(len(prompt), block_size)]


@pytest.mark.parametrize("family", ["llama-sdpa", "gemma2-sliding", "deepseek-v3-mla"])
def test_long_generation(family):
    """40 new tokens on a warm store: decode far past the reused prefix and sliding windows."""
    model = build(family, seed=1)
    model.generation_config.eos_token_id = None  # run all 40 steps
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store, max_new_tokens=4)
    cache, out = assert_same_as_stock(model, ids(PROMPT + tokens(5, seed=10)), store, max_new_tokens=40)
    assert cache.cached_tokens == [40]
    assert out.sequences.shape[1] == len(PROMPT) + 5 + 40
