"""Moving encoded image / video features in and out of generate()'s ``mm_encoder_outputs``.

``mm_encoder_outputs[modality]`` holds one feature row per placeholder of that modality, in
placeholder order over (batch, seq): ``pooler_output`` (a tensor ``[items, tokens, hidden]``
or a list / tuple of per-item ``[tokens, hidden]``; Llama 4: ``last_hidden_state``, the
family's ``feature``) and, for Qwen3-VL, ``deepstack_features`` (per layer, the same rows). After encoding, each encoded item's rows are filed by content id
(``remember_features``); before the prefill, the output is rebuilt to hold exactly the rows of
the placeholders the model is fed (``feed_features``), as transformers' chunked prefill does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPooling

from hf_patch.keys.multimodal import Images


@dataclass(frozen=True)
class Features:
    """One item's (or several items') feature rows: ``pooled`` ``[n, hidden]``, ``deep`` one
    ``[n, hidden']`` per deepstack layer (empty for most families)."""

    pooled: torch.Tensor
    deep: tuple[torch.Tensor, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pooled, *self.deep))

    def __getitem__(self, rows: slice) -> Features:
        return Features(self.pooled[rows], tuple(d[rows] for d in self.deep))

    @staticmethod
    def cat(parts: list[Features]) -> Features:
        deep = tuple(torch.cat([p.deep[i] for p in parts]) for i in range(len(parts[0].deep)))
        return Features(torch.cat([p.pooled for p in parts]), deep)


@dataclass(frozen=True)
class Container:
    """How a model's encoder hands one modality's features over (kept when feeding them back)."""

    kind: type
    as_tensor: bool  # the features one tensor with a batch of one, else a one-item list
    field: str = "pooler_output"


def _flat(features) -> torch.Tensor:
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in features])


def flatten(output, field: str = "pooler_output") -> Features | None:
    """An encoder output's rows, in placeholder order."""
    pooled = None if output is None else output.get(field)
    if pooled is None:
        return None
    deep = output.get("deepstack_features") or ()
    return Features(_flat(pooled), tuple(_flat(layer) for layer in deep))


def container(output, field: str) -> Container:
    return Container(type(output), isinstance(output[field], torch.Tensor), field)


def build(rows: Features, how: Container | None, field: str):
    """An encoder output holding ``rows``, in the container ``how`` (default: a one-item list)."""
    kind = BaseModelOutputWithPooling if how is None else how.kind
    as_tensor = how.as_tensor if how is not None else field != "pooler_output"

    def wrap(t: torch.Tensor):
        return t.unsqueeze(0) if as_tensor else [t]

    fields = {field: wrap(rows.pooled)}
    if rows.deep:
        fields["deepstack_features"] = [wrap(d) for d in rows.deep]
    return kind(**fields)


def remember_features(images: Images, skipped: set, model_kwargs: dict, cache) -> None:
    """After encoding: file each encoded item's rows in ``cache`` (image_features.FeatureCache)
    by its content id. ``skipped``: items not encoded (served, or their features known)."""
    outputs = model_kwargs.get("mm_encoder_outputs")
    if cache is None or not isinstance(outputs, dict):
        return
    field = images.family.feature
    for name, output in outputs.items():
        rows = flatten(output, field)
        encoded = [s for s in images.of(name) if s.item not in skipped]
        if rows is None or rows.pooled.shape[0] != sum(len(s.cols) for s in encoded):
            continue
        cache.containers[name] = container(output, field)
        at = 0
        for span in encoded:
            cache.put(span.content, rows[at : at + len(span.cols)])
            at += len(span.cols)


def feed_features(
    images: Images, common: int, skipped: set, known: dict, model_kwargs: dict, containers
) -> None:
    """Before the prefill: ``mm_encoder_outputs[modality]`` holds exactly the rows of the
    placeholders the model is fed (columns ``>= common``), in order. Rows come from this call's
    encoding (items not in ``skipped``) or from ``known`` (item -> Features, not encoded).
    ``containers``: modality -> Container, for outputs rebuilt with no encoder output to copy."""
    if common <= 0 and not known:
        return
    outputs = dict(model_kwargs.get("mm_encoder_outputs") or {})
    field = images.family.feature
    for name in {s.modality for s in images.spans}:
        output = outputs.get(name)
        fresh = flatten(output, field)
        if fresh is None and not any(s.item in known for s in images.of(name)):
            continue
        parts, at = [], 0
        for span in images.of(name):
            length = len(span.cols)
            if span.item in known:
                rows = known[span.item]
            elif span.item in skipped:  # served from the store whole: fed no placeholder
                continue
            else:
                rows, at = fresh[at : at + length], at + length
            if span.end > common:
                parts.append(rows[span.placeholders_before(common) :])
        how = container(output, field) if output is not None else containers.get(name)
        outputs[name] = build(Features.cat(parts), how, field) if parts else None
    model_kwargs["mm_encoder_outputs"] = outputs
