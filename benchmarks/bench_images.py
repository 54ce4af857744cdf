"""A second question about the same image over HTTP: time to first token against the first.

Builds a LLaVA checkpoint from a config (random weights, no download): a CLIP vision tower at
336x336 in 14x14 patches (576 image tokens; `--vision-hidden`, `--vision-layers`) on the
built-in model's language model shape, with its processor and chat template, saved to a
temporary directory. Serves it with the demo app in this process (waitress, 127.0.0.1) so a
forward hook can time the vision tower, and for each of `--repeats` fresh random images sends,
streaming, greedy:

1. the image + question 1          (nothing cached: vision tower + prefill of every token)
2. the same image + question 2     (the image's KV read from the prefix cache, tower skipped)
3. another image + question 1      (the same ids: only the text before the image may hit)

and question 2 again to a server with prefix reuse off (what the second question costs without
the cache). Prints the median client-side TTFT of each, their ratios to the first, and the
vision tower's time and share of the first request's TTFT.

    python benchmarks/bench_images.py
    python benchmarks/bench_images.py --vision-layers 24 --vision-hidden 1024   # ViT-L/14-336 sized
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import time

import requests
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_checkpoint(path: str, args) -> None:
    from transformers import AutoConfig, CLIPImageProcessor, LlavaForConditionalGeneration, LlavaProcessor

    from demo.model.loading import BUILTIN, build_tokenizer, unreadable_ids

    spec = BUILTIN["builtin"]
    tokenizer = build_tokenizer(spec.vocab)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
        tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=TEMPLATE, image_token="<image>",
    )  # fmt: skip
    text = dict(
        model_type="llama", vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.context, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, initializer_range=0.3,
    )  # fmt: skip
    vision = dict(
        model_type="clip_vision_model", hidden_size=args.vision_hidden, intermediate_size=4 * args.vision_hidden,
        num_hidden_layers=args.vision_layers, num_attention_heads=args.vision_hidden // 64, image_size=336,
        patch_size=14,
    )  # fmt: skip
    config = AutoConfig.for_model(
        "llava",
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.suppress_tokens = unreadable_ids(tokenizer)
    model.save_pretrained(path)
    processor.save_pretrained(path)


def image_url(seed: int) -> str:
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (336, 336, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


class Tower:
    """Wall time the vision tower spends, accumulated by forward hooks."""

    def __init__(self, model) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        tower = model.model.vision_tower
        tower.register_forward_pre_hook(lambda *a: setattr(self, "_t0", time.perf_counter()))
        tower.register_forward_hook(
            lambda *a: setattr(self, "seconds", self.seconds + time.perf_counter() - self._t0)
        )


def ttft(url: str, image: str, question: str, max_tokens: int) -> tuple[float, int]:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0, first, cached = time.perf_counter(), None, 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0), cached


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vision-hidden", type=int, default=768)
    p.add_argument("--vision-layers", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=4)
    args = p.parse_args()
    from demo.api.app import create_app
    from demo.api.server import serving
    from demo.config import Config

    q1, q2 = "What is in this picture? Describe it.", "And which colour is the largest area?"
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "llava-bench")
        save_checkpoint(path, args)
        on = create_app(Config(model=path, cache_tokens=1 << 15))
        off = create_app(Config(model=path, reuse=False))
        tower = Tower(on.extensions["radixkv"]["engine"].model)
        rows = {"first": [], "second": [], "other image": [], "second, reuse off": [], "tower": []}
        cached = {}
        with serving(on) as url, serving(off) as url_off:
            ttft(url, image_url(999), "warm-up", 2)
            ttft(url_off, image_url(999), "warm-up", 2)
            for i in range(args.repeats):
                image, other = image_url(i), image_url(1000 + i)
                before = tower.seconds
                t, cached["first"] = ttft(url, image, q1, args.max_tokens)
                rows["first"].append(t)
                rows["tower"].append(tower.seconds - before)
                before = tower.seconds
                t, cached["second"] = ttft(url, image, q2, args.max_tokens)
                rows["second"].append(t)
                assert tower.seconds == before, "the vision tower ran for a cached image"
                t, cached["other image"] = ttft(url, other, q1, args.max_tokens)
                rows["other image"].append(t)
                t, cached["second, reuse off"] = ttft(url_off, image, q2, args.max_tokens)
                rows["second, reuse off"].append(t)
    med = {k: statistics.median(v) * 1000 for k, v in rows.items()}
    print(f"LLaVA: CLIP tower {args.vision_layers} layers x {args.vision_hidden} at 336/14 (576 image tokens), "
          f"built-in language model shape; median of {args.repeats}, ms")  # fmt: skip
    print(f"{'request':<22} {'TTFT':>9} {'vs first':>9} {'cached tokens':>14}")
    for k in ("first", "second", "other image", "second, reuse off"):
        print(f"{k:<22} {med[k]:>9.1f} {med[k] / med['first']:>8.2f}x {cached[k]:>14}")
    print(
        f"vision tower in the first request: {med['tower']:.1f} ms, {med['tower'] / med['first']:.0%} of its TTFT"
    )


if __name__ == "__main__":
    main()
