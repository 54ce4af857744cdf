"""Images and videos in the cache key: what the KV of a vision-language prompt depends on, and
which inputs to drop when part of the prompt is served from the store.

A VLM replaces each item's placeholder tokens with features of that item (an image, a video).
The same ids with another item give other KV from the first placeholder on. So:

- each item's span (its first to its last placeholder, text between them included: Mistral 3's
  row breaks, Qwen3-VL's frame timestamps) carries an extra id (hf_patch.keys) that is a hash of
  the item's modality, placeholder count, processed pixels and per-item inputs (sizes, grids,
  seconds per grid; sha256 of dtype, shape and bytes): the same item with the same text keys
  alike, another does not;
- a reuse may end inside an item's span: the model then receives that item's remaining
  placeholders with their own feature rows (as transformers' chunked prefill feeds them), so a
  second question about an image reuses all of it that whole blocks hold. This holds for every
  family in hf_patch.keys.vlm_families: features consumed in placeholder order, and KV of a
  cached image token computed with the whole image present (Gemma 3's bidirectional image
  blocks included: the cached part saw the whole image, the suffix sees the cached part);
- generate() (transformers >= 5.23) encodes items before its prefill, into
  ``mm_encoder_outputs`` (one feature row per placeholder, in placeholder order). hf_patch
  matches the prompt just before that encoding (``Request.match``), and the pixels of items the
  store serves entirely are dropped (``drop_pixels``): the vision tower never sees them. Where
  the match must wait for the prefill (beams / several returned sequences expand the rows
  first), every item is encoded and the features of served placeholders are cut out afterwards
  (hf_patch.keys.encoder_outputs).

A family the key does not know, or a call whose placeholders do not match its items, runs
without the store (UnkeyableImages names why).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch

from hf_patch.keys import item_layout
from hf_patch.keys.item_layout import UnkeyableImages
from hf_patch.keys.vlm_families import Family, family_inputs, family_of, implied_token_types, placeholder_id

__all__ = [
    "ImageSpan",
    "Images",
    "UnkeyableImages",
    "drop_pixels",
    "has_images",
    "image_keys",
    "keyed_inputs",
]


@dataclass(frozen=True)
class ImageSpan:
    """One image or video of one row. ``cols``: its placeholder columns (``start`` the first,
    ``end`` one past the last); ``index``: where it sits in its modality's pixel input."""

    row: int
    start: int
    end: int
    index: tuple[int, ...]
    content: int = 0  # the item's content id (its extra id)
    modality: str = "image"
    cols: tuple[int, ...] = ()

    @property
    def item(self) -> tuple[str, tuple[int, ...]]:
        """The item's identity within the call: (modality, index)."""
        return (self.modality, self.index)

    def placeholders_before(self, column: int) -> int:
        return sum(c < column for c in self.cols)


@dataclass(frozen=True)
class Images:
    """One call's items: per-token extra ids ``[B, T]`` (int64 holding uint64 bits), spans in
    placeholder order per modality (rows, then columns)."""

    family: Family
    extra_ids: torch.Tensor
    spans: list[ImageSpan]

    def expand(self, rows_per_prompt: int) -> Images:
        """The items of generate()'s expanded rows (each prompt repeated ``rows_per_prompt`` times)."""
        if rows_per_prompt == 1:
            return self
        spans = [
            replace(s, row=s.row * rows_per_prompt + r) for s in self.spans for r in range(rows_per_prompt)
        ]
        spans.sort(key=lambda s: (s.row, s.start))  # feature rows run over (batch, seq)
        return Images(self.family, self.extra_ids.repeat_interleave(rows_per_prompt, dim=0), spans)

    def of(self, modality: str) -> list[ImageSpan]:
        return [s for s in self.spans if s.modality == modality]


def keyed_inputs(model) -> frozenset[str]:
    """Model inputs this module keys for ``model`` (none for a family it does not know)."""
    family = family_of(model)
    return family_inputs(family) if family is not None else frozenset()


_ANY_PIXELS = ("pixel_values", "pixel_values_videos", "pixel_attention_mask")


def has_images(model_kwargs: dict) -> bool:
    return any(model_kwargs.get(name) is not None for name in _ANY_PIXELS)


def _hash_update(h, value) -> None:
    if value is None:
        h.update(b"none|")
    elif isinstance(value, torch.Tensor):
        data = value.detach().to("cpu").contiguous()
        h.update(f"{data.dtype}|{tuple(data.shape)}|".encode())
        h.update(data.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
    else:
        h.update(f"{type(value).__name__}:{value!r}|".encode())


def _content_id(*parts) -> int:
    """A nonzero 64-bit id of ``parts`` (tensors by dtype, shape and bytes; others by repr)."""
    h = hashlib.sha256()
    for part in parts:
        _hash_update(h, part)
    value = int.from_bytes(h.digest()[:8], "little") or 1
    return value - (1 << 64) if value >= 1 << 63 else value  # int64 holding the uint64 bits


def _per_item(model_kwargs: dict, name: str, index: tuple[int, ...]):
    value = model_kwargs.get(name)
    if value is None:
        return None
    try:
        return value[index] if isinstance(value, torch.Tensor) else value[index[0]]
    except (IndexError, TypeError):
        raise UnkeyableImages(f"{name} has no entry for item {index}") from None


def _check_token_types(model, family: Family, input_ids: torch.Tensor, model_kwargs: dict) -> None:
    mask = model_kwargs.get("attention_mask")
    real = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.to("cpu").bool()
    for name in family.token_types:
        given = model_kwargs.get(name)
        if given is None:
            continue
        implied = implied_token_types(model, family, input_ids)
        if tuple(given.shape) != tuple(input_ids.shape) or not torch.equal(
            given.to("cpu").long()[real], implied[real]
        ):
            raise UnkeyableImages(f"{name} is not the one the placeholder ids imply")


def image_keys(model, input_ids: torch.Tensor, model_kwargs: dict) -> Images | None:
    """The extra ids and spans of the items in this call, None when it has none.

    Raises UnkeyableImages naming why the items cannot be keyed (inputs this module cannot
    read, e.g. missing or misshapen sizes and grids, included: the call then runs as stock
    generate(), which accepts or refuses them itself)."""
    try:
        return _image_keys(model, input_ids, model_kwargs)
    except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as e:
        if isinstance(e, UnkeyableImages):
            raise
        raise UnkeyableImages(f"image inputs not readable for the key ({type(e).__name__}: {e})") from None


def _image_keys(model, input_ids: torch.Tensor, model_kwargs: dict) -> Images | None:
    family = family_of(model)
    if family is None:
        if has_images(model_kwargs):
            raise UnkeyableImages(f"{type(model).__name__}: image inputs of this family are not keyed")
        return None
    input_ids = input_ids.to("cpu")
    _check_token_types(model, family, input_ids, model_kwargs)
    spans: list[ImageSpan] = []
    for modality in family.modalities:
        pixels = model_kwargs.get(modality.pixels)
        if pixels is None:
            continue
        token = placeholder_id(model, modality)
        placeholders = input_ids == token
        if modality.layout == "tiles":  # items known only from the ids: tiles split by count
            counts = item_layout.counts(model, modality, model_kwargs, input_ids, placeholders, -1)
            items = [(i,) for i in range(len(counts))]
            model_kwargs = {**model_kwargs, "_tiles": item_layout.tiles(modality, pixels, counts)}
        else:
            items = item_layout.items(modality, pixels, model_kwargs, input_ids.shape[0])
            counts = item_layout.counts(model, modality, model_kwargs, input_ids, placeholders, len(items))
        spans += _assign(model, family, modality, pixels, model_kwargs, placeholders, items, counts)
    if not spans:
        return None
    extra = torch.zeros(input_ids.shape, dtype=torch.int64)
    for span in spans:
        if extra[span.row, span.start : span.end].any():
            raise UnkeyableImages(f"row {span.row}: two images or videos overlap")
        extra[span.row, span.start : span.end] = span.content
    return Images(family, extra, spans)


def _assign(model, family, modality, pixels, model_kwargs, placeholders, items, counts) -> list[ImageSpan]:
    """Hand each item the next ``counts[k]`` placeholders in (row, column) order; an item's
    placeholders must lie in one row."""
    where = placeholders.nonzero().tolist()  # row-major: (row, col) in placeholder order
    spans, at = [], 0
    for k, (index, count) in enumerate(zip(items, counts)):
        mine = where[at : at + count]
        at += count
        rows = {r for r, _ in mine}
        if len(rows) != 1:
            raise UnkeyableImages(f"{modality.name} {k}'s {count} placeholders are not in one row")
        row = rows.pop()
        if modality.layout == "rows" and index[0] != row:
            raise UnkeyableImages("the rows' image placeholders do not match their images")
        cols = tuple(c for _, c in mine)
        parts = [modality.name, count, item_layout.item_pixels(model, modality, pixels, model_kwargs, index)]
        parts += [_per_item(model_kwargs, name, index) for name in (*modality.encoder_inputs, *modality.hashed_inputs, *family.extra_inputs)]  # fmt: skip
        parts += [_per_item(model_kwargs, name, (row,)) for name in family.row_inputs]
        # Gemma 3 without token_type_ids attends causally inside an image, Qwen without
        # mm_token_type_ids gets 1-D positions: the KV differs, so does the key.
        parts += [f"{name}:{model_kwargs.get(name) is not None}" for name in family.token_types]
        spans.append(ImageSpan(row, cols[0], cols[-1] + 1, index, _content_id(*parts), modality.name, cols))
    return spans


def _select(value, keep: list[int]):
    if isinstance(value, torch.Tensor):
        return value.index_select(0, torch.tensor(keep, dtype=torch.long, device=value.device))
    return [value[i] for i in keep]


def drop_pixels(images: Images, drop: set, model_kwargs: dict) -> set:
    """Before encoding: remove the items ``drop`` (``ImageSpan.item``) from ``model_kwargs``.
    Returns the items actually removed: all or none where the call gives a per-row input
    (LLaVA-OneVision's batch_num_images: removing some of a row's images would change it)."""
    family = images.family
    everything = {s.item for s in images.spans}
    if not drop:
        return set()
    if drop != everything and any(model_kwargs.get(name) is not None for name in family.row_inputs):
        return set()
    for modality in family.modalities:
        spans = images.of(modality.name)
        if not spans:
            continue
        gone = {s.index for s in spans if s.item in drop}
        if not gone:
            continue
        names = (modality.pixels, *modality.encoder_inputs)
        if gone == {s.index for s in spans}:  # nothing left to encode: no vision forward at all
            for name in names:
                model_kwargs.pop(name, None)
            if modality.layout == "rows":
                for name in family.extra_inputs:
                    model_kwargs.pop(name, None)
            continue
        pixels = model_kwargs[modality.pixels]
        if modality.layout == "rows":  # a zeroed image is padding to the model
            pixels = pixels.clone()
            for index in gone:
                pixels[index] = 0
            model_kwargs[modality.pixels] = pixels
            continue
        keep = [s.index[0] for s in sorted(spans, key=lambda s: s.index) if s.index not in gone]
        if modality.layout in ("patches", "tiles"):
            if modality.layout == "tiles":
                sizes = item_layout.tiles(
                    modality, pixels, [len(s.cols) for s in sorted(spans, key=lambda s: s.index)]
                )
            else:
                sizes = model_kwargs[modality.encoder_inputs[0]].prod(-1).tolist()
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            rows = [r for i in keep for r in range(starts[i], starts[i] + sizes[i])]
            model_kwargs[modality.pixels] = _select(pixels, rows)
        else:
            model_kwargs[modality.pixels] = _select(pixels, keep)
        for name in modality.encoder_inputs:
            if model_kwargs.get(name) is not None:
                model_kwargs[name] = _select(model_kwargs[name], keep)
    return drop
