"""Image requests as rows of one generate() call: each family's rule for merging the rows' inputs.

A request with images carries its processor's outputs beside the ids (demo.model.vision.render:
``pixel_values``, ``image_sizes``, ``image_grid_thw``, ``token_type_ids``, ...), made for that
request alone. A batch of such requests (and text requests) is one left-padded generate() call
whose inputs are what the checkpoint's processor returns for the batch of prompts, in row order:

- ``items``: one entry per image (or video, tile, patch) along dim 0, over the rows in order:
  concatenated, the trailing dims zero-padded to the batch's largest (LLaVA-NeXT / OneVision
  tiles ``[images, tiles, C, H, W]`` padded with zero tiles, Mistral 3 images
  ``[images, C, H, W]`` to the largest H and W; Qwen-VL patches ``[patches, D]`` and grids
  ``[images, 3]``, ``image_sizes``, Llama 4 tiles); lists are concatenated;
- ``rows``: one entry per row along dim 0 (Idefics3 / SmolVLM ``[rows, images, C, H, W]`` and
  ``pixel_attention_mask``, LLaVA-OneVision ``batch_num_images``): a row without the input gets
  zeros (a zero image is padding to those families; zero images in a row count none), trailing
  dims zero-padded to the largest;
- ``tokens``: one value per token ``[1, prompt]`` (Gemma 3 ``token_type_ids``, Qwen-VL and
  GLM-4V ``mm_token_type_ids``): each row's extended with 0 over its reply so far (a resumed
  row's context is its prompt and reply: text) and left-padded with 0 to the batch's width;
  rows without images get zeros.

Families not in ``RULES`` (and requests holding an input their family's rule does not name) run
alone, as before: `alone_reason` says why, for the engine's one log line. So does a text request
whose prompt holds a placeholder id (`placeholder_ids`): beside image rows the model would count
it as an image's token and fail the whole call. (A row whose reply holds one is not paused:
demo.engine.batching.) The rules are the layouts hf_patch keys (hf_patch.keys.vlm_families),
so such a batch is exact through the prefix cache too (tested per rule against the request
alone in tests/test_demo_vlm_batching.py, against the processor's own batch in
tests/test_demo_vlm_merge.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

KINDS = ("items", "rows", "tokens")

_LLAVA = {"pixel_values": "items"}
_ANYRES = {"pixel_values": "items", "image_sizes": "items"}
_QWEN = {
    "pixel_values": "items",
    "image_grid_thw": "items",
    "pixel_values_videos": "items",
    "video_grid_thw": "items",
    "second_per_grid_ts": "items",
    "mm_token_type_ids": "tokens",
}
_ROWS = {"pixel_values": "rows", "pixel_attention_mask": "rows"}

# model_type -> {input name: kind}: the families whose padded batches hf_patch keys and
# transformers' models take (image rows of other sizes and text-only rows mixed).
RULES: dict[str, dict[str, str]] = {
    "llava": _LLAVA,
    "vipllava": _LLAVA,
    "internvl": _LLAVA,
    "aya_vision": _LLAVA,
    "gemma3": {"pixel_values": "items", "token_type_ids": "tokens"},
    "llava_next": _ANYRES,
    "llava_next_video": {**_ANYRES, "pixel_values_videos": "items"},
    "llava_onevision": {**_ANYRES, "pixel_values_videos": "items", "batch_num_images": "rows"},
    "mistral3": _ANYRES,
    "llama4": _LLAVA,
    "idefics3": _ROWS,
    "smolvlm": _ROWS,
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    "qwen3_vl_moe": _QWEN,
    # GLM-4V's videos share the image placeholder id (not keyed): images only
    "glm4v": {k: v for k, v in _QWEN.items() if "video" not in k},
    "glm46v": {k: v for k, v in _QWEN.items() if "video" not in k},
}


@dataclass(frozen=True)
class Rule:
    """How one family's per-request inputs merge: ``kinds`` maps an input's name to its kind."""

    family: str
    kinds: dict

    def __post_init__(self) -> None:
        for name, kind in self.kinds.items():
            if kind not in KINDS:
                raise ValueError(f"Rule.kinds[{name!r}] must be one of {KINDS}, got {kind!r}")


def rule_for(model) -> Rule | None:
    """``model``'s merge rule, or None (its image requests run alone: `alone_reason`)."""
    family = getattr(model.config, "model_type", None)
    kinds = RULES.get(family)
    return Rule(family, kinds) if kinds is not None else None


_PLACEHOLDERS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def placeholder_ids(model) -> frozenset[int]:
    """The ids the model reads as an image's or video's placeholders (its config's)."""
    ids = (getattr(model.config, name, None) for name in _PLACEHOLDERS)
    return frozenset(i for i in ids if isinstance(i, int))


def alone_reason(
    rule: Rule | None, model_type: str | None, inputs: dict, prompt: list[int], placeholders: frozenset[int]
) -> str | None:
    """Why a request with ``inputs`` for ``prompt`` cannot be a row of a batch, or None when it
    can. The reason names the family, input or token (for one log line). O(prompt)."""
    if not inputs:
        if rule is not None and placeholders and not placeholders.isdisjoint(prompt):
            return f"a text request's prompt holds a {model_type} image placeholder id {sorted(placeholders)}"
        return None
    prompt_len = len(prompt)
    if rule is None:
        return f"no rule merges {model_type!r} image inputs of several requests (demo.model.vision_batch)"
    for name, value in inputs.items():
        kind = rule.kinds.get(name)
        if kind is None:
            return f"{rule.family} input {name!r} has no batch rule (demo.model.vision_batch)"
        if kind == "rows" and (not isinstance(value, torch.Tensor) or value.dim() < 1 or len(value) != 1):
            return f"{rule.family} input {name!r} is not one row"
        if kind == "tokens" and (
            not isinstance(value, torch.Tensor) or tuple(value.shape) != (1, prompt_len)
        ):
            return f"{rule.family} input {name!r} is not one value per prompt token"
        if kind == "items" and not (
            isinstance(value, (list, tuple)) or (isinstance(value, torch.Tensor) and value.dim() >= 1)
        ):
            return f"{rule.family} input {name!r} is neither a tensor of items nor a list"
    return None


@dataclass(frozen=True)
class RowInputs:
    """One batch row: its request's inputs ({} for a text request) and its context length
    (prompt, then the reply so far: ``context_len - prompt_len`` tokens of text)."""

    inputs: dict
    prompt_len: int
    context_len: int


def merge(rule: Rule, rows: Sequence[RowInputs], width: int) -> dict:
    """The batch's inputs for ``rows`` (in row order), left-padded to ``width`` columns, as the
    family's processor lays out a batch of these prompts; {} when no row has images. New
    tensors (the rows' own are not changed), on the CPU, in the rows' dtypes."""
    names = [n for n in rule.kinds if any(n in r.inputs for r in rows)]
    out = {}
    for name in names:
        kind = rule.kinds[name]
        values = [r.inputs.get(name) for r in rows]
        if kind == "items":
            out[name] = _items([v for v in values if v is not None])
        elif kind == "rows":
            out[name] = _padded_cat(values)
        else:
            out[name] = _tokens(values, rows, width)
    return out


def _items(values: list):
    if all(isinstance(v, torch.Tensor) for v in values):
        return _padded_cat(values)
    return [x for v in values for x in (v.tolist() if isinstance(v, torch.Tensor) else v)]


def _padded_cat(values: list) -> torch.Tensor:
    """Concatenate along dim 0, every other dim zero-padded to the largest; a None entry is one
    all-zero entry (a row without the input)."""
    real = [v for v in values if v is not None]
    shape = [max(v.shape[d] for v in real) for d in range(1, real[0].dim())]
    parts = []
    for v in values:
        if v is None:
            parts.append(real[0].new_zeros((1, *shape)))
            continue
        pad = [p for d in reversed(range(1, v.dim())) for p in (0, shape[d - 1] - v.shape[d])]
        parts.append(torch.nn.functional.pad(v, pad) if any(pad) else v)
    return torch.cat(parts)


def _tokens(values: list, rows: Sequence[RowInputs], width: int) -> torch.Tensor:
    dtype = next(v for v in values if v is not None).dtype
    out = torch.zeros((len(rows), width), dtype=dtype)
    for i, (value, row) in enumerate(zip(values, rows)):
        if value is not None:
            start = width - row.context_len
            out[i, start : start + row.prompt_len] = value[0]
    return out
