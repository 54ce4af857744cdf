"""lm-eval with ``--model radixkv`` against ``--model hf``: wall time, same numbers. Run by hand:

    python -m benchmarks.bench_eval                       # all three parts
    python -m benchmarks.bench_eval --parts mc --models builtin --questions 100   # a quick look

1. ``mc``: a local 5-shot multiple-choice task in MMLU's shape (one description and five worked
   examples, ~600 tokens shared by every question; ``--questions`` questions x 4 choices), fp32,
   the same batch size for both backends, in one process through ``lm_eval.simple_evaluate``
   (HFLM vs RadixLM on the same checkpoint): wall time ratio, accuracy, per-sample results.
2. ``gen``: a 3-shot generate_until task (stop sequences, 16 new tokens at most): the same.
3. ``ranks``: two CPU ranks under torchrun on four MMLU-shape tasks (one preamble each):
   ``split=affine`` (prefix-affine routing) vs ``split=docs`` (lm-eval's document striding):
   prompt tokens computed, per rank and in all.

``--busy`` runs every comparison beside a competing load (bench_contention's: a process
multiplying matrices on every core). torch's OpenMP wait policy is the environment's, as in
any program that imports torch before hf_patch: ``OMP_WAIT_POLICY=PASSIVE python -m
benchmarks.bench_eval ...`` is what ``python -m evalrun`` now runs with, unset is ``lm_eval``'s.

Models (random weights, no download): ``builtin`` (demo's: hidden 512, 6 layers, vocab 2,048)
and ``bench_hf`` (benchmarks/bench_hf.py's: hidden 512, 8 layers, vocab 32,000), both with the
demo's byte-level BPE tokenizer (one token per word of these tasks).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_contention import COMPETITOR
from tests.eval_tasks import OFFLINE, compare_samples, offline_env, write_tasks

# MMLU's shape: a description and five worked examples (~600 tokens), a question with its four
# choices listed, scored as " A".." D".
MC_SHAPE = dict(shots=5, description_words=40, example_words=90, question_words=40, letters=True)


def save_models(root: Path, names: list[str]) -> dict[str, Path]:
    from benchmarks.bench_hf import build_model
    from demo.model.loading import build_builtin, build_tokenizer

    out = {}
    for name in names:
        path = root / name
        if name == "builtin":
            model, tokenizer = build_builtin("builtin")
        elif name == "bench_hf":
            model, tokenizer = build_model(), build_tokenizer(2048)
        else:
            raise ValueError(f"--models takes builtin and bench_hf, got {name!r}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out[name] = path
    return out


def evaluate(kind: str, model_dir: Path, task: str, manager, batch_size: int, limit: int | None = None):
    """One in-process evaluation: (seconds, results, samples, cache figures or None)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from evalrun import RadixLM

    cls = RadixLM if kind == "radixkv" else HFLM
    lm = cls(pretrained=str(model_dir), dtype="float32", batch_size=batch_size, device="cpu")
    started = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=manager, log_samples=True, limit=limit)
    seconds = time.perf_counter() - started
    return seconds, out["results"][task], out["samples"][task], getattr(lm, "figures", None)


def shared_prefix_tokens(samples, model_dir: Path) -> int:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    a, b = (tok(s["arguments"][0][0])["input_ids"] for s in samples[:2])
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def responses(samples) -> tuple[list[float], list]:
    """Every response's log-likelihood (MC) and its greedy flag or generated text."""
    numbers, exact = [], []
    for sample in samples:
        for resp in sample["resps"]:
            value = resp[0]
            if isinstance(value, (tuple, list)):
                numbers.append(float(value[0]))
                exact.append(value[1])
            else:
                exact.append(value)
    return numbers, exact


def differences(ref, got) -> str:
    a, flags_a = responses(ref)
    b, flags_b = responses(got)
    worst = max((abs(x - y) for x, y in zip(a, b)), default=0.0)
    return f"max |loglikelihood diff| {worst:.2g}, greedy flags / generations differing {sum(x != y for x, y in zip(flags_a, flags_b))} of {len(flags_a)}"


def compare(
    part: str, models: dict[str, Path], task: str, manager, batch_size: int, metric: str, repeats: int
) -> None:
    """hf and radixkv alternately, ``repeats`` times each; the fastest run of each side counts
    (the machine is shared: a slower run is someone else's load, not the code)."""
    for name, model_dir in models.items():
        hf_times, rk_times = [], []
        for _ in range(repeats):
            hf_s, hf_res, hf_samples, _ = evaluate("hf", model_dir, task, manager, batch_size)
            rk_s, rk_res, rk_samples, figures = evaluate("radixkv", model_dir, task, manager, batch_size)
            hf_times.append(hf_s)
            rk_times.append(rk_s)
        hf_s, rk_s = min(hf_times), min(rk_times)
        if repeats > 1:
            print(
                f"    runs: hf {[round(t, 1) for t in hf_times]} s, radixkv {[round(t, 1) for t in rk_times]} s"
            )
        over = len(compare_samples({task: hf_samples}, {task: rk_samples}, atol=1e-4))
        preamble = shared_prefix_tokens(hf_samples, model_dir)
        print(
            f"{part} {name}: {len(hf_samples)} docs, shared preamble {preamble} tokens, batch {batch_size}: "
            f"hf {hf_s:.1f} s, radixkv {rk_s:.1f} s, {hf_s / rk_s:.2f}x; {metric} hf {hf_res[metric]:.4f} "
            f"radixkv {rk_res[metric]:.4f}; {differences(hf_samples, rk_samples)}; fields beyond 1e-4: {over}; "
            f"radixkv prompt tokens {figures.prompt_tokens}, served {figures.cached_tokens} ({figures.hit_rate:.3f})",
            flush=True,
        )
        if part == "mc":  # the model's own fp32 noise floor: hf against itself at another batch size
            _, _, hf_one, _ = evaluate("hf", model_dir, task, manager, 1, limit=48)
            print(
                f"    hf batch 1 vs hf batch {batch_size}, first 48 docs: {differences(hf_one, hf_samples[:48])}"
            )


FIGURE = re.compile(
    r"^\|(rank \d+|all ranks)\s*\|\s*(\d+)\|\s*(\d+)\|\s*(\d+)\|\s*([\d.]+)\|\s*([\d.]+)\|", re.M
)


def ranks(model_dir: Path, tasks_dir: Path, tasks: list[str], tmp: Path, batch_size: int) -> None:
    for split in ("docs", "affine"):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "evalrun", "--model", "radixkv",
            "--model_args", f"pretrained={model_dir},dtype=float32,split={split}",
            "--tasks", ",".join(tasks), "--include_path", str(tasks_dir),
            "--batch_size", str(batch_size), "--device", "cpu",
        ]  # fmt: skip
        started = time.perf_counter()
        proc = subprocess.run(command, env=offline_env(tmp), capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if proc.returncode:
            print(proc.stderr[-3000:])
            raise SystemExit(f"torchrun split={split} failed")
        rows = {m[1]: (int(m[2]), int(m[3]), int(m[4])) for m in FIGURE.finditer(proc.stdout)}
        accs = re.findall(r"\|acc\s*\|[^|]*\|\s*([\d.]+)\|", proc.stdout)
        print(
            f"ranks split={split}: wall {seconds:.1f} s; "
            + "; ".join(f"{who}: prompt {p}, served {s}, computed {c}" for who, (p, s, c) in rows.items())
            + f"; acc {accs}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="mc,gen,ranks")
    parser.add_argument("--models", default="builtin,bench_hf")
    parser.add_argument("--questions", type=int, default=400)
    parser.add_argument("--gen-questions", type=int, default=96)
    parser.add_argument("--rank-questions", type=int, default=64, help="per task, four tasks")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs of each side per comparison (min counts)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (a second one spin-waits badly on a busy machine)",
    )
    parser.add_argument("--busy", action="store_true", help="beside a competing load on every core")
    parser.add_argument("--workdir", default=None, help="default: a temporary directory")
    args = parser.parse_args()
    os.environ.update(OFFLINE)
    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="bench_eval_"))
    os.environ["HF_DATASETS_CACHE"] = str(tmp / "datasets")
    parts = args.parts.split(",")
    torch.set_num_threads(args.threads)
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    print(
        f"torch threads {torch.get_num_threads()}, OMP_WAIT_POLICY {policy}, busy {args.busy}, "
        f"load {os.getloadavg()}, workdir {tmp}",
        flush=True,
    )
    competitor = None
    if args.busy:
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR])
        time.sleep(2)
    try:
        run_parts(args, parts, tmp)
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    print(f"load after: {os.getloadavg()}", flush=True)


def run_parts(args, parts: list[str], tmp: Path) -> None:
    from lm_eval.tasks import TaskManager

    models = save_models(tmp / "models", args.models.split(","))
    tasks_dir = tmp / "tasks"
    mc = write_tasks(tasks_dir, "mmlu", questions=args.questions, **MC_SHAPE)[0]
    gen = write_tasks(
        tasks_dir, "gen3", gen_questions=args.gen_questions, example_words=150, gen_words=30,
        description_words=40, max_gen_toks=16, seed=1,
    )[2]  # fmt: skip
    subjects = [
        write_tasks(tasks_dir, f"subject{i}", questions=args.rank_questions, seed=10 + i, **MC_SHAPE)[0]
        for i in range(4)
    ]
    manager = TaskManager(include_path=str(tasks_dir))
    if "mc" in parts:
        compare("mc", models, mc, manager, args.batch_size, "acc,none", args.repeats)
    if "gen" in parts:
        compare("gen", models, gen, manager, args.batch_size, "exact_match,none", args.repeats)
    if "ranks" in parts:
        ranks(next(iter(models.values())), tasks_dir, subjects, tmp, args.batch_size)


if __name__ == "__main__":
    main()
