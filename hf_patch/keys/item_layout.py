"""Where each image or video sits in a call's inputs: which slice of the pixel input is an item,
and how many placeholder tokens it fills, for each layout of hf_patch.keys.vlm_families.

Everything here reads inputs only; a layout that does not add up (placeholders that do not
split over the items, a grid that does not cover the patches) raises UnkeyableImages.
"""

from __future__ import annotations

import torch

from hf_patch.keys.vlm_families import Modality, config_token


class UnkeyableImages(ValueError):
    """The call's image inputs cannot be keyed (its reason is the message)."""


def runs(row: torch.Tensor) -> list[tuple[int, int]]:
    """Contiguous runs ``(start, end)`` of True in a 1-D bool tensor."""
    padded = torch.cat(
        [torch.zeros(1, dtype=torch.int8), row.to(torch.int8), torch.zeros(1, dtype=torch.int8)]
    )
    edges = torch.diff(padded).nonzero().flatten().tolist()
    return list(zip(edges[0::2], edges[1::2]))


def items(modality: Modality, pixels: torch.Tensor, model_kwargs: dict, batch: int) -> list[tuple[int, ...]]:
    """Indices of the real items in the pixel input, in placeholder order."""
    if modality.layout == "rows":
        if pixels.dim() != 5 or pixels.shape[0] != batch:
            raise UnkeyableImages(f"{modality.pixels} {tuple(pixels.shape)} is not [batch, images, C, H, W]")
        real = (pixels != 0).flatten(2).any(dim=2).to("cpu")  # all-zero images are padding
        return [(b, j) for b in range(pixels.shape[0]) for j in range(pixels.shape[1]) if real[b, j]]
    if modality.layout == "patches":
        grid = model_kwargs.get(modality.encoder_inputs[0])
        if not isinstance(grid, torch.Tensor) or grid.dim() != 2 or grid.shape[1] != 3:
            raise UnkeyableImages(f"{modality.pixels} needs {modality.encoder_inputs[0]} [items, 3]")
        if int(grid.prod(-1).sum()) != pixels.shape[0]:
            raise UnkeyableImages(f"{modality.encoder_inputs[0]} does not cover {modality.pixels}'s patches")
        return [(i,) for i in range(grid.shape[0])]
    return [(i,) for i in range(pixels.shape[0])]


def delimited(model, modality: Modality, input_ids: torch.Tensor, placeholders: torch.Tensor) -> list[int]:
    """Placeholders between each begin- and end-of-item token, in order (rows, then columns)."""
    begin, end = (config_token(model, name) for name in modality.delimiters)
    counts = []
    for ids, marks in zip(input_ids, placeholders):
        inside = torch.cumsum((ids == begin).long() - (ids == end).long(), 0)
        if inside.min() < 0 or inside.max() > 1 or (marks & (inside != 1)).any():
            raise UnkeyableImages(f"{modality.name} placeholders outside begin / end tokens, or nested")
        starts = (ids == begin).nonzero().flatten().tolist()
        stops = (ids == end).nonzero().flatten().tolist()
        counts += [int(marks[a:b].sum()) for a, b in zip(starts, stops)]
    return [c for c in counts if c]


def counts(model, modality: Modality, model_kwargs: dict, input_ids, placeholders, n: int) -> list[int]:
    total = int(placeholders.sum())
    if modality.counts is not None:
        counts = [int(c) for c in modality.counts(model, model_kwargs)]
    elif modality.delimiters is not None:
        counts = delimited(model, modality, input_ids, placeholders)
    elif modality.runs:
        counts = [end - start for row in placeholders for start, end in runs(row)]
    else:
        if not n or total % n:
            raise UnkeyableImages(
                f"{total} {modality.name} placeholder tokens do not split evenly over {n} items"
            )
        counts = [total // n] * n
    if (n >= 0 and len(counts) != n) or sum(counts) != total:
        raise UnkeyableImages(
            f"{total} {modality.name} placeholder tokens do not match {n} items (expected {counts})"
        )
    return counts


def tiles(modality: Modality, pixels: torch.Tensor, counts: list[int]) -> list[int]:
    """Tiles per item of a flat tile batch, each tile the same number of placeholders."""
    total = sum(counts)
    if not total or total % pixels.shape[0] or any(c % (total // pixels.shape[0]) for c in counts):
        raise UnkeyableImages(
            f"{total} {modality.name} placeholders do not split over {pixels.shape[0]} tiles"
        )
    per_tile = total // pixels.shape[0]
    return [c // per_tile for c in counts]


def item_pixels(model, modality: Modality, pixels: torch.Tensor, model_kwargs: dict, index) -> torch.Tensor:
    """The item at ``index``'s pixels (its slice of the pixel input, batch padding removed)."""
    if modality.layout == "tiles":
        tiles = model_kwargs["_tiles"]
        start = sum(tiles[: index[0]])
        return pixels[start : start + tiles[index[0]]]
    if modality.layout == "patches":
        grid = model_kwargs[modality.encoder_inputs[0]]
        sizes = grid.prod(-1).tolist()
        start = sum(sizes[: index[0]])
        return pixels[start : start + sizes[index[0]]]
    if modality.trim is not None:
        return modality.trim(model, pixels, model_kwargs, index[0])
    return pixels[index]
