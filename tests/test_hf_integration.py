"""Requirements of the generate() integration that the scenario tests do not pin down: the install
itself, the oracle's own passthrough, positional arguments, store budgets, what gets committed
(EOS cut, beams), eviction while a request runs, and the size of the decode buffers."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerationMixin

import hf_patch
import hf_patch.call
import hf_patch.patch
from hf_patch.keys.weights import model_scope
from tests.hf_models import (
    EOS,
    PAD,
    assert_outputs_equal,
    assert_same_as_stock,
    block_floor,
    build,
    ids,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    stock,
    store_for,
    tokens,
)

BS = 4
PROMPT = tokens(42, seed=90)


# -- the install ------------------------------------------------------------------------------------
def test_install_is_idempotent():
    generate, prefill = GenerationMixin.generate, GenerationMixin._prefill
    hf_patch.install()
    hf_patch.install()
    assert GenerationMixin.generate is generate and GenerationMixin._prefill is prefill
    # One layer of wrapping: the wrapped function is transformers' own.
    assert not getattr(generate.__wrapped__, "_radixkv_wrapped", False)
    assert not getattr(prefill.__wrapped__, "_radixkv_wrapped", False)


def test_other_caches_go_straight_to_unpatched_generate(monkeypatch):
    """Every test's reference is generate() without a cache argument, through the wrapper: that
    passthrough must be transformers' own generate, untouched (here: against the unwrapped one)."""
    model = shared("llama-sdpa")

    def untouchable(*args, **kwargs):
        raise AssertionError("hf_patch ran for a call without a RadixCache")

    for name in ("model_layout", "default_store", "flush_if_weights_changed", "Request"):
        monkeypatch.setattr(hf_patch.call, name, untouchable)
    for name in ("open_request", "key_parts", "sharing"):
        monkeypatch.setattr(hf_patch.patch, name, untouchable)
    original = GenerationMixin.generate.__wrapped__
    kwargs = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        unpatched = original(model, ids(PROMPT), **kwargs)
        assert_outputs_equal(unpatched, model.generate(ids(PROMPT), **kwargs), atol=0.0)
        dynamic = DynamicCache()
        assert_outputs_equal(
            unpatched, model.generate(ids(PROMPT), past_key_values=dynamic, **kwargs), atol=0.0
        )
    assert dynamic.get_seq_length() == len(PROMPT) + 4  # filled by stock generate as usual


# -- arguments --------------------------------------------------------------------------------------
def test_positional_generation_config_with_cache_implementation():
    """generate(ids, config): the config's cache_implementation would make generate refuse the cache."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    config = GenerationConfig(
        cache_implementation="static",
        max_new_tokens=5,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        reference = model.generate(ids(PROMPT), config)
        for expected in (0, block_floor(len(PROMPT) - 1, BS)):
            cache = hf_patch.RadixCache(store=store)
            out = model.generate(ids(PROMPT), config, past_key_values=cache)
            assert_outputs_equal(reference, out)
            assert cache.cached_tokens == [expected]
    assert config.cache_implementation == "static", "the caller's GenerationConfig was changed"


def test_positional_generation_config_with_use_cache_false():
    model = shared("llama-sdpa")
    with pytest.raises(ValueError, match="use_cache"):
        model.generate(ids(PROMPT), GenerationConfig(use_cache=False), past_key_values=hf_patch.RadixCache())


# -- budgets ----------------------------------------------------------------------------------------
BUDGET_ENV = ("RADIXKV_CACHE_TOKENS", "RADIXKV_CACHE_BYTES", "RADIXKV_BLOCK_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for name in BUDGET_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_budget_arguments(clean_env):
    model = shared("llama-sdpa")
    store = hf_patch.build_store(model, block_size=4, budget_tokens=64)
    assert (store.block_size, store.pool.num_blocks) == (4, 16)
    per_block = 4 * store.pool.bytes_per_token
    store = hf_patch.build_store(model, block_size=4, budget_bytes=10 * per_block + 1)
    assert store.pool.num_blocks == 10
    with pytest.raises(ValueError, match="at most one"):
        hf_patch.build_store(model, budget_tokens=64, budget_bytes=1 << 20)


def test_default_budget_is_one_gib(clean_env):
    store = hf_patch.build_store(shared("llama-sdpa"))
    per_block = store.block_size * store.pool.bytes_per_token
    assert store.block_size == 16
    assert (1 << 30) - per_block < store.pool.nbytes <= 1 << 30


def test_environment_sets_the_default_store_of_radix_cache(clean_env):
    clean_env.setenv("RADIXKV_CACHE_TOKENS", "256")
    clean_env.setenv("RADIXKV_BLOCK_SIZE", "8")
    model = build("llama-sdpa", seed=7)  # a fresh model: its default store is built now
    assert_same_as_stock(model, ids(PROMPT), cache=hf_patch.RadixCache())
    store = hf_patch.default_store(model)
    assert (store.block_size, store.pool.num_blocks) == (8, 32)
    assert store.stats()["inserted_tokens"] > 0
    clean_env.delenv("RADIXKV_CACHE_TOKENS")
    clean_env.setenv("RADIXKV_CACHE_BYTES", str(5 * 8 * store.pool.bytes_per_token))
    assert hf_patch.build_store(model).pool.num_blocks == 5
    clean_env.setenv("RADIXKV_CACHE_BYTES", "lots")
    with pytest.raises(ValueError, match="RADIXKV_CACHE_BYTES"):
        hf_patch.build_store(model)


# -- what gets committed ----------------------------------------------------------------------------
class ForceEos(LogitsProcessor):
    """Row ``row`` emits EOS as its ``step``-th new token (0-based); the other rows run freely."""

    def __init__(self, width: int, row: int, step: int):
        self.width, self.row, self.step = width, row, step

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.width == self.step:
            scores[self.row] = torch.finfo(scores.dtype).min
            scores[self.row, EOS] = 0.0
        return scores


def test_commit_cuts_each_row_at_its_first_eos():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    rows = [PROMPT[:40], PROMPT[:40][::-1]]
    force = LogitsProcessorList([ForceEos(40, row=0, step=3)])
    _, out = assert_same_as_stock(
        model,
        ids(*rows),
        store,
        logits_processor=force,
        max_new_tokens=12,
        min_new_tokens=8,
        pad_token_id=PAD,
    )
    finished, running = out.sequences.tolist()
    assert finished[43] == EOS and finished[44:] == [PAD] * 8  # the row went on with pads
    # Ask for the finished row with its pads: only prompt + answer + EOS (44 tokens) was cached;
    # without the cut, 48 tokens (the pads' KV) would match.
    turn = ids(finished)
    cache, _ = assert_same_as_stock(model, turn, store, attention_mask=torch.ones_like(turn))
    assert cache.cached_tokens == [44]
    # The running row was committed whole, less its last token (never fed, no KV).
    turn = ids(running)
    cache, _ = assert_same_as_stock(model, turn, store, attention_mask=torch.ones_like(turn))
    assert cache.cached_tokens == [block_floor(len(running) - 1, BS)]


def test_beam_search_commits_the_prompt_only():
    """The cache rows are reordered running beams, not the returned sequence: only the prompt is safe."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    prompt = PROMPT[:41]
    _, out = assert_same_as_stock(
        model, ids(prompt), store, num_beams=3, output_scores=True, max_new_tokens=8
    )
    assert store.stats()["inserted_tokens"] == block_floor(len(prompt), BS)
    turn = ids(
        out.sequences[0].tolist() + tokens(3, seed=91)
    )  # an explicit mask: answers may hold the pad id
    cache, _ = assert_same_as_stock(model, turn, store, attention_mask=torch.ones_like(turn))
    assert cache.cached_tokens == [block_floor(len(prompt), BS)]


# -- eviction while a request runs ------------------------------------------------------------------
def test_eviction_while_a_request_reads_its_match(monkeypatch):
    """Another request fills a tiny pool between this request's match and its read (a copy, or
    paged attention's read in place): the pinned match must survive (the other request caches
    less instead), and the output stays exact."""
    model = shared("llama-sdpa")
    store = store_for(model, BS, budget_tokens=64)  # 16 blocks
    assert_same_as_stock(model, ids(PROMPT), store, max_new_tokens=3)  # caches 44 tokens: 11 blocks
    others = [tokens(40, seed=92), tokens(40, seed=93)]

    def after_others_committed(real_read):
        def read(*args, **kwargs):
            while others:  # the nested requests read nothing (their prompts are new), no recursion
                assert_same_as_stock(
                    model, ids(others.pop()), store, max_new_tokens=3, check_invariants=False
                )
            return real_read(*args, **kwargs)

        return read

    for name in ("read", "read_in_place"):
        monkeypatch.setattr(store, name, after_others_committed(getattr(store, name)))
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store, max_new_tokens=3)
    assert not others
    assert cache.cached_tokens == [block_floor(len(PROMPT) - 1, BS)]
    stats = store.stats()
    assert stats["evicted_blocks"] > 0 and stats["uncached_tokens"] > 0
    store.check_invariants()


@pytest.mark.parametrize("paged", [False, True])
def test_eviction_during_decode(paged):
    """A request's match is unpinned once copied: other requests may evict it while it decodes.
    Read in place (paged attention), it stays pinned to the end of the call instead."""
    model = shared("llama-sdpa")
    store = store_for(model, BS, budget_tokens=64)
    assert_same_as_stock(model, ids(PROMPT), store, max_new_tokens=3)
    others = [tokens(40, seed=94), tokens(40, seed=95)]

    left = []  # how much of this request's prompt the store still held after the others ran

    class EvictMidway(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            while others:
                assert_same_as_stock(
                    model, ids(others.pop()), store, max_new_tokens=3, check_invariants=False
                )
                with store.acquire(PROMPT, (model_scope(model), None)) as lease:
                    left.append(lease.num_tokens)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ref = stock(model, ids(PROMPT), max_new_tokens=6)  # without the criterion: it evicts once only
    stop = StoppingCriteriaList([EvictMidway()])
    cache, out = assert_same_as_stock(
        model, ids(PROMPT), store, reference=ref, stopping_criteria=stop, max_new_tokens=6,
        cache=hf_patch.RadixCache(store=store, paged=paged),
    )  # fmt: skip
    assert not others
    assert cache.cached_tokens == [block_floor(len(PROMPT) - 1, BS)]
    if paged:
        assert left[-1] == block_floor(len(PROMPT) - 1, BS), f"its match was evicted mid-request: {left}"
    else:
        assert left[-1] < block_floor(len(PROMPT) - 1, BS), f"its match was not evicted mid-request: {left}"
    store.check_invariants()
    # It committed after the eviction: its whole sequence is cached again.
    turn = out.sequences
    cache, _ = assert_same_as_stock(model, turn, store, attention_mask=torch.ones_like(turn))
    assert cache.cached_tokens == [block_floor(out.sequences.shape[1] - 1, BS)]


# -- decode buffers ---------------------------------------------------------------------------------
class StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_buffers_are_not_sized_by_a_generous_max_new_tokens():
    """max_new_tokens is a ceiling, not a size: stopping after 5 tokens must not hold KV for 5000."""
    model = shared("llama-sdpa")
    cache = hf_patch.RadixCache(store=store_for(model, BS))
    stop = StoppingCriteriaList([StopAfter(len(PROMPT) + 5)])
    out = model.generate(
        ids(PROMPT), max_new_tokens=5000, do_sample=False, past_key_values=cache, stopping_criteria=stop
    )
    assert out.shape[1] == len(PROMPT) + 5
    capacity = cache.layers[0].buffers()[0].shape[2]
    assert capacity <= 2 * len(PROMPT) + 256, capacity


def test_buffers_grow_past_their_first_size_exactly():
    model = build("llama-sdpa")
    model.generation_config.eos_token_id = None  # run every step
    store = store_for(model, BS)
    prompt = PROMPT[:12]
    assert_same_as_stock(model, ids(prompt), store, max_new_tokens=3)
    ref = stock(model, ids(prompt), max_new_tokens=300)
    cache, out = assert_same_as_stock(model, ids(prompt), store, reference=ref, max_new_tokens=300)
    assert cache.cached_tokens == [8]
    assert cache.layers[0].buffers()[0].shape[2] >= out.sequences.shape[1] - 1 > 12 + 256  # it grew


# -- what the cache reports -------------------------------------------------------------------------
@pytest.mark.parametrize("num_return_sequences", [1, 2])
def test_cached_tokens_follow_the_returned_sequences_under_beam_search(num_return_sequences):
    """Entry i describes sequences[i]: with 3 beams per prompt, a per-beam list would put the
    first prompt's count under the second prompt's sequence."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    input_ids, mask = left_pad([tokens(20, seed=96), PROMPT[:41]])  # pads 21 and 0
    cache, out = assert_same_as_stock(
        model,
        input_ids,
        store,
        attention_mask=mask,
        pad_token_id=PAD,
        num_beams=3,
        num_return_sequences=num_return_sequences,
        output_scores=True,
    )
    assert out.sequences.shape[0] == 2 * num_return_sequences
    # The short prompt's 3 beam rows share its 16 reusable tokens (computed once in the batch), so
    # the common column is 37 = min(21 + 16, 0 + 40): the long row reused 37 tokens; the short
    # prompt computed its 16 itself (once for its beams), so none were cached for it.
    assert cache.cached_tokens == [0] * num_return_sequences + [37] * num_return_sequences
