"""demo.model.vision_batch: each request's processor outputs merged for a batch equal what the
checkpoint's processor returns for the batch of prompts (Gemma 3, LLaVA-NeXT, LLaVA: a text row,
images of other sizes, a resumed row); the merge kinds by hand; and why a request runs alone."""

from __future__ import annotations

import pytest
import torch

from demo.model import vision_batch
from tests.demo_checkpoints import pil, png, save_vlm
from tests.demo_vlm_checkpoints import save_gemma3, save_llava_next
from tests.vlm_models import IMAGE

SAVERS = {"gemma3": save_gemma3, "llava_next": save_llava_next, "llava": save_vlm}


@pytest.mark.parametrize("family", sorted(SAVERS))
def test_merged_rows_are_what_the_processor_gives_for_the_batch(family, tmp_path):
    """Each request's own processor outputs, merged for a left-padded batch (a text-only row,
    images of other sizes, a resumed row with a reply), equal what the checkpoint's processor
    returns for the batch of prompts (the resumed row: its prompt + reply, token types 0)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(SAVERS[family](tmp_path / "m"))
    image_text = processor.boi_token if family == "gemma3" else processor.image_token
    texts = [f"{image_text}what is it?", "a story, a long one please", f"and this? {image_text}"]
    images = [[pil(png(1, (40, 48)))], [], [pil(png(2, (96, 40)))]]
    rows = [
        processor(text=[t], images=[i] if i else None, return_tensors="pt") for t, i in zip(texts, images)
    ]
    contexts = [r["input_ids"][0].tolist() for r in rows]
    reply = [5, 6, 7]  # row 2 resumes after 3 tokens of reply
    contexts[2] = contexts[2] + reply
    texts[2] = texts[2] + processor.tokenizer.decode(reply)
    width = max(len(c) for c in contexts)
    batch = processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt")
    left = torch.tensor([[0] * (width - len(c)) + c for c in contexts])
    assert torch.equal(batch["input_ids"] * batch["attention_mask"], left)  # the same prompts, padded
    per_row = [
        vision_batch.RowInputs(
            {k: v for k, v in r.items() if k not in ("input_ids", "attention_mask")} if i else {},
            len(r["input_ids"][0]),
            len(c),
        )
        for r, i, c in zip(rows, images, contexts)
    ]
    merged = vision_batch.merge(vision_batch.Rule(family, vision_batch.RULES[family]), per_row, width)
    expected = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask")}
    assert merged.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(merged[name], value), name


def test_inputs_no_rule_covers_run_alone_with_the_reason():
    rule = vision_batch.Rule("gemma3", vision_batch.RULES["gemma3"])
    px, types = torch.rand(1, 3, 32, 32), torch.zeros(1, 6, dtype=torch.long)
    prompt, none = [3] * 6, frozenset({IMAGE})
    assert (
        vision_batch.alone_reason(rule, "gemma3", {"pixel_values": px, "token_type_ids": types}, prompt, none)
        is None
    )
    assert "'pixel_attention_mask'" in vision_batch.alone_reason(
        rule, "gemma3", {"pixel_attention_mask": px}, prompt, none
    )
    assert "per prompt token" in vision_batch.alone_reason(
        rule, "gemma3", {"token_type_ids": types[:, :4]}, prompt, none
    )
    assert "tensor of items" in vision_batch.alone_reason(
        rule, "gemma3", {"pixel_values": torch.tensor(1.0)}, prompt, none
    )
    assert "'paligemma'" in vision_batch.alone_reason(None, "paligemma", {"pixel_values": px}, prompt, none)
    assert vision_batch.alone_reason(rule, "gemma3", {}, prompt, none) is None  # a text request
    assert "placeholder" in vision_batch.alone_reason(rule, "gemma3", {}, [*prompt, IMAGE], none)
    with pytest.raises(ValueError, match="must be one of"):
        vision_batch.Rule("x", {"pixel_values": "stacked"})


def test_merge_kinds_by_hand():
    """Items concatenated with trailing dims zero-padded (tensors or lists), rows padded and
    zero for rows without, token types left-padded and 0 over a resumed reply."""
    rule = vision_batch.Rule("t", {"px": "items", "secs": "items", "mask": "rows", "types": "tokens"})
    a = {"px": torch.ones(1, 2, 3), "secs": [0.5], "mask": torch.ones(1, 2, 2, dtype=torch.bool),
         "types": torch.tensor([[0, 1, 0]])}  # fmt: skip
    b = {"px": torch.full((2, 1, 4), 2.0), "secs": torch.tensor([1.0, 2.0]), "mask": torch.ones(1, 1, 3, dtype=torch.bool),
         "types": torch.tensor([[1, 0]])}  # fmt: skip
    rows = [
        vision_batch.RowInputs(a, 3, 5),
        vision_batch.RowInputs({}, 2, 2),
        vision_batch.RowInputs(b, 2, 2),
    ]
    out = vision_batch.merge(rule, rows, 6)
    assert out["px"].shape == (3, 2, 4) and out["px"][0, :, 3].eq(0).all() and out["px"][1:, 1].eq(0).all()
    assert out["px"][0, :, :3].eq(1).all() and out["px"][1:, 0].eq(2).all()
    assert out["secs"] == [0.5, 1.0, 2.0]
    assert out["mask"].dtype == torch.bool and out["mask"].shape == (3, 2, 3)
    assert out["mask"].sum(dim=(1, 2)).tolist() == [4, 0, 3]
    assert out["types"].tolist() == [[0, 0, 1, 0, 0, 0], [0] * 6, [0, 0, 0, 0, 1, 0]]
    assert vision_batch.merge(rule, [vision_batch.RowInputs({}, 2, 2)], 2) == {}
