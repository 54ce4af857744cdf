"""The fixed cost of a cached generate() call: RadixCache against the bare forward and the recipe.

Run by hand (CPU, fp32, one thread, random tiny Llama; a cached document, a short question,
one new token; the same generate() around every side):

    python benchmarks/bench_hot_path.py                       # 1 and 16 layers
    python benchmarks/bench_hot_path.py --layers 16 --doc 4000 --question 30 --profile

Sides, interleaved call by call so machine noise hits them alike:

- *bare*: generate() over a DynamicCache that already holds the document (cropped back after each
  call, outside the timed span): the question's forward and nothing else;
- *recipe*: transformers' prefix-caching recipe, ``copy.deepcopy`` of that cache inside the span;
- *RadixCache*: a RadixCache over a store that holds the document.

Printed: median milliseconds per call and the ratios, and the aten ops each side dispatches
(counted with a TorchDispatchMode over one call: what a GPU would launch); ``--profile`` adds a
cProfile table of the RadixCache call's Python.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import random
import statistics
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_patch
from hf_patch import RadixCache


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def build(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=8192,
    )
    return LlamaForCausalLM(config).eval()


def measure(layers: int, doc_len: int, q_len: int, calls: int, profile: bool) -> None:
    model = build(layers)
    rng = random.Random(0)
    doc = [rng.randrange(3, 1000) for _ in range(doc_len)]
    questions = [[rng.randrange(3, 1000) for _ in range(q_len)] for _ in range(calls + 2)]
    store = hf_patch.build_store(model, budget_tokens=doc_len + 64 * (calls + 4))
    kw = dict(max_new_tokens=1, do_sample=False, pad_token_id=0)
    for t in (*store.pool.k, *store.pool.v):  # steady state: the pool's pages touched once already
        t.zero_()  # (a fresh pool's first write to a block pays its page faults: ~0.2 ms a block here)
    model.generate(torch.tensor([doc + questions[0]]), past_key_values=RadixCache(store=store), **kw)
    ready = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([doc]), past_key_values=ready, use_cache=True)
    cached = len(doc) // store.block_size * store.block_size

    def bare(prompt):
        model.generate(prompt, past_key_values=ready, **kw)
        ready.crop(len(doc) - ready.get_seq_length())  # (a negative count: tokens to remove)

    def recipe(prompt):
        model.generate(prompt, past_key_values=copy.deepcopy(ready), **kw)

    def radix(prompt):
        cache = RadixCache(store=store)
        model.generate(prompt, past_key_values=cache, **kw)
        assert cache.cached_tokens[0] >= cached, cache.cached_tokens

    sides = {"bare forward": bare, "recipe (deepcopy)": recipe, "RadixCache": radix}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i, q in enumerate(questions):
        prompt = torch.tensor([doc + q])
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn(prompt)
            if i >= 2:  # the first two calls warm every side
                times[name].append(time.perf_counter() - t0)
    ops = {}
    prompt = torch.tensor([doc + questions[-1]])
    for name, fn in sides.items():
        counter = OpCounter()
        with counter:
            fn(prompt)
        ops[name] = counter.ops
    med = {name: statistics.median(v) for name, v in times.items()}
    print(
        f"\n{layers} layer(s), {doc_len}-token document cached, {q_len}-token question, {calls} calls a side"
    )
    print(f"  {'side':<20}{'median ms':>10}{'vs bare':>9}{'vs recipe':>11}{'aten ops':>10}")
    for name in sides:
        print(
            f"  {name:<20}{med[name] * 1e3:>10.2f}{med[name] / med['bare forward']:>8.2f}x"
            f"{med[name] / med['recipe (deepcopy)']:>10.2f}x{sum(ops[name].values()):>10}"
        )
    extra = ops["RadixCache"] - ops["recipe (deepcopy)"]
    print(f"  aten ops beyond the recipe's: {sum(extra.values())}: {dict(extra.most_common(8))}")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for q in questions[:5]:
            radix(torch.tensor([doc + q]))
        prof.disable()
        pstats.Stats(prof).sort_stats("cumtime").print_stats("hf_patch|radixkv|cuda_ext", 40)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", default="1,16")
    parser.add_argument("--doc", type=int, default=4000)
    parser.add_argument("--question", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for layers in map(int, args.layers.split(",")):
        measure(layers, args.doc, args.question, args.calls, args.profile)


if __name__ == "__main__":
    main()
