"""The step loop's two costs, alone: one decode step of B running rows (its attention through
SDPA and through the ragged kernel of hf_patch.ragged_attention, alternating), and one admission
prefill of k newcomers (hf_patch.running_batch.RunningBatch, as demo/engine/step_loop.py runs
them), on the built-in model; with a torch.profiler table of the step's top ops.

These two numbers bound a newcomer's TTFT under load: it waits for the step in progress, then
for its own admission prefill (with whoever arrived with it).

    python benchmarks/bench_step.py                         # cpu, builtin, 32 rows
    python benchmarks/bench_step.py --device cuda --rows 32 --width 1100 --newcomers 1,4,16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

import hf_patch
from demo.model.loading import build_builtin
from hf_patch import ragged_attention
from hf_patch.running_batch import RunningBatch, prefill_keys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_batch import left_pad  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prefill(model, store, rows: list[list[int]], pad: int, device: str):
    """The admission: generate(max_new_tokens=1) over the rows with a RadixCache."""
    ids, mask = left_pad(rows, pad)
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        out = model.generate(
            ids.to(device), attention_mask=mask.to(device), past_key_values=cache, max_new_tokens=1,
            do_sample=False, pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    first = out.logits[0].argmax(dim=-1).tolist()
    return cache, ids.to(device), mask.to(device), first


def qwen_shape(device: str, dtype: torch.dtype):
    """Qwen2.5-0.5B's shape (GQA 7:1, tied embeddings) with seeded random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--model",
        default="builtin",
        choices=("builtin", "builtin-tiny", "qwen2.5-0.5b-shape"),
        help="qwen2.5-0.5b-shape: Qwen2.5-0.5B's layout (24 layers, 14 query and 2 KV heads) with random weights",
    )
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--width", type=int, default=600, help="the widest running row's tokens")
    p.add_argument("--short", type=int, default=40, help="the other rows' tokens")
    p.add_argument("--steps", type=int, default=30, help="steps timed per attention path")
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="torch's cuDNN attention off, as the demo and batchrun run",
    )
    p.add_argument("--newcomers", default="1,4,16", help="admission sizes to time (30-token prompts)")
    args = p.parse_args()
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    device = args.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if args.model == "qwen2.5-0.5b-shape":
        model, pad, vocab = qwen_shape(device, dtype), 0, 151936
    else:
        model, tok = build_builtin(args.model, device, dtype)
        pad, vocab = tok.pad_token_id, len(tok)
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=g).tolist()

    store = hf_patch.build_store(model, budget_tokens=1 << 16)
    batch = RunningBatch(model, store, pad, [])
    rows = [prompt(args.width if i == 0 else args.short) for i in range(args.rows)]
    cache, ids, mask, first = prefill(model, store, rows, pad, device)
    batch.admit([(layer.keys, layer.values) for layer in cache.layers], ids, mask, first)

    def step() -> None:
        logits = batch.step()
        batch.set_next(logits.argmax(dim=-1).tolist())

    for _ in range(3):
        step()
    # steps through SDPA and through the ragged kernel (hf_patch.ragged_attention) alternate
    times: dict[str, list[float]] = {"0": [], "1": []}
    width = batch.width
    for _ in range(args.steps):
        for ragged in times:
            os.environ["RADIXKV_RAGGED_ATTENTION"] = ragged
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times[ragged].append(time.perf_counter() - t0)
    os.environ["RADIXKV_RAGGED_ATTENTION"] = "1"
    real = args.width + (args.rows - 1) * args.short
    kernel = ragged_attention.verify(model)
    print(
        f"{device} {dtype}, {args.model}; {args.rows} rows, width {width}-{batch.width} ({real} real "
        f"columns of {args.rows * width} at the start); load {os.getloadavg()[0]:.1f}"
    )
    for ragged, label in (
        ("0", "SDPA"),
        ("1", "ragged kernel" if kernel else "ragged (not applicable: SDPA)"),
    ):
        print(
            f"  one step, {label:>13}: median {statistics.median(times[ragged]) * 1e3:.2f} ms "
            f"(min {min(times[ragged]) * 1e3:.2f})"
        )
    print(f"  SDPA / ragged: {statistics.median(times['0']) / statistics.median(times['1']):.2f}x")
    for k in (int(x) for x in args.newcomers.split(",")):
        spent = []
        for _ in range(5):
            new = [prompt(30) for _ in range(k)]
            sync(device)
            t0 = time.perf_counter()
            cache, ids, mask, first = prefill(model, store, new, pad, device)
            prefill_keys(model, cache, k)
            sync(device)
            spent.append(time.perf_counter() - t0)
        print(
            f"admission prefill of {k:>2} newcomers (30 tokens each): median {statistics.median(spent) * 1e3:.2f} ms"
        )
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        sync(device)
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
    if device.startswith("cuda"):
        print(prof.key_averages().table(sort_by=sort, row_limit=10, max_name_column_width=48))


if __name__ == "__main__":
    main()
