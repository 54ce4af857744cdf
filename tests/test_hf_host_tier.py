"""generate() on a store with a tiny device pool and a host tier: equal to stock generate(),
with most hits served from host blocks, a prefix split between the tiers in a left-padded
batch, and two threads sharing the store."""

from __future__ import annotations

import threading

import pytest
import torch

import hf_patch
from hf_patch.keys.weights import model_scope
from tests.hf_models import (
    assert_same_as_stock,
    expected_full_hit,
    ids,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    stock,
    tokens,
)

BS = 4
FAMILIES = ("llama-sdpa", "qwen2-sliding", "gpt2", "deepseek-v3-mla")


def tiered_store(model, device_tokens: int, host_tokens: int = 4096):
    return hf_patch.build_store(
        model, block_size=BS, budget_tokens=device_tokens, host_cache_tokens=host_tokens
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_hits_served_from_the_host_equal_stock(family):
    model = shared(family)
    store = tiered_store(model, device_tokens=64)  # room for one prompt and its reply
    prompts = [tokens(44, seed=300 + i) for i in range(4)]
    references = [stock(model, ids(p)) for p in prompts]
    for p, ref in zip(prompts, references):  # each commit demotes the previous prompt
        assert_same_as_stock(model, ids(p), store, reference=ref)
    assert store.stats()["demoted_blocks"] > 0
    for p, ref in zip(prompts, references):  # round two: all but the last come from the host
        cache, _ = assert_same_as_stock(model, ids(p), store, reference=ref)
        assert cache.cached_tokens == [expected_full_hit(len(p), BS)]
    stats = store.stats()
    assert stats["host_hit_tokens"] >= 3 * expected_full_hit(44, BS)
    assert stats["host_hit_tokens"] > stats["hit_tokens"] // 2, "most hits should come from the host"


@pytest.mark.parametrize("family", ("llama-sdpa", "gpt2"))
def test_left_padded_batch_with_a_prefix_half_on_device_half_on_host(family):
    model = shared(family)
    store = tiered_store(model, device_tokens=56)
    system = tokens(16, seed=310)
    a, b = system + tokens(16, seed=311), system + tokens(16, seed=312)
    for p in (a, b):  # system is now an inner node with two tails
        assert_same_as_stock(model, ids(p), store, max_new_tokens=3)
    other = tokens(20, seed=313)
    assert_same_as_stock(model, ids(other), store, max_new_tokens=3)  # demotes a's tail (LRU)
    rows = [a + tokens(3, seed=314), other + tokens(9, seed=315), tokens(6, seed=316)]
    with store.acquire(rows[0], (model_scope(model), None)) as lease:  # the split this test is about
        assert 0 < lease.num_host_blocks < len(lease.block_ids)
    input_ids, mask = left_pad(rows)
    cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, max_new_tokens=5)
    assert store.stats()["host_hit_tokens"] > 0
    # Row 0 alone: its whole split prefix is preloaded (device part, then host part).
    cache, _ = assert_same_as_stock(model, ids(rows[0]), store)
    assert cache.cached_tokens == [32]


def test_two_threads_on_a_tiered_store():
    model = shared("llama-sdpa")
    store = tiered_store(model, device_tokens=64, host_tokens=1024)
    system = tokens(24, seed=320)
    prompts = [system + tokens(12 + i, seed=321 + i) for i in range(5)] + [tokens(30, seed=330)]
    kwargs = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        references = [model.generate(ids(p), **kwargs) for p in prompts]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            for it in range(18):
                k = (it * 3 + index * 5) % len(prompts)
                cache = hf_patch.RadixCache(store=store)
                with torch.no_grad():
                    out = model.generate(ids(prompts[k]), past_key_values=cache, **kwargs)
                assert torch.equal(out, references[k]), f"thread {index} iteration {it}: prompt {k} differs"
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    stats = store.stats()
    assert stats["pinned_blocks"] == stats["host_pinned_blocks"] == 0
    assert stats["demoted_blocks"] > 0 and stats["host_hit_tokens"] > 0
    store.check_invariants()


def test_host_cache_budget_arguments_and_environment(monkeypatch):
    model = shared("llama-sdpa")
    for name in ("RADIXKV_HOST_CACHE_TOKENS", "RADIXKV_HOST_CACHE_BYTES"):
        monkeypatch.delenv(name, raising=False)
    assert hf_patch.build_store(model, block_size=BS, budget_tokens=64).host_pool is None
    store = tiered_store(model, device_tokens=64, host_tokens=256)
    assert store.host_pool.num_blocks == 64 and not store.host_pool.k[0].is_pinned()
    per_block = BS * store.pool.bytes_per_token
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=64, host_cache_bytes=10 * per_block + 3)
    assert store.host_pool.num_blocks == 10
    monkeypatch.setenv("RADIXKV_HOST_CACHE_BYTES", str(3 * per_block))
    assert hf_patch.build_store(model, block_size=BS, budget_tokens=64).host_pool.num_blocks == 3
    monkeypatch.setenv("RADIXKV_HOST_CACHE_BYTES", "lots")
    with pytest.raises(ValueError, match="RADIXKV_HOST_CACHE_BYTES must be an integer, got 'lots'"):
        hf_patch.build_store(model, block_size=BS, budget_tokens=64)
    with pytest.raises(ValueError, match="at most one of host_cache_tokens= and host_cache_bytes="):
        hf_patch.build_store(model, budget_tokens=64, host_cache_tokens=64, host_cache_bytes=64)


@pytest.mark.parametrize(
    "mode",
    [
        dict(num_beams=3, num_return_sequences=2),
        dict(do_sample=True, num_return_sequences=2),
        dict(repetition_penalty=1.3),
    ],
    ids=["beams", "sampling", "repetition-penalty"],
)
def test_generation_modes_with_host_hits(mode):
    model = shared("llama-sdpa")
    store = tiered_store(model, device_tokens=64)
    prompts = [tokens(40, seed=340 + i) for i in range(3)]
    seed = 7 if mode.get("do_sample") else None
    for p in prompts:
        assert_same_as_stock(model, ids(p), store, seed=seed, **mode)
    hits_before = store.stats()["host_hit_tokens"]
    for p in prompts[:2]:  # demoted by the later prompts: served from the host
        cache, _ = assert_same_as_stock(model, ids(p), store, seed=seed, **mode)
        assert set(cache.cached_tokens) == {expected_full_hit(len(p), BS)}
    assert store.stats()["host_hit_tokens"] > hits_before
