"""PEFT adapters in the cache key: switched, disabled, re-created, merged, mixed in one batch,
saved and restored. Adapters come from peft's get_peft_model with random init (no hub)."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")  # a dev dependency: CI always has it
from peft import IA3Config, LoraConfig, PromptTuningConfig, get_peft_model  # noqa: E402

import hf_patch  # noqa: E402
from hf_patch import RadixCache  # noqa: E402
from radixkv import CacheFileMismatch  # noqa: E402
from tests.hf_models import (  # noqa: E402
    assert_same_as_stock,
    build,
    expected_full_hit,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    stock,
    store_for,
    tokens,
)

BS = 4
PROMPT = tokens(26, seed=1701)
FULL = expected_full_hit(len(PROMPT), BS)


def lora(seed: int, **kw) -> LoraConfig:
    torch.manual_seed(seed)  # init_lora_weights=False draws both matrices: other seed, other adapter
    return LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False, **kw
    )


CONFIGS = {
    "lora": lambda seed: lora(seed),
    "dora": lambda seed: lora(seed, use_dora=True),
    "ia3": lambda seed: IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"],
        feedforward_modules=["down_proj"],
        init_ia3_weights=False,
    ),
}


def peft_model(kind: str = "lora"):
    """A fresh tiny Llama with adapters "x" and "y" of ``kind`` (different random weights)."""
    base = build("llama-sdpa")
    torch.manual_seed(1)
    model = get_peft_model(base, CONFIGS[kind](1), adapter_name="x")
    torch.manual_seed(2)
    model.add_adapter("y", CONFIGS[kind](2))
    if kind == "ia3":  # IA3 initialises to identity scaling even when asked not to: make them differ
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "ia3_l" in name:
                    p.uniform_(0.5, 1.5)
    return model.eval()


def run(model, store, input_ids, expect, **kwargs):
    """Generate with a RadixCache and stock; assert equal outputs and ``cached_tokens == expect``."""
    ref = stock(model, input_ids, **kwargs)
    cache, _ = assert_same_as_stock(model, input_ids, cache=RadixCache(store), reference=ref, **kwargs)
    assert cache.cached_tokens == expect
    return ref


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_switching_adapters_never_reads_another_adapters_kv(kind):
    model = peft_model(kind)
    store = store_for(model.base_model.model, BS)
    prompt = ids(PROMPT)
    model.set_adapter("x")
    out_a = run(model, store, prompt, [0])
    model.set_adapter("y")
    out_b = run(model, store, prompt, [0])  # the reported bug: b read a's 24 cached tokens
    assert not torch.equal(out_a.logits[0], out_b.logits[0])  # the adapters do differ
    run(model, store, prompt, [FULL])  # a repeat under one adapter hits
    model.set_adapter("x")
    run(model, store, prompt, [FULL])
    with model.disable_adapter():  # the base model: its own key
        run(model, store, prompt, [0])
        run(model, store, prompt, [FULL])


def test_disabled_adapters_key_as_the_base_model():
    base = build("llama-sdpa")
    store = store_for(base, BS)
    prompt = ids(PROMPT)
    run(base, store, prompt, [0])
    flushes = store.stats()["flushes"]
    # Wrapping adds adapter parameters, keyed by their own digest: the base KV stays valid.
    model = get_peft_model(base, lora(1), adapter_name="x").eval()
    with model.disable_adapter():
        run(model, store, prompt, [FULL])  # the plain model's KV, the same computation
    run(model, store, prompt, [0])  # adapter x, never cached
    with model.disable_adapter():
        run(model, store, prompt, [FULL])
    assert store.stats()["flushes"] == flushes


def test_a_mixed_adapter_batch_keys_each_row_by_its_adapter():
    model = peft_model()
    store = store_for(model.base_model.model, BS)
    model.set_adapter("x")
    run(model, store, ids(PROMPT), [0])
    rows = ids(PROMPT, PROMPT, PROMPT)
    names = ["y", "x", "__base__"]
    run(model, store, rows, [0, 0, 0], adapter_names=names)  # the batch preloads min over rows
    run(model, store, rows, [FULL] * 3, adapter_names=names)
    # Each row committed under its own adapter: single-adapter calls hit them.
    model.set_adapter("y")
    run(model, store, ids(PROMPT), [FULL])
    with model.disable_adapter():
        run(model, store, ids(PROMPT), [FULL])


def test_an_adapter_recreated_under_its_name_with_other_weights_misses():
    model = peft_model()
    store = store_for(model.base_model.model, BS)
    model.set_adapter("y")
    run(model, store, ids(PROMPT), [0])
    run(model, store, ids(PROMPT), [FULL])
    model.set_adapter("x")
    model.delete_adapter("y")
    model.add_adapter("y", lora(3))
    model.set_adapter("y")
    model.eval()
    run(model, store, ids(PROMPT), [0])
    # Only the scaling changes (same matrices): still another adapter's KV.
    for layer in hf_patch.keys.adapters.tuner_layers(model):
        layer[1].scaling["y"] *= 2
    run(model, store, ids(PROMPT), [0])
    run(model, store, ids(PROMPT), [FULL])


def test_merging_an_adapter_flushes_like_any_weight_change():
    model = peft_model()
    store = store_for(model.base_model.model, BS)
    model.set_adapter("x")
    run(model, store, ids(PROMPT), [0])
    flushes = store.stats()["flushes"]
    model.merge_adapter()  # writes the base weights through .data: no version counter sees it
    run(model, store, ids(PROMPT), [0])
    assert store.stats()["flushes"] == flushes + 1
    run(model, store, ids(PROMPT), [FULL])
    model.unmerge_adapter()
    run(model, store, ids(PROMPT), [0])
    assert store.stats()["flushes"] == flushes + 2


def test_prompt_tuning_runs_without_reuse_and_says_why(caplog):
    base = build("llama-sdpa")
    store = store_for(base, BS)
    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = get_peft_model(base, config).eval()
    with caplog.at_level("WARNING", logger="hf_patch.keys.inputs"):
        run(model, store, ids(PROMPT), [0], attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
        run(model, store, ids(PROMPT), [0], attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    assert any("prepare_inputs_for_generation" in r.getMessage() for r in caplog.records)
    stats = store.stats()
    assert stats["uncacheable_requests"] == 2 and stats["cached_blocks"] == 0


def test_adapter_prefixes_save_and_restore_for_the_same_adapter_weights(tmp_path):
    model = peft_model()
    inner = model.base_model.model
    store = store_for(inner, BS)
    model.set_adapter("x")
    run(model, store, ids(PROMPT), [0])
    path = tmp_path / "kv.safetensors"
    hf_patch.save_cache(inner, path, store=store)
    fresh = store_for(inner, BS)
    result = hf_patch.restore_cache(inner, path, store=fresh)
    assert result.restored_tokens > 0
    run(model, fresh, ids(PROMPT), [FULL])
    model.set_adapter("y")
    run(model, fresh, ids(PROMPT), [0])  # a's restored KV is not b's
    with model.disable_adapter():
        run(model, fresh, ids(PROMPT), [0])
    # Saving under a namespace filter keeps the adapter's prefixes of that namespace.
    model.set_adapter("x")
    filtered = tmp_path / "ns.safetensors"
    assert hf_patch.save_cache(inner, filtered, store=store, namespaces=[None]).num_blocks > 0
    # A file of this model written while the identity hashed the adapters' weights too (with an
    # adapter_keys field) is refused: its layout of keys predates base-only identities.
    old = tmp_path / "old.safetensors"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_patch.identity, "base_named_parameters", lambda m: list(m.named_parameters()))
        identity = {**hf_patch.model_identity(inner), "adapter_keys": "per-row adapter digests"}
    store.save(old, identity=identity, rename=lambda ns: ns[1])
    with pytest.raises(CacheFileMismatch):
        hf_patch.restore_cache(inner, old, store=store_for(inner, BS))
