"""What a server that loads and unloads adapters at run time needs from hf_patch: adapter weights
outside the weights fingerprint and the file identity (loading or deleting one keeps every other
prefix), the KV of deleted / replaced adapters dropped, cache files restoring per adapter
digest, task prompts keyed by the active adapter, no image features shared across adapters."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

import hf_patch  # noqa: E402
from hf_patch.keys import image_features  # noqa: E402
from tests.hf_models import (  # noqa: E402
    assert_same_as_stock,
    build,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    stock,
    store_for,
)
from tests.test_hf_adapters import BS, FULL, PROMPT, lora, peft_model, run  # noqa: E402
from tests.vlm_models import build_vlm, image, pixels  # noqa: E402


def cache_all(model, store) -> dict:
    """PROMPT under adapters x, y and the base (None), each a miss; the blocks each one cached."""
    blocks = {}
    for name in ("x", "y", None):
        before = store.stats()["cached_blocks"]
        if name is None:
            with model.disable_adapter():
                run(model, store, ids(PROMPT), [0])
        else:
            model.set_adapter(name)
            run(model, store, ids(PROMPT), [0])
        blocks[name] = store.stats()["cached_blocks"] - before
    assert all(blocks.values())
    return blocks


def test_loading_and_deleting_adapters_keeps_every_other_prefix():
    model = peft_model()
    store = store_for(model.base_model.model, BS)
    model.set_adapter("x")
    run(model, store, ids(PROMPT), [0])
    with model.disable_adapter():
        run(model, store, ids(PROMPT), [0])
    flushes = store.stats()["flushes"]
    torch.manual_seed(5)
    model.add_adapter("z", lora(5))  # new adapter parameters: nobody's KV changed
    model.eval()
    model.set_adapter("x")
    run(model, store, ids(PROMPT), [FULL])
    model.delete_adapter("z")
    with model.disable_adapter():
        run(model, store, ids(PROMPT), [FULL])
    assert store.stats()["flushes"] == flushes


def test_drop_stale_adapters_frees_a_deleted_or_replaced_adapters_kv_only():
    model = peft_model()
    inner = model.base_model.model
    store = store_for(inner, BS)
    blocks = cache_all(model, store)
    assert hf_patch.drop_stale_adapters(inner, store) == 0  # every adapter still there, same weights
    cached = store.stats()["cached_blocks"]
    model.set_adapter("x")
    model.delete_adapter("y")
    assert hf_patch.drop_stale_adapters(inner, store) == blocks["y"]
    assert store.stats()["cached_blocks"] == cached - blocks["y"]
    store.check_invariants()
    # y again with other weights: its old KV would have been wrong for it, and it is gone anyway.
    model.add_adapter("y", lora(7))
    model.eval()
    model.set_adapter("y")
    run(model, store, ids(PROMPT), [0])
    model.set_adapter("x")
    run(model, store, ids(PROMPT), [FULL])
    with model.disable_adapter():
        run(model, store, ids(PROMPT), [FULL])


def test_a_restore_keeps_base_and_unchanged_adapters_and_drops_changed_ones(tmp_path):
    model = peft_model()
    inner = model.base_model.model
    store = store_for(inner, BS)
    blocks = cache_all(model, store)
    path = tmp_path / "kv.safetensors"
    hf_patch.save_cache(inner, path, store=store)
    # "After a restart": y re-created with other weights before the restore.
    model.delete_adapter("y")
    model.add_adapter("y", lora(9))
    model.eval()
    fresh = store_for(inner, BS)
    result = hf_patch.restore_cache(inner, path, store=fresh)
    fresh.check_invariants()
    assert result.restored_blocks == blocks["x"] + blocks[None] and result.dropped_blocks == blocks["y"]
    assert fresh.stats()["cached_blocks"] == result.restored_blocks
    model.set_adapter("x")
    run(model, fresh, ids(PROMPT), [FULL])
    with model.disable_adapter():
        run(model, fresh, ids(PROMPT), [FULL])
    model.set_adapter("y")
    run(model, fresh, ids(PROMPT), [0])


def test_a_plain_models_file_restores_into_the_model_with_adapters(tmp_path):
    base = build("llama-sdpa")
    store = store_for(base, BS)
    run(base, store, ids(PROMPT), [0])
    path = tmp_path / "plain.safetensors"
    saved = hf_patch.save_cache(base, path, store=store)
    model = get_peft_model(base, lora(1), adapter_name="x").eval()
    fresh = store_for(base, BS)
    assert hf_patch.restore_cache(base, path, store=fresh).restored_blocks == saved.num_blocks > 0
    with model.disable_adapter():
        run(model, fresh, ids(PROMPT), [FULL])
    run(model, fresh, ids(PROMPT), [0])  # the adapter's rows never read the base KV


def test_task_prompts_pinned_under_an_adapter_are_keyed_by_it():
    model = peft_model()
    inner = model.base_model.model
    store = store_for(inner, BS)
    model.set_adapter("x")
    hf_patch.pin_prompts(inner, {"t": PROMPT}, store=store)

    def cached() -> list[int]:
        ref = stock(model, ids(PROMPT))
        cache, _ = assert_same_as_stock(model, ids(PROMPT), store, reference=ref, check_invariants=False)
        return cache.cached_tokens

    assert cached() == [FULL]  # x's rows read x's pinned KV
    model.set_adapter("y")
    assert cached() == [0]
    with model.disable_adapter():
        assert cached() == [0]


def test_image_features_are_not_shared_under_adapters():
    vlm = build_vlm("llava")
    vlm.config.vision_feature_layer = -1  # the tower's last layer (-2 is its embeddings: no LoRA there)
    assert image_features.for_model(vlm) is not None
    target = r".*\.(q_proj|v_proj)"  # the vision tower's attention too: its features depend on it
    model = get_peft_model(vlm, LoraConfig(r=4, target_modules=target, init_lora_weights=False)).eval()
    inner = model.base_model.model
    assert image_features.for_model(inner) is None
    store = hf_patch.build_store(inner, block_size=BS, budget_tokens=1024)
    prompt = ids([5, 6, 7] + [127] * 16 + [8, 9, 10, 11, 12])
    inputs = pixels("llava", [[image(11)]])
    run(model, store, prompt, [0], **inputs)
    run(model, store, prompt, [20], **inputs)  # the image's whole blocks, under the adapter
    with model.disable_adapter():
        run(model, store, prompt, [0], **inputs)
