"""What differs between transformers' torchvision and PIL image processors (by hand, with torchvision).

Without torchvision, transformers 5.x falls back to the PIL/numpy image processors
(``Qwen2VLImageProcessorPil``, ``LlavaOnevisionImageProcessorPil``); the demo then serves
Qwen-VL and LLaVA-OneVision checkpoints with them (demo/model/processors.py). This processes one
photo-like image (smooth gradients plus noise, seeded) with both backends at each family's
default settings and prints, per output, whether the integer outputs (grids, sizes: they decide
the prompt's placeholder count) are equal and how far the pixels are apart.

Needs torchvision (see docs/vlm.md for a virtual environment that has it):

    /work/venv-tv/bin/python benchmarks/vlm_image_backends.py --width 640 --height 480
"""

from __future__ import annotations

import argparse

import numpy as np


def photo(width: int, height: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x / width * 255, y / height * 255, (x + y) % 256], -1) + rng.normal(
        0, 10, (height, width, 3)
    )
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=640)
    p.add_argument("--height", type=int, default=480)
    args = p.parse_args()
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        raise SystemExit("torchvision is not installed: this compares its image processors with PIL's")
    import torch
    from transformers import LlavaOnevisionImageProcessor, Qwen2VLImageProcessor
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image = photo(args.width, args.height)
    pairs = {  # Qwen2.5-VL and Qwen3-VL checkpoints use Qwen2-VL's image processor
        "Qwen2-VL family": (Qwen2VLImageProcessor(), Qwen2VLImageProcessorPil()),
        "LLaVA-OneVision": (LlavaOnevisionImageProcessor(), LlavaOnevisionImageProcessorPil()),
    }
    print(f"one {args.width}x{args.height} image, each family's default processor settings")
    for family, (vision, pil) in pairs.items():
        a, b = vision(images=[image], return_tensors="pt"), pil(images=[image], return_tensors="pt")
        print(f"{family}: {type(vision).__name__} vs {type(pil).__name__}")
        for key in sorted(set(a) & set(b)):
            x, y = a[key], b[key]
            if not x.is_floating_point():
                print(f"  {key}: equal {torch.equal(x, y)} {x.tolist()}")
                continue
            diff = (x - y).abs()
            print(
                f"  {key}: shapes {tuple(x.shape)} / {tuple(y.shape)}, max |diff| {diff.max():.4f}, "
                f"mean {diff.mean():.5f} (values {x.min():.2f}..{x.max():.2f})"
            )


if __name__ == "__main__":
    main()
