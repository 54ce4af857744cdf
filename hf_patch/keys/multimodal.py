"""Images in the cache key: what the KV of a vision-language prompt depends on, and which image
inputs to drop when part of the prompt is served from the store.

A VLM replaces each image's placeholder tokens (``config.image_token_id``) with features of that
image. The same ids with another image give other KV from the first placeholder on. So:

- each image's placeholder span carries an extra id (hf_patch.keys) that is a hash of the
  image's processed pixels (sha256 of dtype, shape and bytes; with its attention mask where the
  family has one): the same image with the same text keys alike, another image does not;
- a reuse may end inside an image's span: the model then receives that image's remaining
  placeholders with their own feature rows (as transformers' chunked prefill feeds them), so a
  second question about an image reuses all of it that whole blocks hold, whatever its
  alignment. This holds for the families below: causal attention over image tokens, 1-D
  positions, features consumed in placeholder order;
- generate() (transformers >= 5.23) encodes images before its prefill, into
  ``mm_encoder_outputs`` (one feature row per placeholder, in placeholder order). hf_patch
  matches the prompt just before that encoding (``Request.match``), and the pixels of images
  the store serves entirely are dropped (``drop_pixels``): the vision tower never sees them.
  Where the match must wait for the prefill (beams / several returned sequences expand the
  rows first), every image is encoded and the features of served placeholders are cut out
  afterwards (``keep_uncached_features``, the slicing generate()'s own chunked prefill uses).

Supported families, by how their processor lays out ``pixel_values``:

- ``items`` (LLaVA, VipLLaVA, InternVL): ``[num_images, C, H, W]``, images in prompt
  order over the batch's rows, each with the same number of contiguous placeholders;
- ``rows`` (Idefics3, SmolVLM): ``[batch, max_images, C, H, W]``, an all-zero image is padding
  (the model skips it), so a cached image is zeroed out.

Any other family passing image inputs runs without the store (hf_patch.keys.inputs: its image
kwargs are not on the allowlist), as does a call whose placeholders do not split evenly over
its images.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

FAMILIES = {
    "llava": "items",
    "vipllava": "items",
    "internvl": "items",
    "idefics3": "rows",
    "smolvlm": "rows",
}
IMAGE_INPUTS = frozenset({"pixel_values", "pixel_attention_mask"})


class UnkeyableImages(ValueError):
    """The call's image inputs cannot be keyed (its reason is the message)."""


@dataclass(frozen=True)
class ImageSpan:
    row: int
    start: int  # columns of input_ids
    end: int
    index: tuple[int, ...]  # where the image sits in pixel_values
    content: int = 0  # the image's content id (its extra id)


@dataclass(frozen=True)
class Images:
    """One call's images: per-token extra ids ``[B, T]`` (int64 holding uint64 bits), spans."""

    layout: str
    extra_ids: torch.Tensor
    spans: list[ImageSpan]

    def expand(self, rows_per_prompt: int) -> Images:
        """The images of generate()'s expanded rows (each prompt repeated ``rows_per_prompt`` times)."""
        if rows_per_prompt == 1:
            return self
        spans = [
            replace(s, row=s.row * rows_per_prompt + r) for s in self.spans for r in range(rows_per_prompt)
        ]
        spans.sort(key=lambda s: (s.row, s.start))  # feature rows run over (batch, seq)
        return Images(self.layout, self.extra_ids.repeat_interleave(rows_per_prompt, dim=0), spans)


def keyed_inputs(model) -> frozenset[str]:
    """Model inputs this module keys for ``model`` (none for a family it does not know)."""
    return IMAGE_INPUTS if _family(model) is not None else frozenset()


def has_images(model_kwargs: dict) -> bool:
    return any(model_kwargs.get(name) is not None for name in IMAGE_INPUTS)


def _family(model) -> str | None:
    if not model._supports_mm_encoder_outputs():
        return None
    return FAMILIES.get(getattr(model.config, "model_type", None))


def _image_token(model) -> int:
    config = model.config
    token = getattr(config, "image_token_id", None)
    return getattr(config, "image_token_index", None) if token is None else token


def _content_id(*tensors: torch.Tensor | None) -> int:
    """A nonzero 64-bit id of the tensors' dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            continue
        data = t.detach().to("cpu").contiguous()
        h.update(f"{data.dtype}|{tuple(data.shape)}|".encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    value = int.from_bytes(h.digest()[:8], "little") or 1
    return value - (1 << 64) if value >= 1 << 63 else value  # int64 holding the uint64 bits


def _runs(row: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous runs ``(start, end)`` of True in a 1-D bool tensor."""
    padded = torch.cat(
        [torch.zeros(1, dtype=torch.int8), row.to(torch.int8), torch.zeros(1, dtype=torch.int8)]
    )
    edges = torch.diff(padded).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def image_keys(model, input_ids: torch.Tensor, model_kwargs: dict) -> Images | None:
    """The extra ids and spans of the images in this call, None when it has none.

    Raises UnkeyableImages naming why the images cannot be keyed."""
    pixels = model_kwargs.get("pixel_values")
    if pixels is None:
        return None
    layout = _family(model)
    if layout is None:
        raise UnkeyableImages(f"{type(model).__name__}: image inputs of this family are not keyed")
    token = _image_token(model)
    placeholders = input_ids.to("cpu") == token
    masks = model_kwargs.get("pixel_attention_mask")
    if layout == "items":
        items = [(i,) for i in range(pixels.shape[0])]
        per_row = None
    else:
        if pixels.dim() != 5 or pixels.shape[0] != input_ids.shape[0]:
            raise UnkeyableImages(f"pixel_values {tuple(pixels.shape)} is not [batch, images, C, H, W]")
        real = (pixels != 0).flatten(2).any(dim=2).to("cpu")  # all-zero images are padding
        items = [(b, j) for b in range(pixels.shape[0]) for j in range(pixels.shape[1]) if real[b, j]]
        per_row = real.sum(dim=1).tolist()
    total = int(placeholders.sum())
    if not items or total % len(items):
        raise UnkeyableImages(
            f"{total} image placeholder tokens do not split evenly over {len(items)} images"
        )
    size = total // len(items)
    spans: list[ImageSpan] = []
    for b in range(input_ids.shape[0]):
        for start, end in _runs(placeholders[b]):
            if (end - start) % size:
                raise UnkeyableImages(
                    f"row {b}: a run of {end - start} image tokens is not a whole number of images"
                )
            for s in range(start, end, size):
                index = items[len(spans)]
                mask = None if masks is None else masks[index]
                spans.append(ImageSpan(b, s, s + size, index, _content_id(pixels[index], mask)))
    if per_row is not None and [sum(s.row == b for s in spans) for b in range(len(per_row))] != per_row:
        raise UnkeyableImages("the rows' image placeholders do not match their images")
    extra = torch.zeros(input_ids.shape, dtype=torch.int64)
    for span in spans:
        extra[span.row, span.start : span.end] = span.content
    return Images(layout, extra, spans)


def drop_pixels(images: Images, drop: set[tuple[int, ...]], model_kwargs: dict) -> None:
    """Before encoding: remove the images ``drop`` (indices into pixel_values) from ``model_kwargs``."""
    if not drop:
        return
    pixels = model_kwargs["pixel_values"]
    if drop >= {s.index for s in images.spans}:  # nothing left to encode: no vision forward at all
        for name in IMAGE_INPUTS:
            model_kwargs.pop(name, None)
    elif images.layout == "items":
        keep = torch.tensor([i for i in range(pixels.shape[0]) if (i,) not in drop], device=pixels.device)
        model_kwargs["pixel_values"] = pixels.index_select(0, keep)
    else:  # rows: a zeroed image is padding to the model
        pixels = pixels.clone()
        for index in drop:
            pixels[index] = 0
        model_kwargs["pixel_values"] = pixels


def _flat_rows(output) -> torch.Tensor | None:
    """An image encoder output's features as ``[placeholders, hidden]``, in placeholder order."""
    features = None if output is None else output.get("pooler_output")
    if features is None:
        return None
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])


def remember_features(images: Images, skipped: set, model_kwargs: dict, cache) -> None:
    """After encoding: file each encoded image's feature rows in ``cache`` by its content id.
    ``skipped``: images not encoded (served from the store, or their features already known)."""
    outputs = model_kwargs.get("mm_encoder_outputs")
    rows = _flat_rows(outputs.get("image") if isinstance(outputs, dict) else None)
    encoded = [s for s in images.spans if s.index not in skipped]
    if rows is None or cache is None or rows.shape[0] != sum(s.end - s.start for s in encoded):
        return
    cache.as_tensor = isinstance(outputs["image"]["pooler_output"], torch.Tensor)
    at = 0
    for span in encoded:
        cache.put(span.content, rows[at : at + span.end - span.start])
        at += span.end - span.start


def feed_features(
    images: Images, common: int, skipped: set, known: dict, model_kwargs: dict, as_tensor: bool
) -> None:
    """Before the prefill: ``mm_encoder_outputs["image"]`` holds exactly the feature rows of the
    placeholders the model is fed (columns ``>= common``), in order, in the container the
    model's encoder uses (``as_tensor``: a batch of one, else a one-item list), as
    transformers' chunked prefill hands them over. Rows come from this call's encoding
    (images not in ``skipped``) or from ``known`` (image index -> rows, not encoded)."""
    outputs = model_kwargs.get("mm_encoder_outputs")
    output = outputs.get("image") if isinstance(outputs, dict) else None
    if (common <= 0 and not known) or (output is None and not known):
        return
    fresh = _flat_rows(output)
    parts, at = [], 0
    for span in images.spans:
        length = span.end - span.start
        if span.index in known:
            rows = known[span.index]
        elif span.index in skipped:  # served from the store whole: fed no placeholder
            continue
        else:
            rows, at = fresh[at : at + length], at + length
        if span.end > common:
            parts.append(rows[max(0, common - span.start) :])
    outputs = dict(outputs or {})
    if not parts:
        outputs["image"] = None
    else:
        make = type(output) if output is not None else BaseModelOutputWithPooling
        rows = torch.cat(parts)
        if output is not None:
            as_tensor = isinstance(output["pooler_output"], torch.Tensor)
        outputs["image"] = make(pooler_output=rows.unsqueeze(0) if as_tensor else [rows])
    model_kwargs["mm_encoder_outputs"] = outputs
