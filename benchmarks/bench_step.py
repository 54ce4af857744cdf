"""The step loop's costs, alone: one decode step of B running rows (its attention through
SDPA and through the ragged kernel of hf_patch.ragged_attention, alternating); the step with k
newcomers seated in it (their prompts computed inside it, RunningBatch.seat, as
demo/engine/step_loop.py admits on the CPU); the same newcomer's step in an empty batch (what an
idle server computes for it); and one admission prefill of k newcomers (the generate() call that
admits them elsewhere: CUDA, models the packed kernel does not take); on the built-in model,
with a torch.profiler table of the step's top ops.

These numbers bound a newcomer's TTFT under load: it waits for the step in progress, then for
its own step (with whoever joins with it). Clients that send their next request as soon as their
reply ends (bench_http.py --mixed) arrive just after a step began, so they wait about a whole
one. The floor it prints is that sum against the newcomer's step alone; `--idle-ttft MS` (an
idle server's TTFT from bench_http.py --mixed, same machine) adds the per-request work outside
the forward (HTTP, chat template, sampling, streaming) to both sides.

    python benchmarks/bench_step.py                         # cpu, builtin, 32 rows
    python benchmarks/bench_step.py --rows 31 --width 420 --short 60 --prompt 24 --idle-ttft 23
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
from hf_patch.running_batch import RunningBatch, packs, prefill_keys

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


def seat_steps(
    batch: RunningBatch, k: int, tokens: int, prompt, device: str, repeats: int = 5
) -> list[float]:
    """Times of ``repeats`` steps of ``batch`` with ``k`` newcomers of ``tokens`` uncached tokens
    seated in each; the newcomers leave after their step (uncommitted), so the batch keeps its
    rows."""
    spent = []
    for _ in range(repeats):
        slots, _ = batch.seat([prompt(tokens) for _ in range(k)])  # no keys: nothing read from the store
        sync(device)
        t0 = time.perf_counter()
        logits = batch.step()
        sync(device)
        spent.append(time.perf_counter() - t0)
        batch.set_next(logits.argmax(dim=-1).tolist())
        batch.remove(slots, commit=False)
    return spent


def floor_line(plain: float, own: float, alone: float, idle_ttft_ms: float | None) -> str:
    """The newcomer's TTFT floor under this load: the step in progress (a plain one: it arrived
    just after it began) plus its own step, against its step alone; with an idle server's TTFT,
    the work outside the forward (idle TTFT - its step alone) on both sides."""
    floor = plain + own
    line = f"floor (the step under way + its own) {floor * 1e3:.1f} ms = {floor / alone:.1f}x its step alone"
    if idle_ttft_ms is not None:
        outside = max(0.0, idle_ttft_ms / 1e3 - alone)
        line += (
            f"; with {outside * 1e3:.1f} ms outside the forward: {(floor + outside) * 1e3:.1f} ms = "
            f"{(floor + outside) / (idle_ttft_ms / 1e3):.1f}x the idle TTFT"
        )
    return line


def newcomers(args) -> list[int]:
    return [int(x) for x in args.newcomers.split(",")]


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
    p.add_argument("--newcomers", default="1,4,16", help="admission sizes to time (--prompt tokens each)")
    p.add_argument(
        "--prompt",
        type=int,
        default=30,
        help="a newcomer's uncached prompt tokens (bench_http.py --mixed's short prompts: ~24)",
    )
    p.add_argument(
        "--idle-ttft",
        type=float,
        help="an idle server's TTFT in ms (bench_http.py --mixed prints it): the floor then counts "
        "the per-request work outside the forward too",
    )
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
    plain = statistics.median(times["1"])
    # profiled now: seating newcomers below leaves their slots free in the batch (a plain
    # step then feeds them too)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            step()
        sync(device)
    if packs(model):
        seated = {k: seat_steps(batch, k, args.prompt, prompt, device) for k in newcomers(args)}
        alone = statistics.median(
            seat_steps(RunningBatch(model, store, pad, []), 1, args.prompt, prompt, device, repeats=9)
        )
        print(f"  a newcomer's step in an empty batch ({args.prompt} tokens): median {alone * 1e3:.2f} ms")
        for k, spent in seated.items():
            own = statistics.median(spent)
            print(
                f"  the step with {k:>2} newcomers seated ({args.prompt} tokens each): median {own * 1e3:.2f} ms; "
                + floor_line(plain, own, alone, args.idle_ttft)
            )
    else:
        print(
            "  (newcomers are not seated inside steps here: running_batch.packs refuses this model or device)"
        )
    for k in newcomers(args):
        spent = []
        for _ in range(5):
            new = [prompt(args.prompt) for _ in range(k)]
            sync(device)
            t0 = time.perf_counter()
            cache, ids, mask, first = prefill(model, store, new, pad, device)
            prefill_keys(model, cache, k)
            sync(device)
            spent.append(time.perf_counter() - t0)
        print(
            f"admission prefill of {k:>2} newcomers ({args.prompt} tokens each): median "
            f"{statistics.median(spent) * 1e3:.2f} ms"
        )
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
    if device.startswith("cuda"):
        print(prof.key_averages().table(sort_by=sort, row_limit=10, max_name_column_width=48))


if __name__ == "__main__":
    main()
