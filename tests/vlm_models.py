"""Tiny vision-language models built from configs (random weights, no hub) for the image-key tests."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from tests.hf_models import BASE, VOCAB

IMAGE = VOCAB - 1  # the image placeholder id (inside the tiny vocabulary)
TEXT = {**BASE, "model_type": "llama"}
_CLIP = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip


def _llava():
    return AutoConfig.for_model("llava", text_config=TEXT, vision_config=_CLIP, image_token_id=IMAGE)


def _vipllava():
    return AutoConfig.for_model(
        "vipllava", text_config=TEXT, vision_config=_CLIP, image_token_id=IMAGE, vision_feature_layers=[-1]
    )


def _idefics3():
    vision = dict(model_type="idefics3_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    return AutoConfig.for_model(
        "idefics3", text_config=TEXT, vision_config=vision, image_token_id=IMAGE, scale_factor=2
    )


def _smolvlm():
    vision = dict(model_type="smolvlm_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    return AutoConfig.for_model(
        "smolvlm", text_config=TEXT, vision_config=vision, image_token_id=IMAGE, scale_factor=2
    )


def _internvl():
    vision = dict(model_type="internvl_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=[32, 32], patch_size=[8, 8])  # fmt: skip
    return AutoConfig.for_model(
        "internvl", text_config=TEXT, vision_config=vision, image_token_id=IMAGE, image_seq_length=4
    )


def _gemma3():  # not keyed by hf_patch.keys.multimodal: the test of a family it does not know
    text = {**BASE, "model_type": "gemma3_text", "head_dim": 16}
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    return AutoConfig.for_model(
        "gemma3", text_config=text, vision_config=vision, image_token_id=IMAGE, mm_tokens_per_image=4,
        boi_token_id=IMAGE - 1, eoi_token_id=IMAGE - 2,
    )  # fmt: skip


# name -> (config builder, layout of pixel_values, placeholder tokens per image)
VLMS = {
    "llava": (_llava, "items", 16),
    "vipllava": (_vipllava, "items", 16),
    "idefics3": (_idefics3, "rows", 4),
    "smolvlm": (_smolvlm, "rows", 4),
    "internvl": (_internvl, "items", 4),
    "gemma3": (_gemma3, "items", 4),
}


def build_vlm(name: str, seed: int = 0):
    config = VLMS[name][0]()
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config).float().eval()


def image(seed: int) -> torch.Tensor:
    """One processed image ``[3, 32, 32]`` drawn from ``seed`` (no zeros: never padding)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(3, 32, 32, generator=g) + 0.1


def pixels(name: str, images: list[list[torch.Tensor]]) -> dict:
    """The family's image inputs for ``images[row]`` (each row's images in prompt order)."""
    if VLMS[name][1] == "items":
        return {"pixel_values": torch.stack([im for row in images for im in row])}
    most = max(len(row) for row in images)
    out = torch.zeros(len(images), most, 3, 32, 32)
    for b, row in enumerate(images):
        for j, im in enumerate(row):
            out[b, j] = im
    return {"pixel_values": out}
