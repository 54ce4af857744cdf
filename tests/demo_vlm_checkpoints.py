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


def _video_template(image: str, video: str) -> str:
    return _template(image).replace(
        "{% elif p['type'] == 'text' %}",
        f"{{% elif p['type'] == 'video' %}}{video}{{% elif p['type'] == 'text' %}}",
    )


def _write_json(path, name: str, data: dict) -> None:
    import json
    import os

    os.makedirs(str(path), exist_ok=True)
    with open(os.path.join(str(path), name), "w") as f:
        json.dump(data, f, indent=2)


def _save_parts(model, tokenizer, image_processor, path, placeholders, processor: dict, video: dict) -> str:
    """A checkpoint whose processor is written part by part, as ``processor.save_pretrained``
    writes it: transformers cannot build a processor with a video processor without torchvision
    (not installed here), so the video processor's config is written as its JSON file."""
    image_processor.save_pretrained(str(path))
    _write_json(path, "processor_config.json", processor)
    _write_json(path, "video_preprocessor_config.json", video)
    return _finish(model, tokenizer, tokenizer, path, placeholders)


_QWEN = {  # model type -> (processor class, video processor class, vision config)
    "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLVideoProcessor",
                 dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2)),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor",
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                        window_size=16, fullatt_block_indexes=[0])),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor",
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0])),
}  # fmt: skip


def save_qwen_vl(path, seed: int = 0, model_type: str = "qwen2_5_vl", samples: bool = True) -> str:
    """Qwen2-VL, Qwen2.5-VL or Qwen3-VL (``model_type``): patches of 4 merged 2x2 (one token per
    8x8 pixels), images of 256 to 4,096 pixels, videos sampled at 2 frames per second (4 to 8
    frames; ``samples=False``: not sampled, transformers' default for these processors), frames of
    256 to 1,024 pixels."""
    from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2VLImageProcessor

    processor_class, video_class, vision = _QWEN[model_type]
    tokens = ["<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>"]
    tokenizer = _tokenizer(tokens)
    start, image, video, end = tokenizer.convert_tokens_to_ids(tokens)
    tokenizer.chat_template = _video_template(
        "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    )
    grid = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": 256, "longest_edge": 4096}, **grid)
    # cap_pixels_per_frame: the reference behaviour (and no warning from transformers)
    videos = dict(video_processor_type=video_class, size={"shortest_edge": 256, "longest_edge": 1024},
                  do_sample_frames=True, fps=2.0, min_frames=4, max_frames=8, cap_pixels_per_frame=True, **grid)  # fmt: skip
    if not samples:
        videos = {
            k: v
            for k, v in videos.items()
            if k not in ("do_sample_frames", "fps", "min_frames", "max_frames")
        }
    vision = {**vision, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    if model_type == "qwen3_vl":
        rope["mrope_interleaved"] = True
    text = _text(tokenizer, model_type=f"{model_type}_text", rope_parameters=rope)
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=vision, image_token_id=image,
                                  video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config).eval()
    processor = {"processor_class": processor_class}
    return _save_parts(model, tokenizer, image_processor, path, [start, image, video, end], processor, videos)


def save_llava_onevision(path, seed: int = 0) -> str:
    """LLaVA-OneVision: a SigLIP tower at 32x32 in patches of 8 (all features kept, as the real ones), any-resolution tiles up to 64x64;
    videos of 4 frames sampled uniformly, each pooled to 4 tokens."""
    from transformers import AutoConfig, AutoModelForImageTextToText, LlavaOnevisionImageProcessor

    tokenizer = _tokenizer(["<image>", "<video>"])
    image, video = tokenizer.convert_tokens_to_ids(["<image>", "<video>"])
    tokenizer.chat_template = _video_template("<image>", "<video>")
    pinpoints = [[32, 32], [32, 64], [64, 32], [64, 64]]
    image_processor = LlavaOnevisionImageProcessor(
        size={"height": 32, "width": 32}, image_grid_pinpoints=pinpoints
    )
    videos = dict(video_processor_type="LlavaOnevisionVideoProcessor", size={"height": 32, "width": 32},
                  do_sample_frames=True, num_frames=4)  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    config = AutoConfig.for_model("llava_onevision", text_config=_text(tokenizer, model_type="qwen2"),
                                  vision_config=vision, image_token_id=image, video_token_id=video,
                                  image_grid_pinpoints=pinpoints, vision_feature_select_strategy="full",
                                  vision_feature_layer=-1)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config).eval()
    processor = {"processor_class": "LlavaOnevisionProcessor", "num_image_tokens": 16,
                 "vision_feature_select_strategy": "full", "vision_aspect_ratio": "anyres_max_9"}  # fmt: skip
    return _save_parts(model, tokenizer, image_processor, path, [image, video], processor, videos)


def mp4(
    seed: int, frames: int = 12, size: tuple[int, int] = (48, 40), fps: int = 10, container: str = "mp4"
) -> bytes:
    """An H.264 video (``container``: mp4, matroska, avi) of ``frames`` frames of random pixels
    (width x height ``size``) drawn from ``seed``, written by PyAV."""
    import io

    import av

    g = torch.Generator().manual_seed(seed)
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as box:
        stream = box.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
            box.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        box.mux(stream.encode())
    return out.getvalue()


def decoded(raw: bytes):
    """Every frame of a video (uint8 ``[frames, height, width, 3]``) and its transformers
    VideoMetadata, read as transformers' own PyAV reader reads them (the reference)."""
    import io

    import av
    import numpy as np
    from transformers.video_utils import VideoMetadata

    with av.open(io.BytesIO(raw)) as box:
        stream = box.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in box.decode(video=0)])
        fps = float(stream.average_rate)
        meta = VideoMetadata(total_num_frames=int(stream.frames), fps=fps, width=stream.width, height=stream.height,
                             duration=stream.frames / fps, video_backend="pyav")  # fmt: skip
    return frames, meta
