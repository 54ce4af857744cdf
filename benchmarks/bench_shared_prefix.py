"""A shared cached prefix: memory held during the call and speed, copy path vs paged attention.

Issue 41's setting (CPU, fp32, random Llama: hidden 512, 8 heads / 4 KV heads of 64, 8 layers:
32 MiB of KV for a 2,048-token document), the document cached before the call:

- ``memory``: peak RSS above RSS just before the call, sampled every millisecond by a thread,
  in document-KV copies (2,048 tokens x 16 KiB), for ``rows16`` (16 rows = the document + 16
  different 32-token questions, greedy, 16 new tokens) and ``nrs8`` (one such prompt,
  num_return_sequences=8, sampled), each path in its own process (stock generate() with no
  cache, RadixCache's copy path, paged attention), glibc told to mmap big blocks
  (``MALLOC_MMAP_THRESHOLD_``) so that freed buffers leave the RSS; the pool is preallocated and
  touched before the baseline (the cache's budget, not the call's memory), and the model's
  once-per-model paged-attention probe run before it too.
- ``speed``: in one process, rounds of the sides interleaved, medians: a cached call (one row,
  the document + a new 32-token question, ``generate(max_new_tokens=1)``) at 16 layers against
  the bare forward of the question over a ready DynamicCache holding the document (and stock
  generate() on a deep copy of it, untimed); and the decode step of the 16-row batch (median
  interval between steps, 32 new tokens) at 8 layers.

- ``exactness``: the max logit difference of each path from stock generate().

    python -m benchmarks.bench_shared_prefix                  # all three parts
    python -m benchmarks.bench_shared_prefix --parts memory --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import hf_patch
from hf_patch import RadixCache, paged_attention

DOC, QUESTION, ROWS = 2048, 32, 16
PATHS = ("stock", "copy", "paged")


def build_model(layers: int = 8) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 32000, (n,), generator=g).tolist()


def warm_store(model, doc: list[int]):
    """A store holding the document (its pool touched, so the call's commits grow no RSS)."""
    store = hf_patch.build_store(model, block_size=16, budget_tokens=16384)
    for t in (*store.pool.k, *store.pool.v):
        t.zero_()
    model.generate(torch.tensor([doc]), past_key_values=RadixCache(store=store), max_new_tokens=1)
    return store


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Peak RSS while inside, sampled every millisecond by a thread."""

    def __enter__(self) -> PeakRss:
        self.peak, self._stop = rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def memory_child(case: str, path: str) -> dict:
    """One measurement in this (fresh) process; returns copies of the document's KV."""
    torch.set_grad_enabled(False)
    model = build_model()
    doc = tokens(DOC, 1)
    store = warm_store(model, doc) if path != "stock" else None
    paged_attention.verify(model)  # the once-per-model probe, before the baseline (any path)
    doc_bytes = DOC * 8 * 2 * 4 * 64 * 4
    if case == "rows16":
        ids, mask = left_pad([doc + tokens(QUESTION, 100 + i) for i in range(ROWS)])
        kwargs = dict(attention_mask=mask, max_new_tokens=16, do_sample=False)
    else:
        ids = torch.tensor([doc + tokens(QUESTION, 100)])
        kwargs = dict(max_new_tokens=16, do_sample=True, num_return_sequences=8)
    if path != "stock":
        kwargs["past_key_values"] = cache = RadixCache(store=store, paged=path == "paged")
    torch.manual_seed(0)
    before = rss()
    t0 = time.perf_counter()
    with PeakRss() as peak:
        model.generate(ids, pad_token_id=0, **kwargs)
    seconds = time.perf_counter() - t0
    out = {"copies": round((peak.peak - before) / doc_bytes, 2), "seconds": round(seconds, 2)}
    if path != "stock":
        out["cached_tokens"] = sum(cache.cached_tokens)
    return out


def memory(rounds: int) -> None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    print(
        f"memory: peak RSS above the RSS before the call, in copies of the document's KV ({rounds} runs, median)"
    )
    for case in ("rows16", "nrs8"):
        for path in PATHS:
            runs = []
            for _ in range(rounds):
                cmd = [sys.executable, "-m", "benchmarks.bench_shared_prefix", "--child", f"{case}:{path}"]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            copies = statistics.median(r["copies"] for r in runs)
            secs = statistics.median(r["seconds"] for r in runs)
            hit = runs[0].get("cached_tokens", 0)
            print(f"  {case:7s} {path:6s} {copies:6.2f} copies   call {secs:6.2f} s   cached tokens {hit}")


class StepTimes(LogitsProcessor):
    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def speed(rounds: int) -> None:
    torch.set_grad_enabled(False)
    model = build_model(16)
    doc = tokens(DOC, 1)
    store = warm_store(model, doc)
    ready = DynamicCache(config=model.config)
    model(torch.tensor([doc]), past_key_values=ready)
    times: dict[str, list[float]] = {k: [] for k in ("bare forward", "stock generate", "copy", "paged")}
    for r in range(rounds):
        q = tokens(QUESTION, 1000 + r)
        for side in times:
            seed = 1000 + r
            if side == "bare forward":
                c = copy.deepcopy(ready)
                pos = torch.arange(DOC, DOC + QUESTION).unsqueeze(0)
                t0 = time.perf_counter()
                model(torch.tensor([q]), past_key_values=c, position_ids=pos, logits_to_keep=1)
            elif side == "stock generate":
                c = copy.deepcopy(ready)
                t0 = time.perf_counter()
                model.generate(torch.tensor([doc + q]), past_key_values=c, max_new_tokens=1, do_sample=False)
            else:
                q = tokens(QUESTION, 10 * seed + len(side))  # a new question: only the document is cached
                cache = RadixCache(store=store, paged=side == "paged")
                t0 = time.perf_counter()
                model.generate(
                    torch.tensor([doc + q]), past_key_values=cache, max_new_tokens=1, do_sample=False
                )
                assert cache.cached_tokens == [DOC], cache.cached_tokens
            times[side].append(time.perf_counter() - t0)
    bare = statistics.median(times["bare forward"])
    print(
        f"speed: a cached call at 16 layers (the document cached, a new {QUESTION}-token question), medians of {rounds}"
    )
    for side, ts in times.items():
        m = statistics.median(ts)
        print(f"  {side:15s} {m * 1e3:8.1f} ms   {m / bare:5.2f}x the bare forward")
    del model, store, ready
    model = build_model(8)
    store = warm_store(model, doc)
    ids, mask = left_pad([doc + tokens(QUESTION, 100 + i) for i in range(ROWS)])
    steps: dict[str, list[float]] = {"copy": [], "paged": []}
    for r in range(rounds):
        for side in steps:
            rows = [doc + tokens(QUESTION, 5000 + 100 * r + 10 * i + len(side)) for i in range(ROWS)]
            ids, mask = left_pad(rows)
            timer = StepTimes()
            cache = RadixCache(store=store, paged=side == "paged")
            model.generate(
                ids, attention_mask=mask, past_key_values=cache, max_new_tokens=32, do_sample=False,
                pad_token_id=0, eos_token_id=None, logits_processor=LogitsProcessorList([timer]),
            )  # fmt: skip
            gaps = [b - a for a, b in zip(timer.times[1:], timer.times[2:])]
            steps[side].append(statistics.median(gaps))
    print(f"decode: {ROWS} rows over the cached document, 8 layers, median step of 32 (medians of {rounds})")
    for side, ts in steps.items():
        m = statistics.median(ts)
        print(f"  {side:6s} {m * 1e3:7.1f} ms/step   {ROWS / m:7.1f} tokens/s")


def exactness() -> None:
    """Max |logit| difference from stock generate() of each path (greedy, 4 left-padded rows over
    a cached 512-token document, 16 new tokens; fp32), and whether the tokens are equal."""
    torch.set_grad_enabled(False)
    model = build_model()
    doc = tokens(512, 2)
    rows = [doc + tokens(QUESTION - 4 * i, 300 + i) for i in range(4)]
    ids, mask = left_pad(rows)
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None,
              output_logits=True, return_dict_in_generate=True)  # fmt: skip
    ref = model.generate(ids, **kw)
    outs = {}
    print("exactness: max |logit - stock's| over 4 rows x 16 steps (fp32, 512 cached tokens)")
    for path in ("copy", "paged"):
        store = warm_store(model, doc)  # each path from the same store state
        cache = RadixCache(store=store, paged=path == "paged")
        out = model.generate(ids, past_key_values=cache, **kw)
        outs[path] = out
        gap = max((a - b).abs().max().item() for a, b in zip(out.logits, ref.logits))
        same = torch.equal(out.sequences, ref.sequences)
        print(f"  {path:6s} {gap:.3g}   tokens equal: {same}   cached tokens {cache.cached_tokens}")
    gap = max((a - b).abs().max().item() for a, b in zip(outs["copy"].logits, outs["paged"].logits))
    print(f"  paged vs copy {gap:.3g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="memory,speed,exactness")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        case, path = args.child.split(":")
        print(json.dumps(memory_child(case, path)))
        return
    parts = args.parts.split(",")
    if "memory" in parts:
        memory(args.rounds)
    if "speed" in parts:
        speed(args.rounds)
    if "exactness" in parts:
        exactness()


if __name__ == "__main__":
    main()
