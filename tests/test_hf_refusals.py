"""What a RadixCache must refuse, clearly, instead of generating something wrong."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    GenerationConfig,
    TextStreamer,
)

import hf_patch
from tests.hf_models import (
    BASE,
    assert_same_as_stock,
    build,
    expected_full_hit,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    store_for,
    tokenizer,
    tokens,
)

PROMPT = tokens(40, seed=70)


# -- use_cache=False ------------------------------------------------------------------------------
def test_use_cache_false_kwarg():
    model = shared("llama-sdpa")
    with pytest.raises(ValueError, match="use_cache"):
        model.generate(ids(PROMPT), use_cache=False, max_new_tokens=3, past_key_values=hf_patch.RadixCache())


def test_use_cache_false_in_explicit_generation_config():
    model = shared("llama-sdpa")
    config = GenerationConfig(use_cache=False, max_new_tokens=3)
    with pytest.raises(ValueError, match="use_cache"):
        model.generate(ids(PROMPT), generation_config=config, past_key_values=hf_patch.RadixCache())


def test_use_cache_false_in_model_generation_config():
    """The model's own generation config is merged by generate(): use_cache=False there is just as wrong."""
    model = build("llama-sdpa")
    model.generation_config.use_cache = False
    store = store_for(model)
    with pytest.raises(ValueError, match="use_cache"):
        model.generate(ids(PROMPT), max_new_tokens=3, past_key_values=hf_patch.RadixCache(store=store))


def test_use_cache_true_overrides_model_generation_config():
    model = build("llama-sdpa")
    model.generation_config.use_cache = False
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store_for(model), use_cache=True)
    cache, _ = assert_same_as_stock(model, ids(PROMPT), cache.store, use_cache=True)
    assert cache.cached_tokens == [36]


# -- store / model mismatch -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [dict(num_hidden_layers=3), dict(num_key_value_heads=4), dict(head_dim=32)],
    ids=["layers", "kv-heads", "head-dim"],
)
def test_store_of_another_shape(overrides):
    store = store_for(shared("llama-sdpa"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**BASE, **overrides})).eval()
    with pytest.raises(ValueError, match="another shape"):
        model.generate(ids(PROMPT), max_new_tokens=3, past_key_values=hf_patch.RadixCache(store=store))
    store.check_invariants()


def test_store_of_another_family_with_the_same_shape():
    """Same KV shape, so the store fits; the other weights must never see this model's KV."""
    llama = shared("llama-sdpa")
    store = store_for(llama)
    qwen2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **BASE)).eval()
    for model in (llama, qwen2):
        cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
        assert cache.cached_tokens == [0]
    cache, _ = assert_same_as_stock(llama, ids(PROMPT), store)  # its own KV only
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), 4)]


def test_store_with_another_dtype():
    store = store_for(shared("llama-sdpa"))
    model = build("llama-sdpa").to(torch.float64)
    with pytest.raises(ValueError, match="another shape"):
        model.generate(ids(PROMPT), max_new_tokens=3, past_key_values=hf_patch.RadixCache(store=store))


def test_store_built_before_a_dtype_change_is_refused():
    model = build("llama-sdpa")
    store = store_for(model)
    assert_same_as_stock(model, ids(PROMPT), store)
    model.to(torch.float64)
    with pytest.raises(ValueError, match="another shape"):
        model.generate(ids(PROMPT), max_new_tokens=3, past_key_values=hf_patch.RadixCache(store=store))


def test_model_converted_after_first_use_gets_a_store_of_its_new_dtype():
    """What the model looks like is read from the model as it is now, not as it was at its first call."""
    model = build("llama-sdpa")
    assert_same_as_stock(model, ids(PROMPT), store_for(model))
    model.to(torch.float64)
    store = store_for(model)
    assert store.pool.layers[0].dtype == torch.float64
    assert_same_as_stock(model, ids(PROMPT), store)
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert cache.cached_tokens == [36]


# -- unsupported models -----------------------------------------------------------------------------
# Each names why: a recurrent state kept outside the cache (RecurrentGemma on its modules), a
# model's own state object (MiniMax), KV columns that are not tokens (CPM-Ant). The hybrid,
# recurrent, sparse-indexed and shared-KV families radixkv serves are in
# tests/test_hf_recurrent.py, DeepSeek-V4 in tests/test_hf_deepseek_v4.py.
UNSUPPORTED = {
    # three blocks: stock itself cannot run an all-recurrent one (no attention layer for the length)
    "recurrent_gemma": dict(num_hidden_layers=3, head_dim=16, num_key_value_heads=1),
    "minimax": {
        "layer_types": ["linear_attention", "full_attention"],
        "num_local_experts": 2,
        "head_dim": 16,
    },
    "cpmant": {},
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_model_is_refused(name):
    model_type = name.split("-")[0]
    config = AutoConfig.for_model(model_type, **{**BASE, **UNSUPPORTED[name]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(hf_patch.UnsupportedModelError) as info:
        model.generate(ids(PROMPT[:12]), max_new_tokens=2, past_key_values=hf_patch.RadixCache())
    assert type(model).__name__ in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(hf_patch.UnsupportedModelError):
        hf_patch.build_store(model, budget_tokens=64)


def test_unsupported_model_generates_normally_without_radix_cache():
    torch.manual_seed(0)
    config = AutoConfig.for_model("recurrent_gemma", **{**BASE, **UNSUPPORTED["recurrent_gemma"]})
    model = AutoModelForCausalLM.from_config(config).eval()
    out = model.generate(ids(PROMPT[:12]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 15)


def test_encoder_decoder_is_refused():
    config = AutoConfig.for_model(
        "t5", vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0
    )
    model = AutoModelForSeq2SeqLM.from_config(config).eval()
    with pytest.raises(hf_patch.UnsupportedModelError, match="encoder-decoder"):
        model.generate(ids(PROMPT[:10]), max_new_tokens=2, past_key_values=hf_patch.RadixCache())


# -- misuse of the cache object -----------------------------------------------------------------
def test_bad_constructor_arguments():
    with pytest.raises(TypeError):
        hf_patch.RadixCache(store="not a store")
    with pytest.raises(TypeError):  # a list is one namespace per row: each must be hashable
        hf_patch.RadixCache(namespace=[["unhashable"]])
    with pytest.raises(TypeError):
        hf_patch.RadixCache(namespace={"a set"})
    with pytest.raises(ValueError, match="extra_ids"):
        hf_patch.RadixCache(extra_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="extra_ids"):
        hf_patch.RadixCache(extra_ids=torch.zeros(1, 3))
    with pytest.raises(TypeError, match="SharedPrefix"):
        hf_patch.RadixCache(shared_prefix=("ns", 4))
    with pytest.raises(ValueError, match="length"):
        hf_patch.SharedPrefix("ns", -1)


def test_one_cache_in_two_generate_calls_at_once():
    """A streamer that re-enters generate() with the cache that is running."""
    model = shared("llama-sdpa")
    store = store_for(model)
    cache = hf_patch.RadixCache(store=store)
    seen = []

    class Reentrant(TextStreamer):
        def put(self, value):
            if not seen:
                with pytest.raises(RuntimeError, match="already in use"):
                    model.generate(ids(PROMPT), max_new_tokens=2, past_key_values=cache)
                seen.append(True)

        def end(self):
            pass

    out = model.generate(
        ids(PROMPT), max_new_tokens=3, do_sample=False, past_key_values=cache, streamer=Reentrant(tokenizer())
    )
    assert seen == [True]
    assert torch.equal(out, model.generate(ids(PROMPT), max_new_tokens=3, do_sample=False))
    assert store.stats()["pinned_blocks"] == 0
    store.check_invariants()


def test_a_transformers_without_the_hooked_internals_is_refused_naming_its_version(caplog):
    """transformers 5.17 has no _maybe_prepare_encoder_kwargs_for_generation: importing hf_patch
    must say which release it is and what to install, not fail on a missing attribute; a release
    outside the tested range only warns."""
    from hf_patch.patch import TESTED_TRANSFORMERS, check_transformers

    class Old:  # GenerationMixin of a release without one hooked method
        generate = _prefill = object()

    with pytest.raises(ImportError, match=r"transformers 5\.17\.0 has no GenerationMixin\._maybe_prepare"):
        check_transformers("5.17.0", Old)
    low, high = TESTED_TRANSFORMERS
    with caplog.at_level("WARNING", logger="hf_patch.patch"):
        check_transformers(f"{low}.1")
        assert not caplog.records
        check_transformers("5.22.0")
        check_transformers(f"{high}.0.dev0")
    assert [r.getMessage().split(" is outside")[0] for r in caplog.records] == [
        "transformers 5.22.0",
        f"transformers {high}.0.dev0",
    ]
