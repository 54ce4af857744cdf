"""RadixCache inside stock generate(): time to first token, miss overhead, decode speed, plot.

Run by hand (CPU, fp32, random Llama: hidden 512, 8 layers, 8 heads / 4 KV heads, vocab 32k):

    python -m benchmarks.bench_hf                 # all four parts
    python -m benchmarks.bench_hf --parts qa,miss  # a subset: qa, miss, decode, plot

Every figure is a ratio measured in one run against its baseline, with the runs of the two
sides interleaved so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

import hf_patch
from hf_patch import RadixCache


class FirstTokenTimer(BaseStreamer):
    """generate() puts the prompt first, then each new token: time the first of those."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.puts = 0
        self.first: float | None = None
        self.end_time: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        self.end_time = time.perf_counter()


def build_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


def ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor([tokens])


def timed(model, input_ids, max_new_tokens=1, make_cache=None, **kwargs) -> FirstTokenTimer:
    """One greedy generate(); ``make_cache()`` runs inside the timed span (the recipe's deepcopy is its cost)."""
    timer = FirstTokenTimer()
    timer.start = time.perf_counter()
    if make_cache is not None:
        kwargs["past_key_values"] = make_cache()
    model.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=False, streamer=timer, **kwargs)
    return timer


def ttft(timer: FirstTokenTimer) -> float:
    return timer.first - timer.start


def document(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 32000) for _ in range(num_tokens)]


def part_qa(model, args) -> None:
    rng = random.Random(1)
    doc = document(rng, 2000)
    questions = [[rng.randrange(100, 32000) for _ in range(30)] for _ in range(10)]
    store = hf_patch.build_store(model)
    # Warm up kernels, then the first question fills the store and the recipe's cache.
    timed(model, ids(doc[:64] + questions[0]))
    timed(model, ids(doc + questions[0]), past_key_values=RadixCache(store=store))
    prefix_cache = DynamicCache()
    with torch.no_grad():
        model(ids(doc), past_key_values=prefix_cache, use_cache=True)
    rows = {"uncached": [], "recipe (deepcopy)": [], "RadixCache": []}
    for q in questions[1:]:
        prompt = ids(doc + q)
        rows["uncached"].append(ttft(timed(model, prompt)))
        recipe = timed(model, prompt, make_cache=lambda: copy.deepcopy(prefix_cache))
        rows["recipe (deepcopy)"].append(ttft(recipe))
        cache = RadixCache(store=store)
        rows["RadixCache"].append(ttft(timed(model, prompt, past_key_values=cache)))
        assert cache.cached_tokens == [len(doc) // 16 * 16], cache.cached_tokens
    base = statistics.median(rows["uncached"])
    print(
        f"\n1. long-document QA: 2,000-token document + 30-token questions, TTFT over {len(questions) - 1} questions"
    )
    print(f"   {'method':<20}{'median ms':>10}{'min ms':>9}{'speed-up vs uncached':>22}")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"   {name:<20}{med * 1e3:>10.1f}{min(values) * 1e3:>9.1f}{base / med:>21.1f}x")
    recipe, radix = statistics.median(rows["recipe (deepcopy)"]), statistics.median(rows["RadixCache"])
    print(f"   RadixCache vs recipe: {recipe / radix:.2f}x faster")


def part_miss(model, args) -> None:
    rng = random.Random(2)
    store = hf_patch.build_store(model)
    prompts = [document(rng, rng.randrange(300, 700)) for _ in range(args.miss_prompts)]
    timed(model, ids(prompts[0][:32]))  # warm-up
    stock, radix = [], []
    for i, p in enumerate(prompts):
        # Alternate which side goes first so drift in machine speed cancels.
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for side in order:
            t0 = time.perf_counter()
            if side == 0:
                model.generate(ids(p), max_new_tokens=16, do_sample=False)
                stock.append(time.perf_counter() - t0)
            else:
                cache = RadixCache(store=store)
                model.generate(ids(p), max_new_tokens=16, do_sample=False, past_key_values=cache)
                radix.append(time.perf_counter() - t0)
                assert cache.cached_tokens == [0]
    total_stock, total_radix = sum(stock), sum(radix)
    print(f"\n2. misses: {len(prompts)} unrelated prompts of 300-700 tokens, 16 new tokens each, end to end")
    print(
        f"   stock generate {total_stock:.2f} s, RadixCache {total_radix:.2f} s, "
        f"overhead {100 * (total_radix / total_stock - 1):+.1f}%"
    )
    print(
        f"   store after: {store.stats()['cached_blocks']} blocks cached, hit rate {store.stats()['hit_rate']:.3f}"
    )


def part_decode(model, args) -> None:
    rng = random.Random(3)
    prompt = ids(document(rng, 2000))
    new = 128
    stock, radix = [], []
    for _ in range(args.decode_runs):
        t = timed(model, prompt, max_new_tokens=new, min_new_tokens=new)
        stock.append((new - 1) / (t.end_time - t.first))
        t = timed(
            model,
            prompt,
            max_new_tokens=new,
            min_new_tokens=new,
            past_key_values=RadixCache(store=hf_patch.build_store(model, budget_tokens=4096)),
        )
        radix.append((new - 1) / (t.end_time - t.first))
    s, r = statistics.median(stock), statistics.median(radix)
    print(f"\n3. decode: {new} new tokens after a 2,000-token prompt, median of {args.decode_runs} runs")
    print(f"   stock DynamicCache {s:.1f} tok/s, RadixCache {r:.1f} tok/s, ratio {r / s:.2f}x")


def part_plot(model, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rng = random.Random(4)
    lengths = [128, 256, 512, 1024, 2048, 3072]
    store = hf_patch.build_store(model)
    uncached, cached = [], []
    timed(model, ids(document(rng, 32)))
    for n in lengths:
        prefix = document(rng, n)
        timed(model, ids(prefix + document(rng, 16)), past_key_values=RadixCache(store=store))
        u, c = [], []
        for _ in range(3):
            prompt = ids(prefix + document(rng, 16))
            u.append(ttft(timed(model, prompt)))
            c.append(ttft(timed(model, prompt, past_key_values=RadixCache(store=store))))
        uncached.append(statistics.median(u) * 1e3)
        cached.append(statistics.median(c) * 1e3)
        print(
            f"   shared prefix {n:>5}: uncached {uncached[-1]:8.1f} ms, cached {cached[-1]:7.1f} ms, "
            f"{uncached[-1] / cached[-1]:5.1f}x"
        )
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lengths, uncached, "o-", label="stock generate (uncached)")
    ax.plot(lengths, cached, "o-", label="RadixCache (prefix cached)")
    ax.set_xlabel("shared prefix length (tokens), + 16 new tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT, random Llama 512x8, fp32, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"\n4. plot written to {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="qa,miss,decode,plot")
    parser.add_argument("--miss-prompts", type=int, default=20)
    parser.add_argument("--decode-runs", type=int, default=3)
    parser.add_argument("--plot", default="docs/ttft_vs_prefix.png")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = build_model()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, model: Llama 512x8, 8 heads/4 KV, vocab 32k, fp32"
    )
    parts = {"qa": part_qa, "miss": part_miss, "decode": part_decode, "plot": part_plot}
    for name in args.parts.split(","):
        parts[name](model, args)


if __name__ == "__main__":
    main()
