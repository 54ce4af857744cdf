"""A second question about one image (or video): time to first token with the prefix cache against
without it, for a Qwen2.5-VL-style and a Gemma 3-style model, and the vision tower's share.

Builds each model from a config (random weights, no download) with ~1,024 image tokens per
image (`--image-tokens`), and a Qwen2.5-VL 16-frame video, and for each of `--repeats` fresh
random images measures greedy generate() with max_new_tokens=1 (TTFT):

1. cold:     image + question 1 on a RadixCache over an empty store (tower + full prefill)
2. cached:   the same image + question 2 (the image's KV from the store, tower skipped)
3. uncached: the same image + question 2 with stock generate() (no cache)

Prints medians, the cached/uncached ratio, and the vision tower's time and share of the
uncached TTFT (a forward hook on the tower).

    python benchmarks/bench_vlm.py
    python benchmarks/bench_vlm.py --hidden 1024 --layers 16 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_patch  # noqa: E402

VOCAB = 1024
IMAGE, VIDEO, START, END = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4


def text_config(args, **extra) -> dict:
    heads = args.hidden // 64
    return dict(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                head_dim=64, max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                **extra)  # fmt: skip


def qwen(args):
    from transformers import AutoConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
    vision = dict(depth=args.vision_layers, hidden_size=args.vision_hidden, intermediate_size=args.vision_hidden * 4,
                  num_heads=args.vision_hidden // 64, out_hidden_size=args.hidden, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[args.vision_layers - 1])  # fmt: skip
    return AutoConfig.for_model("qwen2_5_vl", text_config=text_config(args, rope_parameters=rope), vision_config=vision,
                                image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                                vision_end_token_id=END)  # fmt: skip


def gemma3(args):
    from transformers import AutoConfig

    side = int(args.image_tokens**0.5)  # tokens per side after pooling by 2 (64 patches / 2)
    vision = dict(model_type="siglip_vision_model", hidden_size=args.vision_hidden, intermediate_size=args.vision_hidden * 4,
                  num_hidden_layers=args.vision_layers, num_attention_heads=args.vision_hidden // 64,
                  image_size=14 * side * 2, patch_size=14)  # fmt: skip
    text = text_config(args, model_type="gemma3_text", sliding_window=512)
    return AutoConfig.for_model("gemma3", text_config=text, vision_config=vision, image_token_id=IMAGE,
                                mm_tokens_per_image=side * side, boi_token_id=START, eoi_token_id=END)  # fmt: skip


def build(config):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config).float().eval()


def qwen_inputs(args, seed: int, video: bool):
    g = torch.Generator().manual_seed(seed)
    side = int(args.image_tokens**0.5) * 2  # patches per side before the 2x2 merge
    t, name = (args.frames // 2, "video") if video else (1, "image")
    grid = torch.tensor([[t, side, side]])
    pixels = torch.rand(t * side * side, 3 * 2 * 14 * 14, generator=g)
    n = t * side * side // 4
    placeholders = [START] + [VIDEO if video else IMAGE] * n + [END]
    if video:
        return placeholders, {"pixel_values_videos": pixels, "video_grid_thw": grid}
    return placeholders, {"pixel_values": pixels, "image_grid_thw": grid}


def gemma_inputs(args, model, seed: int, video: bool):
    g = torch.Generator().manual_seed(seed)
    size = model.config.vision_config.image_size
    n = model.config.mm_tokens_per_image
    return [START] + [IMAGE] * n + [END], {"pixel_values": torch.rand(1, 3, size, size, generator=g)}


def tower_of(model):
    return getattr(model.model, "visual", None) or model.model.vision_tower


def measure(model, inputs_of, args, video=False) -> dict:
    tower_time = []
    starts = {}
    tower = tower_of(model)
    tower.register_forward_pre_hook(lambda m, a: starts.__setitem__("t", time.perf_counter()))
    tower.register_forward_hook(lambda m, a, o: tower_time.append(time.perf_counter() - starts["t"]))
    store = hf_patch.build_store(model, block_size=16)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, VOCAB - 8, (32,), generator=g).tolist()
    q1 = torch.randint(3, VOCAB - 8, (24,), generator=g).tolist()
    q2 = torch.randint(3, VOCAB - 8, (24,), generator=g).tolist()
    out = {"cold": [], "cached": [], "uncached": [], "tower": []}

    def run(ids, kwargs, cache):
        extra = {"past_key_values": cache} if cache is not None else {}
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, **kwargs, **extra, max_new_tokens=1, do_sample=False)
        return time.perf_counter() - t0

    for r in range(args.repeats):
        placeholders, pixels = inputs_of(100 + r)
        for label, question, cache in (
            ("cold", q1, hf_patch.RadixCache(store=store)),
            ("cached", q2, hf_patch.RadixCache(store=store)),
            ("uncached", q2, None),
        ):
            ids = torch.tensor([system + placeholders + question])
            kwargs = dict(pixels)
            types = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
            kwargs["token_type_ids" if model.config.model_type == "gemma3" else "mm_token_type_ids"] = types
            n_tower = len(tower_time)
            out[label].append(run(ids, kwargs, cache))
            if label == "uncached":
                out["tower"].append(sum(tower_time[n_tower:]))
            if label == "cached":
                assert len(tower_time) == n_tower, "the cached call ran the vision tower"
                assert cache.cached_tokens[0] >= len(system) + len(placeholders) - 16, cache.cached_tokens
    out["tokens"] = ids.shape[1]
    out["placeholders"] = len(placeholders) - 2
    return out


def report(name: str, out: dict) -> None:
    med = {k: statistics.median(v) for k, v in out.items() if isinstance(v, list)}
    print(
        f"{name}: prompt {out['tokens']} tokens ({out['placeholders']} placeholders) | "
        f"cold {med['cold'] * 1000:.0f} ms | cached {med['cached'] * 1000:.0f} ms | "
        f"uncached {med['uncached'] * 1000:.0f} ms | cached/uncached {med['cached'] / med['uncached']:.3f} "
        f"({med['uncached'] / med['cached']:.1f}x) | vision tower {med['tower'] * 1000:.0f} ms = "
        f"{med['tower'] / med['uncached']:.0%} of uncached TTFT"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vision-hidden", type=int, default=256)
    p.add_argument("--vision-layers", type=int, default=8)
    p.add_argument("--image-tokens", type=int, default=1024)
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load: {os.getloadavg()}, torch threads {args.threads}")
    model = build(qwen(args))
    report("qwen2.5-vl image", measure(model, lambda s: qwen_inputs(args, s, False), args))
    video_args = argparse.Namespace(**{**vars(args), "image_tokens": 256})  # 16 frames of 16x16 patches
    report(
        f"qwen2.5-vl {args.frames}-frame video",
        measure(model, lambda s: qwen_inputs(video_args, s, True), args),
    )
    del model
    model = build(gemma3(args))
    report("gemma3 image", measure(model, lambda s: gemma_inputs(args, model, s, False), args))
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
