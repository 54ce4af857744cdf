"""Vision-language checkpoints: loaded with their processor; chat messages with images to model inputs.

A checkpoint whose config is an image-text-to-text model (LLaVA, Idefics3, SmolVLM, InternVL,
Qwen2-VL, ...) loads as ``AutoModelForImageTextToText`` with its ``AutoProcessor`` (image processor,
tokenizer and chat template). Chat messages are rendered by the processor's own
``apply_chat_template``, images as content parts, so the prompt ids and ``pixel_values`` are what
the checkpoint's code makes for a user calling it offline. Control tokens written in a message's
text are encoded as plain text (transformers' ``sanitize_control_tokens``, 5.23 on); where the
processor cannot do that (one without the option), a message containing one is refused.

Text-only chats on such a server go the same way (one rendering for every prompt, so a pinned
task prompt and later turns share their prefixes). hf_patch keys images for the families in
hf_patch.keys.vlm_families (docs/vlm.md); other families answer requests with images without
reuse (and say so in the log).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from demo.errors import ApiError
from demo.model import processors
from demo.model.chat_tokens import control_tokens

_TEXT_INPUTS = ("input_ids", "attention_mask")


def is_vision_config(config) -> bool:
    """Whether ``config`` is an image-text-to-text model with a vision tower."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    return (
        model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and getattr(config, "vision_config", None) is not None
    )


def load(name_or_path: str, config, kwargs: dict, model_kwargs: dict):
    """``(model, processor)`` of a vision-language checkpoint (from_pretrained's own loading; the
    processor without its video processor where torchvision is missing, demo.model.processors)."""
    from transformers import AutoModelForImageTextToText

    processor = processors.load_processor(name_or_path, config, kwargs)
    if getattr(processor, "image_processor", None) is None or getattr(processor, "tokenizer", None) is None:
        raise OSError(f"{name_or_path}: its processor has no image processor and tokenizer")
    model = AutoModelForImageTextToText.from_pretrained(name_or_path, **model_kwargs)
    return model, processor


def processed_pixels(processor, width: int, height: int, part: str = "image_processor") -> int:
    """Pixels per image the processor's resize makes of a ``width`` x ``height`` image, computed
    from its ``size`` rule before anything is allocated (demo.api.images bounds it): a short
    side scaled to ``shortest_edge`` (within ``longest_edge``), a long side to ``longest_edge``,
    a fixed ``height`` x ``width``, a ``max_pixels`` cap; for Qwen2-VL's family (``merge_size``)
    ``shortest_edge`` and ``longest_edge`` are pixel counts. The image's own pixels where the
    processor does not resize or names no rule this knows. The resize's pixels, an upper bound
    within a few percent; processors that then tile (Idefics3, SmolVLM, InternVL) add a bounded
    number of fixed-size tiles or a global view (at most ~13 x 384 x 384), not a multiple of it.
    ``part="video_processor"``: the same for one frame of a video (its video processor's rule)."""
    ip = getattr(processor, part, None)
    size = getattr(ip, "size", None)
    if ip is None or size is None or getattr(ip, "do_resize", True) is False:
        return width * height
    if isinstance(size, int):
        size = {"shortest_edge": size}

    def rule(key: str):
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
        return value if isinstance(value, (int, float)) and value > 0 else None

    short, long = min(width, height), max(width, height)
    if getattr(ip, "merge_size", None) is not None:  # Qwen2-VL's family: size is in pixels
        # (smart_resize keeps the pixel count within [shortest_edge, longest_edge], in 28-pixel steps)
        step = 2 * (getattr(ip, "patch_size", None) or 14) * ip.merge_size
        low, high = rule("shortest_edge") or 0, rule("longest_edge") or width * height
        return int(min(max(width * height, low), high)) + step * (width + height + step)
    if rule("height") and rule("width"):
        return int(rule("height") * rule("width"))
    if rule("shortest_edge") or rule("longest_edge"):
        scale = rule("shortest_edge") / short if rule("shortest_edge") else rule("longest_edge") / long
        if rule("longest_edge") and long * scale > rule("longest_edge"):
            scale = rule("longest_edge") / long
        return (int(width * scale) + 1) * (int(height * scale) + 1)
    cap = rule("max_pixels") or getattr(ip, "max_pixels", None)
    return min(width * height, int(cap)) if isinstance(cap, (int, float)) and cap > 0 else width * height


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel_values etc.; {} without images


def _sanitizes(processor) -> bool:
    return "sanitize_control_tokens" in inspect.signature(processor.apply_chat_template).parameters


def video_refusal(processor) -> str | None:
    """Why this processor takes no videos (words for a 400), or None when it does."""
    if processors.has_videos(processor):
        return None
    if processors.videos_dropped(processor):
        return "its video processor needs torchvision, which is not installed on this server"
    return "it takes no videos"


def uniform_frames(total: int, count: int) -> list[int]:
    """``count`` frame indices spread evenly over ``total`` frames, first and last included
    (vLLM's default video sampling: ``linspace(0, total - 1, count)`` rounded down); every frame
    where ``total <= count``."""
    if total <= count:
        return list(range(total))
    return np.linspace(0, total - 1, count, dtype=int).tolist()


def frame_sampler(processor, count: int):
    """``sample(metadata) -> frame indices``: the frames of a video (transformers' VideoMetadata
    fields) that the processor hands the model: its own ``sample_frames`` (with its configured
    ``fps`` / ``num_frames``) where it samples (``do_sample_frames``), else ``count`` frames spread
    evenly (``uniform_frames``, as vLLM: ``--video-frames``, demo.api.images.MediaPolicy). An odd count is taken
    as is: Qwen-VL processors (temporal patch 2) repeat the last frame to fill the last patch."""
    from transformers.video_utils import VideoMetadata

    videos = processor.video_processor

    def sample(metadata: dict) -> list[int]:
        if not getattr(videos, "do_sample_frames", False):
            return uniform_frames(metadata["total_num_frames"], count)
        return [int(i) for i in videos.sample_frames(VideoMetadata(**metadata))]

    return sample


def _conversation(processor, messages: list[dict], images: list, videos: list = ()) -> list[dict]:
    """Messages in the processor's form: text parts, image parts holding the PIL images and video
    parts holding the sampled frames (demo.api.videos.Video)."""
    pending, clips = iter(images), iter(videos)
    tokens = (
        None if _sanitizes(processor) else control_tokens(processor.tokenizer, processor.chat_template or "")
    )
    out = []
    for i, m in enumerate(messages):
        parts = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) else m["content"]
        content = []
        for part in parts:
            if part["type"] == "image_url":
                content.append({"type": "image", "image": next(pending)})
                continue
            if part["type"] == "video_url":
                content.append({"type": "video", "video": next(clips).frames})
                continue
            if tokens and any(t in part["text"] for t in tokens):
                raise ApiError(
                    400,
                    f"messages[{i}].content holds a control token of the model's chat format "
                    "(transformers 5.23 or later encodes them as text)",
                    f"messages[{i}].content",
                )
            content.append({"type": "text", "text": part["text"]})
        out.append({"role": m["role"], "content": content})
    return out


def render(processor, messages: list[dict], images: list, videos: list = ()) -> Prompt:
    """The prompt of checked chat ``messages`` (demo.api.schema) with ``images`` (PIL, one per image
    part in order) and ``videos`` (demo.api.videos.Video, frames already sampled as the processor
    samples them: handed over with their metadata and ``do_sample_frames=False``), ending with the
    assistant's turn. ApiError 400 when the processor refuses."""
    extra = {"sanitize_control_tokens": True} if _sanitizes(processor) else {}
    if videos:
        from transformers.video_utils import VideoMetadata

        metadata = [VideoMetadata(**v.metadata) for v in videos]
        extra["processor_kwargs"] = {"video_metadata": metadata, "do_sample_frames": False}
    try:
        out = processor.apply_chat_template(
            _conversation(processor, messages, images, videos),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            **extra,
        )
    except ApiError:
        raise
    except Exception as e:  # a template or processor that refuses these messages / images
        raise ApiError(400, f"the model's processor refused the messages: {e}", "messages") from None
    inputs = {k: v for k, v in out.items() if k not in _TEXT_INPUTS} if images or videos else {}
    return Prompt(out["input_ids"][0].tolist(), inputs)


def on_model(inputs: dict, model) -> dict:
    """``inputs`` on the model's device, pixels (``pixel_values``, ``pixel_values_videos``) in its
    dtype. Other floating inputs keep theirs: Qwen2.5-VL's ``second_per_grid_ts`` sets temporal
    positions (``int(t * seconds * tokens_per_second)``), which bfloat16's rounding would move
    off what the processor's float32 gives."""
    out = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            pixels = name.startswith("pixel_values") and value.is_floating_point()
            value = value.to(device=model.device, dtype=model.dtype if pixels else value.dtype)
        out[name] = value
    return out
