"""The cache key beyond token ids: a LoRA adapter, a VLM's image, task prompts across tenants.

Run by hand (CPU, fp32, random weights):

    python -m benchmarks.bench_keys                     # all three parts
    python -m benchmarks.bench_keys --parts lora,vlm    # a subset: lora, vlm, tenants

- lora: bench_hf's Llama (hidden 512, 8 layers) with a rank-16 LoRA adapter on q/k/v/o. TTFT of
  a repeated question over a 2,000-token document under the adapter, vs the same prompt uncached
  (a fresh store each time); and what keying costs a miss: the time hf_patch spends gathering
  the key parts (adapter digests, allowlist) per call, against the miss's whole TTFT.
- vlm: a LLaVA (CLIP tower: 224 px, patch 14, 256 image tokens; Llama text model hidden 512, 8
  layers). TTFT of a second question about the same image vs uncached, and the vision tower's
  share of the uncached TTFT (timed by hooks around it).
- tenants: 8 tenants reading 2 task prompts of 800 tokens: device blocks pinned when each
  tenant pins its own copy (namespace per tenant, as the demo does today) vs one copy read
  through SharedPrefix.

Each ratio comes from one run, the two sides interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForImageTextToText

import hf_patch
from benchmarks.bench_hf import build_model
from hf_patch import RadixCache, SharedPrefix
from hf_patch.keys.adapters import row_adapters, unkeyable_reason
from hf_patch.keys.inputs import unkeyed_inputs


def ttft(model, input_ids, cache, **kwargs) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids, past_key_values=cache, max_new_tokens=1, do_sample=False, **kwargs)
    return time.perf_counter() - start


def rand_ids(n: int, seed: int, high: int = 32000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, high, (n,), generator=g).tolist()


def part_lora(rounds: int) -> None:
    base = build_model()
    torch.manual_seed(1)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        init_lora_weights=False)  # fmt: skip
    model = get_peft_model(base, config, adapter_name="tuned").eval()
    doc = rand_ids(2000, 1)
    warm_store = hf_patch.build_store(base, budget_tokens=8192)
    cached, cold, keying = [], [], []
    for r in range(rounds):
        prompt = torch.tensor([doc + rand_ids(24, 100 + r)])
        cold_store = hf_patch.build_store(base, budget_tokens=8192)
        cold.append(ttft(model, prompt, RadixCache(cold_store)))
        ttft(model, torch.tensor([doc + rand_ids(24, 500 + r)]), RadixCache(warm_store))  # the document
        cache = RadixCache(warm_store)
        cached.append(ttft(model, prompt, cache))
        assert cache.cached_tokens[0] >= 2000, cache.cached_tokens
        start = time.perf_counter()
        for _ in range(20):
            unkeyed_inputs({"max_new_tokens": 1, "do_sample": False})
            unkeyable_reason(base)
            row_adapters(base, 1)
        keying.append((time.perf_counter() - start) / 20)
    c, u, k = statistics.median(cached), statistics.median(cold), statistics.median(keying)
    print(f"lora: 2,024-token prompt under a rank-16 adapter, TTFT cached {c * 1e3:.1f} ms vs uncached "
          f"{u * 1e3:.1f} ms -> {u / c:.1f}x ({rounds} rounds, medians)")  # fmt: skip
    print(f"lora: keying a call (allowlist, hooks, adapter digests) {k * 1e3:.3f} ms = "
          f"{100 * k / u:.2f}% of a miss's TTFT")  # fmt: skip


def build_llava():
    text = dict(
        model_type="llama",
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    vision = dict(model_type="clip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                  num_attention_heads=12, image_size=224, patch_size=14)  # fmt: skip
    config = AutoConfig.for_model("llava", text_config=text, vision_config=vision, image_token_id=31999)
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config).eval()


def part_vlm(rounds: int) -> None:
    model = build_llava()
    tower_time: list[float] = []
    tower = model.model.vision_tower
    tower.register_forward_pre_hook(lambda *a: tower_time.append(-time.perf_counter()))
    tower.register_forward_hook(lambda *a: tower_time.append(tower_time.pop() + time.perf_counter()))
    system = rand_ids(40, 2, high=31990)
    pixel_values = torch.rand(1, 3, 224, 224)
    cached, cold, tower_share = [], [], []
    for r in range(rounds):
        question = rand_ids(20, 200 + r, high=31990)
        prompt = torch.tensor([system + [31999] * 256 + question])
        tower_time.clear()
        os.environ["RADIXKV_IMAGE_FEATURES_BYTES"] = "0"  # uncached: no image features kept either
        cold.append(ttft(model, prompt, RadixCache(hf_patch.build_store(model, budget_tokens=4096)),
                         pixel_values=pixel_values))  # fmt: skip
        del os.environ["RADIXKV_IMAGE_FEATURES_BYTES"]
        assert len(tower_time) == 1
        tower_share.append(sum(tower_time) / cold[-1])
        store = hf_patch.build_store(model, budget_tokens=4096)
        first = torch.tensor([system + [31999] * 256 + rand_ids(20, 900 + r, high=31990)])
        ttft(model, first, RadixCache(store), pixel_values=pixel_values)
        tower_time.clear()
        cache = RadixCache(store)
        cached.append(ttft(model, prompt, cache, pixel_values=pixel_values))
        assert not tower_time, "the vision tower ran for a cached image"
        assert cache.cached_tokens[0] >= 288, cache.cached_tokens
    c, u, share = statistics.median(cached), statistics.median(cold), statistics.median(tower_share)
    print(f"vlm: second question about one image (316-token prompt, 256 image tokens), TTFT cached "
          f"{c * 1e3:.1f} ms vs uncached {u * 1e3:.1f} ms -> {u / c:.1f}x")  # fmt: skip
    print(f"vlm: the vision tower is {100 * share:.0f}% of the uncached TTFT, all of it saved "
          f"({100 * share * u / (u - c):.0f}% of the saving)")  # fmt: skip


def part_tenants() -> None:
    model = build_model()
    prompts = {"summarise": rand_ids(800, 3), "translate": rand_ids(800, 4)}
    tenants = [f"tenant-{i}" for i in range(8)]
    per_tenant = hf_patch.build_store(model, budget_tokens=16384)
    for tenant in tenants:
        hf_patch.pin_prompts(
            model, {(tenant, k): v for k, v in prompts.items()}, store=per_tenant, namespace=tenant
        )
    shared_store = hf_patch.build_store(model, budget_tokens=16384)
    hf_patch.pin_prompts(model, prompts, store=shared_store, namespace="tasks")
    hits = []
    for tenant in tenants:
        cache = RadixCache(shared_store, namespace=tenant, shared_prefix=SharedPrefix("tasks", 800))
        ttft(model, torch.tensor([prompts["summarise"] + rand_ids(30, 7)]), cache)
        hits.append(cache.cached_tokens[0])
    before = per_tenant.stats()["task_pinned_blocks"]
    after = shared_store.stats()["task_pinned_blocks"]
    print(f"tenants: 8 tenants x 2 task prompts of 800 tokens: {before} pinned blocks with a copy per "
          f"tenant, {after} with SharedPrefix ({before / after:.0f}x fewer); every tenant's first "
          f"request read {min(hits)}-{max(hits)} cached tokens")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="lora,vlm,tenants")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    parts = args.parts.split(",")
    if "lora" in parts:
        part_lora(args.rounds)
    if "vlm" in parts:
        part_vlm(args.rounds)
    if "tenants" in parts:
        part_tenants()


if __name__ == "__main__":
    main()
