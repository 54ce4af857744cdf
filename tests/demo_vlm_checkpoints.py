"""Tiny Gemma 3- and LLaVA-NeXT-style checkpoints with their processors, saved by the tests (no
hub): the built-in tokenizer with each family's image tokens, the family's own image processor
at a tiny size, and a chat template that writes images where the family does. (Qwen-VL and
LLaVA-OneVision processors need a video processor, which needs torchvision: not here.)"""

from __future__ import annotations

import torch

from demo.model.loading import build_tokenizer, unreadable_ids
from tests.demo_checkpoints import VLM_TEMPLATE

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.3)  # fmt: skip


def _template(image: str) -> str:
    return VLM_TEMPLATE.replace("<image>", image)


def _tokenizer(specials: list[str], **named):
    """The built-in tokenizer with ``specials`` added; ``named``: model-specific special tokens
    a processor reads as attributes (``tokenizer.boi_token``), saved with the tokenizer."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(512)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, pad_token=base.pad_token, eos_token=base.eos_token,
        model_max_length=base.model_max_length, extra_special_tokens=named,
    )  # fmt: skip
    tokenizer.chat_template = base.chat_template
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def _finish(model, tokenizer, processor, path, placeholders: list[int]) -> str:
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.suppress_tokens = [*unreadable_ids(tokenizer), *placeholders]
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return str(path)


def _text(tokenizer, **extra) -> dict:
    ids = dict(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    return {**_TEXT, **ids, **extra}


def save_gemma3(path, seed: int = 0) -> str:
    """Gemma 3: a SigLIP tower at 32x32 in patches of 8, pooled to 4 tokens per image."""
    from transformers import AutoConfig, AutoModelForImageTextToText, Gemma3ImageProcessor, Gemma3Processor

    tokens = ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    tokenizer = _tokenizer(tokens, boi_token=tokens[0], image_token=tokens[1], eoi_token=tokens[2])
    boi, image, eoi = tokenizer.convert_tokens_to_ids(tokens)
    image_processor = Gemma3ImageProcessor(size={"height": 32, "width": 32})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4,
                                chat_template=_template("<start_of_image>"))  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    text = _text(tokenizer, model_type="gemma3_text", sliding_window=16)
    config = AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, image_token_id=image,
                                  boi_token_id=boi, eoi_token_id=eoi, mm_tokens_per_image=4)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config).eval()
    return _finish(model, tokenizer, processor, path, [boi, image, eoi])


def save_llava_next(path, seed: int = 0) -> str:
    """LLaVA-NeXT: a CLIP tower at 32x32 in patches of 8, any-resolution tiles up to 64x64."""
    from transformers import (
        AutoConfig,
        AutoModelForImageTextToText,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
    )

    tokenizer = _tokenizer(["<image>"])
    image = tokenizer.convert_tokens_to_ids("<image>")
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    image_processor = LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                              image_grid_pinpoints=pinpoints)  # fmt: skip
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=VLM_TEMPLATE, image_token="<image>")  # fmt: skip
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    config = AutoConfig.for_model("llava_next", text_config=_text(tokenizer, model_type="llama"), vision_config=vision,
                                  image_token_id=image, image_grid_pinpoints=pinpoints, vision_feature_layer=-1)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config).eval()
    return _finish(model, tokenizer, processor, path, [image])
