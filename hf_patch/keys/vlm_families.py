"""Which vision-language families the cache key knows, and how each lays out its image inputs.

A family is keyed when, for every image or video it is given, hf_patch can tell before encoding
(1) which placeholder tokens the item fills, in order, (2) which slice of the pixel input and of
its per-item inputs (sizes, grids) is that item, so its content id covers everything its
features depend on, and (3) how to remove the item from the inputs when the store serves it.
Every model input the family's KV depends on is either hashed into an item's content id, or
checked per call to be a function of the token ids (``mm_token_type_ids``, Gemma 3's
``token_type_ids``), or refused (the call then runs without the store).

Layouts of a modality's pixel input:

- ``items``: ``[num_items, ...]`` in prompt order over the batch's rows (LLaVA, LLaVA-NeXT and
  LLaVA-OneVision tiles ``[items, tiles, C, H, W]``, Mistral 3 ``[items, C, H, W]`` padded to the
  batch's largest image, Gemma 3, InternVL, OneVision videos ``[videos, frames, C, H, W]``);
- ``rows``: ``[batch, max_items, C, H, W]``, an all-zero item is padding (Idefics3, SmolVLM);
- ``patches``: ``[sum of items' patches, D]`` with a grid ``[items, 3]`` (t, h, w) giving each
  item's patch count (Qwen2-VL, Qwen2.5-VL, Qwen3-VL images and videos);
- ``tiles``: ``[sum of items' tiles, C, H, W]``, each tile the same number of placeholders, each
  item's placeholders between the family's begin- and end-of-image tokens (Llama 4).

Positions: the M-RoPE families compute 3-D position ids for the whole prompt in generate()'s
``_prepare_position_ids_for_generation``, before the prefill and while the RadixCache is still
empty (so never from ``rope_deltas`` a previous call left on the model); the prefill slices
them at the cached length, exactly as for a full prefill. Their grids are hashed with the
pixels, and the placeholder count with every item, so an item's key covers its positions too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_patch.forward_args import forward_parameters

LAYOUTS = ("items", "rows", "patches", "tiles")


@dataclass(frozen=True)
class Modality:
    """How one modality of a family reaches the model.

    ``encoder_inputs``: per-item inputs the encoder takes beside the pixels (removed with a
    served item, hashed with it); ``hashed_inputs``: per-item inputs that stay (hashed only);
    ``counts(model, kwargs)``: placeholders per item, None for an equal split over the items, or
    ``runs=True``: each maximal run of placeholders is one item (counts known only to the
    encoder); ``trim(model, pixels, kwargs, i)``: item ``i``'s pixels without batch padding."""

    name: str  # "image" | "video": its key in generate()'s mm_encoder_outputs
    pixels: str
    token: str  # config attribute holding the placeholder id
    layout: str  # items | rows | patches | tiles
    encoder_inputs: tuple[str, ...] = ()
    hashed_inputs: tuple[str, ...] = ()
    counts: Callable | None = None
    runs: bool = False
    delimiters: tuple[str, str] | None = None
    trim: Callable | None = None

    def __post_init__(self) -> None:
        if self.name not in ("image", "video"):
            raise ValueError(f"Modality.name must be 'image' or 'video', got {self.name!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"Modality.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "patches" and not self.encoder_inputs:
            raise ValueError("a 'patches' modality needs its grid as its first encoder input")


@dataclass(frozen=True)
class Family:
    """``token_types``: inputs checked per call to equal what the ids imply (name -> the value
    of image and of video placeholders); ``row_inputs``: per-row inputs hashed into each item of
    the row; where a call gives one, its items are encoded all or none (removing some items of a
    row would change the row's value and so the others' features)."""

    modalities: tuple[Modality, ...]
    token_types: tuple[str, ...] = ()
    row_inputs: tuple[str, ...] = ()
    extra_inputs: tuple[str, ...] = ()  # encoder inputs of the rows layout (pixel_attention_mask)
    feature: str = "pooler_output"  # the encoder output's field the model reads its features from


def _grid_counts(grid_input: str) -> Callable:
    def counts(model, kwargs) -> list[int]:
        merge = model.config.vision_config.spatial_merge_size
        return (kwargs[grid_input].prod(-1) // merge**2).tolist()

    return counts


def _mistral3_counts(model, kwargs) -> list[int]:
    ratio = model.config.vision_config.patch_size * model.config.spatial_merge_size
    return (torch.as_tensor(kwargs["image_sizes"]) // ratio).prod(-1).tolist()


def _trailing_zero_tiles(model, pixels: torch.Tensor, kwargs: dict, i: int) -> torch.Tensor:
    """Tiles ``[tiles, C, H, W]`` without the all-zero tiles a batch pads with. Exact as a key
    together with ``image_sizes``: the real tile count is a function of the size."""
    tiles = pixels[i]
    real = tiles.flatten(1).ne(0).any(dim=1).nonzero()
    return tiles[: int(real[-1]) + 1] if len(real) else tiles[:0]


def _crop_to_size(model, pixels: torch.Tensor, kwargs: dict, i: int) -> torch.Tensor:
    """Pixtral reads only the ``image_sizes[i]`` corner of a padded image."""
    h, w = (int(x) for x in kwargs["image_sizes"][i])
    return pixels[i][..., :h, :w]


_IMAGE = dict(name="image", pixels="pixel_values", token="image_token_id")
_QWEN_IMAGE = Modality(**_IMAGE, layout="patches", encoder_inputs=("image_grid_thw",),
                       counts=_grid_counts("image_grid_thw"))  # fmt: skip
_QWEN_VIDEO = Modality(
    "video", "pixel_values_videos", "video_token_id", "patches", encoder_inputs=("video_grid_thw",),
    hashed_inputs=("second_per_grid_ts",), counts=_grid_counts("video_grid_thw"),
)  # fmt: skip
_ANYRES = Modality(**_IMAGE, layout="items", encoder_inputs=("image_sizes",), runs=True,
                   trim=_trailing_zero_tiles)  # fmt: skip
_QWEN = Family((_QWEN_IMAGE, _QWEN_VIDEO), token_types=("mm_token_type_ids",))
_PIXTRAL = Modality(**_IMAGE, layout="items", encoder_inputs=("image_sizes",), counts=_mistral3_counts,
                    trim=_crop_to_size)  # fmt: skip

FAMILIES: dict[str, Family] = {
    "llava": Family((Modality(**_IMAGE, layout="items"),)),
    "vipllava": Family((Modality(**_IMAGE, layout="items"),)),
    "internvl": Family((Modality(**_IMAGE, layout="items"),)),
    "idefics3": Family((Modality(**_IMAGE, layout="rows"),), extra_inputs=("pixel_attention_mask",)),
    "smolvlm": Family((Modality(**_IMAGE, layout="rows"),), extra_inputs=("pixel_attention_mask",)),
    "llava_next": Family((_ANYRES,)),
    "llava_next_video": Family(
        (_ANYRES, Modality("video", "pixel_values_videos", "video_token_id", "items"))
    ),
    "aya_vision": Family((Modality(**_IMAGE, layout="items"),)),
    # OneVision's image features depend on how many images their row has (one: any-resolution
    # tiles; more: the base tile only) when the call gives batch_num_images: hashed per row.
    "llava_onevision": Family(
        (_ANYRES, Modality("video", "pixel_values_videos", "video_token_id", "items")),
        row_inputs=("batch_num_images",),
    ),
    "mistral3": Family((_PIXTRAL,)),
    "gemma3": Family((Modality(**_IMAGE, layout="items"),), token_types=("token_type_ids",)),
    # Llama 4: every image's tiles (and its global tile) in one flat batch; the model projects
    # the encoder's last_hidden_state (one row per placeholder) itself.
    "llama4": Family(
        (Modality(**_IMAGE, layout="tiles", delimiters=("boi_token_id", "eoi_token_id")),),
        feature="last_hidden_state",
    ),
    # GLM-4V: Qwen's layout, but its videos reuse the image placeholder id (told apart only by
    # mm_token_type_ids): videos are not keyed (pixel_values_videos is off the allowlist).
    "glm4v": Family((_QWEN_IMAGE,), token_types=("mm_token_type_ids",)),
    "glm46v": Family((_QWEN_IMAGE,), token_types=("mm_token_type_ids",)),
    "qwen2_vl": _QWEN,
    "qwen2_5_vl": _QWEN,
    "qwen3_vl": _QWEN,
    "qwen3_vl_moe": _QWEN,
}


def family_of(model) -> Family | None:
    """``model``'s family, None when the key does not know it (or the model takes no
    pre-encoded features, which hf_patch needs to skip or feed encoded images)."""
    if "mm_encoder_outputs" not in forward_parameters(model):  # GenerationMixin._supports_mm_encoder_outputs
        return None
    return FAMILIES.get(getattr(model.config, "model_type", None))


def family_inputs(family: Family) -> frozenset[str]:
    """Every model input a family's key covers."""
    names = set(family.token_types) | set(family.row_inputs) | set(family.extra_inputs)
    for m in family.modalities:
        names |= {m.pixels, *m.encoder_inputs, *m.hashed_inputs}
    return frozenset(names)


def config_token(model, name: str) -> int | None:
    """A token id of the config, under its ``_id`` or its older ``_index`` name."""
    config = model.config
    token = getattr(config, name, None)
    return getattr(config, name.replace("_id", "_index"), None) if token is None else token


def placeholder_id(model, modality: Modality) -> int | None:
    return config_token(model, modality.token)


def implied_token_types(model, family: Family, input_ids: torch.Tensor) -> torch.Tensor:
    """The token types ``input_ids`` imply: 0 text, 1 image placeholder, 2 video placeholder."""
    types = torch.zeros_like(input_ids)
    for m in family.modalities:
        token = placeholder_id(model, m)
        if token is not None:
            types[input_ids == token] = 1 if m.name == "image" else 2
    return types


def text_only_token_types(model, model_kwargs: dict) -> set[str]:
    """The family's token-type inputs in ``model_kwargs`` that are all zero (text only)."""
    family = family_of(model)
    if family is None:
        return set()
    return {
        name
        for name in family.token_types
        if isinstance(model_kwargs.get(name), torch.Tensor) and not model_kwargs[name].any()
    }
