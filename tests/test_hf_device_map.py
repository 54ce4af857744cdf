"""Models split by accelerate (device_map hooks, CPU and disk offload through offload_folder)
generate with a RadixCache exactly as stock generate() does, cold and warm, in-batch sharing
included. On CPU: "disk" layers live in offload_folder and are loaded by their hooks per forward."""

from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model
from transformers import AutoModelForCausalLM

from tests.hf_models import (
    assert_same_as_stock,
    block_floor,
    build,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    store_for,
    tokens,
)

BS = 4
DOC = tokens(40, seed=120)
DEVICE_MAP = {
    "model.embed_tokens": "cpu",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "lm_head": "disk",
}


def from_pretrained(tmp_path):
    build("llama-sdpa").save_pretrained(tmp_path / "ckpt")
    return AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map=DEVICE_MAP, offload_folder=tmp_path / "offload", dtype=torch.float32
    ).eval()


def dispatched(tmp_path):
    return dispatch_model(build("llama-sdpa"), device_map=DEVICE_MAP, main_device="cpu",
                          offload_dir=str(tmp_path / "offload"))  # fmt: skip


@pytest.mark.parametrize("load", [from_pretrained, dispatched], ids=["from_pretrained", "dispatch_model"])
def test_offloaded_model_generates_like_stock(tmp_path, load):
    model = load(tmp_path)
    assert any(p.device.type == "meta" for p in model.parameters())  # really offloaded to disk
    reference = build("llama-sdpa")  # the same weights, not dispatched
    store = store_for(model, BS)
    input_ids, mask = left_pad([DOC + tokens(5, seed=121), DOC + tokens(8, seed=122)])
    with torch.no_grad():
        plain = reference.generate(
            input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0
        )
    for _ in range(2):  # cold (in-batch sharing), then warm (every row from the store)
        cache, out = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
        assert torch.equal(out.sequences, plain)
        assert max(cache.cached_tokens) >= block_floor(len(DOC), BS) - BS  # cold: row 0 computed it
