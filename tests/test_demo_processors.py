"""A checkpoint's processor with or without torchvision (demo.model.processors): where it is
missing, Qwen-VL and LLaVA-OneVision processors are built without their video processor, with
the checkpoint's image processor (transformers' PIL fallback), chat template and processor
options, and one log line; a checkpoint whose processor cannot load for another reason still
fails. (The same tests pass with torchvision: there the processor keeps its video processor.)"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil

import pytest
from transformers import AutoConfig

from demo.model import vision
from demo.model.processors import has_videos, load_processor, videos_dropped
from tests.demo_vlm_checkpoints import save_gemma3, save_llava_onevision, save_qwen_vl

TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("processors")
    return {
        "qwen2_5_vl": save_qwen_vl(root / "qwen"),
        "llava_onevision": save_llava_onevision(root / "onevision"),
        "gemma3": save_gemma3(root / "gemma3"),
    }


def load(path: str):
    return load_processor(path, AutoConfig.from_pretrained(path), {"local_files_only": True})


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava_onevision"])
def test_a_processor_with_a_video_processor(checkpoints, family, caplog):
    with caplog.at_level(logging.WARNING, logger="demo.model.processors"):
        processor = load(checkpoints[family])
    lines = [r.getMessage() for r in caplog.records if r.name == "demo.model.processors"]
    tokenizer, template = processor.tokenizer, processor.chat_template
    assert "<|assistant|>" in template and tokenizer.convert_tokens_to_ids("<video>" if "onevision" in family else "<|video_pad|>") > 0  # fmt: skip
    if family == "llava_onevision":  # processor_config.json's options reached the processor
        assert (processor.num_image_tokens, processor.vision_feature_select_strategy) == (16, "full")
    if TORCHVISION:
        assert has_videos(processor) and not videos_dropped(processor) and lines == []
        assert vision.video_refusal(processor) is None
        return
    assert (
        not has_videos(processor) and videos_dropped(processor) and not hasattr(processor, "video_processor")
    )
    assert type(processor.image_processor).__name__.endswith("Pil")  # transformers' own fallback
    assert len(lines) == 1 and "videos need torchvision" in lines[0]
    assert "needs torchvision" in vision.video_refusal(processor)
    assert type(processor).__name__ == type(processor).__mro__[1].__name__  # reads as its class


def test_a_processor_without_videos_and_a_broken_checkpoint(checkpoints, tmp_path):
    gemma = load(checkpoints["gemma3"])
    assert not videos_dropped(gemma) and vision.video_refusal(gemma) == "it takes no videos"
    # A Qwen checkpoint whose tokenizer is gone: the loading error, not a processor without it.
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["qwen2_5_vl"], broken)
    os.remove(broken / "tokenizer.json")
    with open(broken / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "NoSuchTokenizer"}, f)
    with pytest.raises(ValueError, match="instantiate the backend tokenizer"):
        load(str(broken))
