"""Tiny vision-language models built from configs (random weights, no hub) for the image-key tests."""

from __future__ import annotations

from dataclasses import dataclass

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


def _paligemma():  # not keyed (prefix attention over image and prompt): the test of a family it does not know
    text = {**BASE, "model_type": "gemma", "head_dim": 16}
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    return AutoConfig.for_model(
        "paligemma", text_config=text, vision_config=vision, image_token_id=IMAGE, projection_dim=64
    )


def _gemma3():  # a sliding layer with a window shorter than the prompts, as Gemma 3 has
    text = {**BASE, "model_type": "gemma3_text", "head_dim": 16, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
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
    "paligemma": (_paligemma, "items", 16),
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


# -- families with variable image sizes, any-resolution tiles, grids and videos ----------------
# Each builds its own inputs: ``Item(seed, size)`` is one image (or video) of a size variant;
# ``family_inputs(name, model, rows)`` gives each row's placeholder tokens per item and the
# model inputs, laid out as the family's processor lays them out.
START, END = IMAGE - 2, IMAGE - 3  # begin / end of image (vision_start / vision_end for Qwen)
VIDEO = IMAGE - 4  # the video placeholder id
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]
_QWEN_TEXT = {**BASE, "head_dim": 16,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}  # fmt: skip
_QWEN_IDS = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END
)
_QWEN_VISION = dict(patch_size=4, spatial_merge_size=2, temporal_patch_size=2)


def _llava_next():
    return AutoConfig.for_model("llava_next", text_config=TEXT, vision_config=_CLIP, image_token_id=IMAGE,
                                image_grid_pinpoints=PINPOINTS)  # fmt: skip


def _llava_onevision():
    return AutoConfig.for_model("llava_onevision", text_config=TEXT, vision_config=_CLIP, image_token_id=IMAGE,
                                video_token_id=VIDEO, image_grid_pinpoints=PINPOINTS,
                                vision_feature_select_strategy="default")  # fmt: skip


def _mistral3():
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=64, patch_size=8, head_dim=16)  # fmt: skip
    return AutoConfig.for_model("mistral3", text_config={**TEXT, "model_type": "mistral"}, vision_config=vision,
                                image_token_id=IMAGE, spatial_merge_size=2)  # fmt: skip


def _qwen2_vl():
    vision = dict(depth=1, embed_dim=32, num_heads=2, hidden_size=64, mlp_ratio=2, **_QWEN_VISION)
    return AutoConfig.for_model("qwen2_vl", text_config=_QWEN_TEXT, vision_config=vision, **_QWEN_IDS)


def _qwen2_5_vl():
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, window_size=16,
                  fullatt_block_indexes=[0], **_QWEN_VISION)  # fmt: skip
    return AutoConfig.for_model("qwen2_5_vl", text_config=_QWEN_TEXT, vision_config=vision, **_QWEN_IDS)


def _qwen3_vl():
    text = {**_QWEN_TEXT, "rope_parameters": {**_QWEN_TEXT["rope_parameters"], "mrope_interleaved": True}}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=64, deepstack_visual_indexes=[0], **_QWEN_VISION)  # fmt: skip
    return AutoConfig.for_model("qwen3_vl", text_config=text, vision_config=vision, **_QWEN_IDS)


def _aya_vision():
    text = {**BASE, "model_type": "cohere2", "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8}  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=8)  # fmt: skip
    return AutoConfig.for_model("aya_vision", text_config=text, vision_config=vision, image_token_id=IMAGE,
                                downsample_factor=2, vision_feature_layer=-1)  # fmt: skip


def _llava_next_video():
    return AutoConfig.for_model("llava_next_video", text_config=TEXT, vision_config=_CLIP, image_token_id=IMAGE,
                                video_token_id=VIDEO, image_grid_pinpoints=PINPOINTS, spatial_pool_stride=2)  # fmt: skip


def _qwen3_vl_moe():
    base = _qwen3_vl()
    text = {**base.text_config.to_dict(), "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
            "decoder_sparse_step": 1}  # fmt: skip
    return AutoConfig.for_model(
        "qwen3_vl_moe", text_config=text, vision_config=base.vision_config.to_dict(), **_QWEN_IDS
    )


def _glm46v():
    base = _glm4v()
    return AutoConfig.for_model("glm46v", text_config=base.text_config.to_dict(),
                                vision_config=base.vision_config.to_dict(), image_token_id=IMAGE, video_token_id=VIDEO,
                                image_start_token_id=START, image_end_token_id=END, video_start_token_id=5,
                                video_end_token_id=6)  # fmt: skip


def _glm4v():
    text = {**_QWEN_TEXT, "rope_parameters": {**_QWEN_TEXT["rope_parameters"], "partial_rotary_factor": 1.0}}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, image_size=16,
                  **_QWEN_VISION)  # fmt: skip
    return AutoConfig.for_model("glm4v", text_config=text, vision_config=vision, image_token_id=IMAGE,
                                video_token_id=VIDEO, image_start_token_id=START, image_end_token_id=END,
                                video_start_token_id=5, video_end_token_id=6)  # fmt: skip


def _llama4():
    text = {**BASE, "model_type": "llama4_text", "head_dim": 16, "attention_chunk_size": 8, "num_local_experts": 2,
            "intermediate_size_mlp": 128, "layer_types": ["chunked_attention", "full_attention"],
            "no_rope_layers": [1, 0]}  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, pixel_shuffle_ratio=0.5, projector_input_dim=32, projector_output_dim=32,
                  vision_output_dim=32, rope_theta=10000)  # fmt: skip
    return AutoConfig.for_model("llama4", text_config=text, vision_config=vision, image_token_index=IMAGE,
                                boi_token_index=START, eoi_token_index=END)  # fmt: skip


VLMS.update(
    {
        "llama4": (_llama4, "flat", 4),
        "glm4v": (_glm4v, "grid", 0),
        "glm46v": (_glm46v, "grid", 0),
        "aya_vision": (_aya_vision, "items", 4),
        "llava_next_video": (_llava_next_video, "tiles", 0),
        "qwen3_vl_moe": (_qwen3_vl_moe, "grid", 0),
        "llava_next": (_llava_next, "tiles", 0),
        "llava_onevision": (_llava_onevision, "tiles", 0),
        "mistral3": (_mistral3, "sizes", 0),
        "qwen2_vl": (_qwen2_vl, "grid", 0),
        "qwen2_5_vl": (_qwen2_5_vl, "grid", 0),
        "qwen3_vl": (_qwen3_vl, "grid", 0),
    }
)


TILE_OWNER: dict[bytes, int] = {}  # Llama 4 tile bytes -> its image's seed (to count images encoded)


def images_encoded(output, args, kwargs) -> int:
    """Images (or videos) one encoder call encoded: its per-item outputs, or for Llama 4's flat
    tile batch the distinct images its tiles belong to."""
    if output.pooler_output is not None:
        return len(output.pooler_output)
    tiles = kwargs.get("pixel_values", args[0] if args else None)
    return len({TILE_OWNER[t.numpy().tobytes()] for t in tiles})


@dataclass(frozen=True)
class Item:
    """One image (``video=False``) or video of size variant ``size`` (0, 1, 2: a family's small,
    wide and tall shapes), pixels drawn from ``seed``."""

    seed: int
    size: int = 0
    video: bool = False


_SIZES = [(32, 32), (32, 64), (64, 32)]  # (h, w) in pixels: LLaVA-NeXT / Mistral 3
_GRIDS = [(1, 4, 4), (1, 4, 6), (1, 6, 4)]  # (t, h, w) in patches: Qwen images


def _rand(seed: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) + 0.1


def _count(model, modality: str, **inputs) -> int:
    """Placeholders of one item, asked of the model's own encoder (as a processor computes them)."""
    with torch.no_grad():
        out = getattr(model.model, f"get_{modality}_features")(**inputs, return_dict=True).pooler_output
    return sum(f.reshape(-1, f.shape[-1]).shape[0] for f in out)


def family_inputs(name: str, model, rows: list[list[Item]]) -> tuple[list[list[list[int]]], dict]:
    """Per row, per item, the item's tokens (placeholders with the family's delimiters); and
    the model inputs for all items (rows' items in prompt order)."""
    layout = VLMS[name][1]
    items = [it for row in rows for it in row]
    images = [it for it in items if not it.video]
    videos = [it for it in items if it.video]
    kwargs: dict = {}
    if layout == "flat":  # Llama 4: 1, 2 + 1 global or 4 + 1 global tiles of 4 placeholders
        tiles = [[1, 3, 5][it.size] for it in images]
        kwargs["pixel_values"] = torch.cat([_rand(it.seed, n, 3, 32, 32) for it, n in zip(images, tiles)])
        for it, n in zip(images, tiles):
            for tile in _rand(it.seed, n, 3, 32, 32):
                TILE_OWNER[tile.numpy().tobytes()] = it.seed

        def tokens(it, k):  # tiles apart by a separator, as the processor writes them
            n = tiles[k]
            return [START] + [t for i in range(n) for t in [IMAGE] * 4 + ([3] if i < n - 1 else [])] + [END]
    elif layout == "items":  # fixed-size images (Gemma 3), wrapped in begin / end of image
        if images:
            kwargs["pixel_values"] = torch.stack([image(it.seed) for it in images])

        def tokens(it, k):
            return [START] + [IMAGE] * VLMS[name][2] + [END]
    elif layout == "tiles":
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        tiles = [image_size_to_num_patches(_SIZES[it.size], PINPOINTS, 32) for it in images]
        if images:
            px = torch.zeros(len(images), max(tiles), 3, 32, 32)
            for k, (it, n) in enumerate(zip(images, tiles)):
                px[k, :n] = _rand(it.seed, n, 3, 32, 32)
            kwargs["pixel_values"] = px
            kwargs["image_sizes"] = torch.tensor([_SIZES[it.size] for it in images])
        if videos:
            kwargs["pixel_values_videos"] = torch.stack([_rand(it.seed, 2, 3, 32, 32) for it in videos])

        def tokens(it, k):
            if it.video:
                return [VIDEO] * _count(model, "video", pixel_values_videos=_rand(it.seed, 1, 2, 3, 32, 32))
            one = kwargs["pixel_values"][k : k + 1]
            return [IMAGE] * _count(
                model, "image", pixel_values=one, image_sizes=kwargs["image_sizes"][k : k + 1]
            )
    elif layout == "sizes":
        hmax = max(_SIZES[it.size][0] for it in images)
        wmax = max(_SIZES[it.size][1] for it in images)
        px = torch.zeros(len(images), 3, hmax, wmax)
        for k, it in enumerate(images):
            h, w = _SIZES[it.size]
            px[k, :, :h, :w] = _rand(it.seed, 3, h, w)
        kwargs = {"pixel_values": px, "image_sizes": torch.tensor([_SIZES[it.size] for it in images])}

        def tokens(it, k):  # Pixtral: rows of [IMG] ending in a break, the last row in [IMG_END]
            h, w = (x // 16 for x in _SIZES[it.size])
            out = []
            for r in range(h):
                out += [IMAGE] * w + [END if r == h - 1 else START]
            return out
    else:  # grid
        dim = 3 * 2 * 4 * 4
        grids = [_GRIDS[it.size] for it in images]
        vgrids = [(2, 4, 4) for _ in videos]
        if images:
            kwargs["pixel_values"] = torch.cat(
                [_rand(it.seed, t * h * w, dim) for it, (t, h, w) in zip(images, grids)]
            )
            kwargs["image_grid_thw"] = torch.tensor(grids)
        if videos:
            kwargs["pixel_values_videos"] = torch.cat(
                [_rand(it.seed, t * h * w, dim) for it, (t, h, w) in zip(videos, vgrids)]
            )
            kwargs["video_grid_thw"] = torch.tensor(vgrids)

        def tokens(it, k):
            t, h, w = (2, 4, 4) if it.video else _GRIDS[it.size]
            if it.video and name == "qwen3_vl":  # a timestamp, then each frame in its own delimiters
                return [t for f in range(t) for t in [3 + f, START] + [VIDEO] * (h * w // 4) + [END]]
            return [START] + [VIDEO if it.video else IMAGE] * (t * h * w // 4) + [END]

    out, counters = [], {False: 0, True: 0}
    for row in rows:
        mine = []
        for it in row:
            mine.append(tokens(it, counters[it.video]))
            counters[it.video] += 1
        out.append(mine)
    return out, kwargs


def token_types(name: str, input_ids: torch.Tensor) -> dict:
    """The token type input the family's processor returns with ``input_ids``."""
    if VLMS[name][1] == "grid":
        return {"mm_token_type_ids": (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long()}
    if name == "gemma3":
        return {"token_type_ids": (input_ids == IMAGE).long()}
    return {}
