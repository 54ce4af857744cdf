"""One KVStore across many generate() calls: eviction, threads, tenants, stats, weight changes, pins."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from transformers import TextStreamer

import hf_patch
from tests.hf_models import (
    assert_same_as_stock,
    block_floor,
    build,
    expected_full_hit,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    sequences,
    shared,
    stock,
    store_for,
    tokenizer,
    tokens,
)

BS = 4
PROMPT = tokens(42, seed=21)


# -- eviction ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama-sdpa", "gpt2"])
def test_prompts_longer_than_the_pool(family):
    model = shared(family)
    store = store_for(model, BS, budget_tokens=64)  # 16 blocks; prompts are 80 tokens
    assert store.stats()["num_blocks"] == 16
    long_prompts = [tokens(80, seed=s) for s in (22, 23, 24)]
    for prompt in long_prompts + long_prompts:  # the second round finds the first round evicted
        assert_same_as_stock(model, ids(prompt), store)
    stats = store.stats()
    assert stats["evicted_blocks"] > 0
    assert stats["uncached_tokens"] > 0  # 85 tokens never fit in 64
    # The most recent prompt's first 64 tokens survive and are reused.
    cache, _ = assert_same_as_stock(model, ids(long_prompts[-1]), store)
    assert cache.cached_tokens == [64]
    store.check_invariants()


def test_eviction_between_requests_keeps_recent_prefixes():
    model = shared("llama-sdpa")
    store = store_for(model, BS, budget_tokens=96)  # room for about two 40-token prompts + answers
    prompts = [tokens(40, seed=30 + i) for i in range(4)]
    for prompt in prompts:
        cache, _ = assert_same_as_stock(model, ids(prompt), store)
        assert cache.cached_tokens == [0]
    assert store.stats()["evicted_blocks"] > 0
    cache, _ = assert_same_as_stock(model, ids(prompts[-1]), store)  # most recent: still cached
    assert cache.cached_tokens == [expected_full_hit(40, BS)]
    cache, _ = assert_same_as_stock(model, ids(prompts[0]), store)  # oldest: evicted
    assert cache.cached_tokens == [0]
    store.check_invariants()


def test_two_threads_one_store():
    """Each thread its own RadixCache; a tiny pool so commits evict what the other thread uses."""
    model = shared("llama-sdpa")
    store = store_for(model, BS, budget_tokens=128)
    system = tokens(24, seed=40)
    prompts = [system + tokens(12 + i, seed=41 + i) for i in range(6)]
    prompts += [tokens(30, seed=50 + i) for i in range(2)]
    kwargs = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        references = [model.generate(ids(p), **kwargs) for p in prompts]
    errors: list[BaseException] = []
    hits = [0, 0]
    barrier = threading.Barrier(2)

    def worker(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            for it in range(24):
                k = (it * 3 + index * 5) % len(prompts)
                cache = hf_patch.RadixCache(store=store)
                with torch.no_grad():
                    out = model.generate(ids(prompts[k]), past_key_values=cache, **kwargs)
                assert torch.equal(out, references[k]), f"thread {index} iteration {it}: prompt {k} differs"
                hits[index] += cache.cached_tokens[0]
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    assert all(hits), "a thread never reused anything"
    stats = store.stats()
    assert stats["pinned_blocks"] == 0
    assert stats["evicted_blocks"] > 0
    store.check_invariants()


# -- tenants -------------------------------------------------------------------------------------
def test_namespaces_do_not_share():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    ref = stock(model, ids(PROMPT))
    cache_a, _ = assert_same_as_stock(model, ids(PROMPT), store, namespace="tenant-a", reference=ref)
    cache_b, _ = assert_same_as_stock(model, ids(PROMPT), store, namespace="tenant-b", reference=ref)
    assert cache_b.cached_tokens == [0]
    cache_default, _ = assert_same_as_stock(model, ids(PROMPT), store, reference=ref)
    assert cache_default.cached_tokens == [0]
    cache_a, _ = assert_same_as_stock(model, ids(PROMPT), store, namespace="tenant-a", reference=ref)
    assert cache_a.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    cache_b, _ = assert_same_as_stock(model, ids(PROMPT), store, namespace="tenant-b", reference=ref)
    assert cache_b.cached_tokens == [expected_full_hit(len(PROMPT), BS)]


# -- stats ---------------------------------------------------------------------------------------
def test_stats_count_hits_and_queries():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    prompts = [PROMPT, PROMPT, PROMPT[:30] + tokens(7, seed=60)]
    reported = 0
    for p in prompts:
        cache, _ = assert_same_as_stock(model, ids(p), store)
        reported += sum(cache.cached_tokens)
    stats = store.stats()
    assert reported == expected_full_hit(len(PROMPT), BS) + block_floor(30, BS)
    assert stats["hit_tokens"] == reported
    assert stats["query_tokens"] == sum(len(p) for p in prompts)
    assert stats["requests"] == 3
    assert stats["hit_rate"] == pytest.approx(reported / stats["query_tokens"])
    assert stats["pinned_blocks"] == 0
    store.check_invariants()


def test_stats_for_a_padded_batch():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    before = store.stats()
    rows = [PROMPT[:33], PROMPT[:41], PROMPT[:20] + tokens(9, seed=61)]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= torch.tensor([width - len(r) for r in rows])[:, None]).long()
    cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    after = store.stats()
    assert min(cache.cached_tokens) > 0
    assert after["hit_tokens"] - before["hit_tokens"] == sum(cache.cached_tokens)
    assert after["query_tokens"] - before["query_tokens"] == sum(len(r) for r in rows)


# -- weights change ------------------------------------------------------------------------------
def _change_in_place(model, other):
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "layers.0" in n).add_(0.1)


def _load_other_state(model, other):
    model.load_state_dict(other.state_dict())


def _fused_optimizer_step(model, other):
    # The Trainer's default optim (adamw_torch_fused): its kernel leaves parameter versions as they were.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(ids(PROMPT), labels=ids(PROMPT)).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize(
    "change",
    [_change_in_place, _load_other_state, _fused_optimizer_step],
    ids=["add_", "load_state_dict", "fused-adamw"],
)
def test_weights_change_flushes_stale_kv(change, caplog):
    model = build("llama-sdpa", seed=0)
    other = build("llama-sdpa", seed=1)
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert cache.cached_tokens[0] > 0
    flushes = store.stats()["flushes"]
    change(model, other)
    with caplog.at_level(logging.WARNING, logger="hf_patch.keys.weights"):
        cache, _ = assert_same_as_stock(model, ids(PROMPT), store)  # against stock of the changed model
    assert cache.cached_tokens == [0]
    assert store.stats()["flushes"] == flushes + 1
    assert [r.getMessage() for r in caplog.records if "weights of LlamaForCausalLM changed" in r.getMessage()]
    # The changed model's own KV is reused afterwards.
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]


def test_manual_flush_between_requests():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    store.flush()
    assert store.stats()["cached_blocks"] == 0
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert cache.cached_tokens == [0]
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]


def test_two_models_of_one_shape_on_one_store_never_mix():
    """Each model sees only its own KV (outputs equal its own stock generate) and keeps it."""
    model_a, model_b = build("llama-sdpa", seed=0), build("llama-sdpa", seed=1)
    store = store_for(model_a, BS)
    for model in (model_a, model_b):
        cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
        assert cache.cached_tokens == [0]
    for model in (model_a, model_b, model_a):
        cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
        assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    assert store.stats()["flushes"] == 0


def test_two_models_of_one_shape_in_two_threads_never_mix():
    model_a, model_b = build("llama-sdpa", seed=0), build("llama-sdpa", seed=1)
    store = store_for(model_a, BS)
    errors = []

    def run(model):
        try:
            for _ in range(4):
                # No per-call pin check: the other thread may hold a pin at that moment.
                assert_same_as_stock(model, ids(PROMPT), store, check_invariants=False)
                store.check_invariants()
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(m,)) for m in (model_a, model_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.stats()["pinned_blocks"] == 0
    store.check_invariants()


# -- pins after exceptions -----------------------------------------------------------------------
class Boom(RuntimeError):
    pass


class FailingStreamer(TextStreamer):
    def __init__(self, fail_on: int, error: type[BaseException] = Boom):
        super().__init__(tokenizer())
        self.error = error
        self.calls = 0
        self.fail_on = fail_on

    def put(self, value):
        self.calls += 1
        if self.calls == self.fail_on:
            raise self.error("consumer went away")
        super().put(value)

    def on_finalized_text(self, text, stream_end=False):
        pass


@pytest.mark.parametrize("read", ["read", "read_in_place"])  # the copy path's, paged attention's
def test_pins_released_when_the_copy_fails(monkeypatch, read):
    """An error between match and preload (here: the read from the pool) must not leak the pin."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)

    def broken_read(*args, **kwargs):
        assert store.stats()["pinned_blocks"] > 0  # the match is pinned while it is read
        raise Boom("device lost")

    monkeypatch.setattr(store, read, broken_read)
    cache = hf_patch.RadixCache(store=store, paged=read == "read_in_place")
    with pytest.raises(Boom):
        model.generate(ids(PROMPT), max_new_tokens=4, past_key_values=cache)
    monkeypatch.undo()
    assert store.stats()["pinned_blocks"] == 0
    store.check_invariants()
    assert_same_as_stock(model, ids(PROMPT), cache=cache)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
@pytest.mark.parametrize("fail_on", [1, 3])
def test_pins_released_after_an_exception(fail_on, error):
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    inserted = store.stats()["inserted_tokens"]
    cache = hf_patch.RadixCache(store=store)
    streamer = FailingStreamer(fail_on, error)
    with pytest.raises(error):
        model.generate(
            ids(PROMPT + [5, 6, 7, 8, 9]), max_new_tokens=6, past_key_values=cache, streamer=streamer
        )
    assert streamer.calls == fail_on
    assert store.stats()["inserted_tokens"] == inserted, "an aborted generation was committed"
    assert store.stats()["pinned_blocks"] == 0
    store.check_invariants()
    # The same cache object and the store keep working, exactly.
    assert_same_as_stock(model, ids(PROMPT), cache=cache)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]


def test_default_store_is_per_model():
    model = build("llama-sdpa", seed=3)
    store = hf_patch.default_store(model)
    assert hf_patch.default_store(model) is store
    ref = stock(model, ids(PROMPT))
    cache, _ = assert_same_as_stock(model, ids(PROMPT), None, reference=ref)
    assert store.stats()["inserted_tokens"] > 0
    cache, _ = assert_same_as_stock(model, ids(PROMPT), None, reference=ref)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), store.block_size)]
    other = build("llama-sdpa", seed=4)
    assert hf_patch.default_store(other) is not store
    out = other.generate(
        ids(PROMPT), max_new_tokens=4, do_sample=False, past_key_values=hf_patch.RadixCache()
    )
    assert torch.equal(sequences(out), other.generate(ids(PROMPT), max_new_tokens=4, do_sample=False))


def test_store_less_cache_uses_each_models_default_store():
    """RadixCache() means "the model's default store" on every call, not "the first model's store"."""
    llama, qwen2 = shared("llama-sdpa"), shared("qwen2-sliding")  # 2 and 4 layers
    cache = hf_patch.RadixCache()
    assert_same_as_stock(llama, ids(PROMPT), cache=cache)
    assert_same_as_stock(qwen2, ids(PROMPT), cache=cache)  # raises "built for a model of another shape"
    assert_same_as_stock(llama, ids(PROMPT), cache=cache)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), hf_patch.default_store(llama).block_size)]
