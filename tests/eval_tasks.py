"""Local lm-eval tasks (YAML over JSON files, no hub, no download) for the evalrun tests and
benchmarks/bench_eval.py, and the comparison of two runs' ``--log_samples`` outputs.

Three task types, named ``{prefix}_mc``, ``{prefix}_ppl`` and ``{prefix}_gen``:

- multiple choice in MMLU's shape: one description, ``shots`` worked examples (the same for
  every question: ``sampler: first_n``), the question, 4 choices of 1-3 words (scored as
  text, or listed and scored as letters);
- loglikelihood_rolling perplexity over texts (word/byte perplexity, bits per byte);
- generate_until, 3-shot, with stop sequences (``until``; "how" is a piece the random tiny
  models emit often, so stops trigger) and a short ``max_gen_toks``.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

WORDS = (
    "the a of to in and is are cache prefix token block tree node pool key value model request "
    "reply prompt chat table row name city job question answer time first long short fast slow "
    "memory server client user system Alice Bruno Chen Dara Berlin Lagos Lima Osaka Paris Rome"
).split()
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _mc_doc(rng: random.Random, words: int) -> dict:
    return {
        "question": _text(rng, words) + "?",
        "choices": [_text(rng, rng.randint(1, 3)) for _ in range(4)],
        "answer": rng.randrange(4),
    }


def _yaml(path: Path, fields: dict) -> None:
    """A task YAML (JSON is valid YAML: no quoting rules to get wrong)."""
    path.write_text(json.dumps(fields, indent=1))


def write_tasks(
    directory: Path,
    prefix: str = "tiny",
    *,
    questions: int = 12,
    question_words: int = 8,
    shots: int = 5,
    example_words: int = 14,
    description_words: int = 12,
    gen_questions: int = 8,
    gen_words: int = 10,
    max_gen_toks: int = 12,
    texts: int = 5,
    text_words: int = 160,
    letters: bool = False,
    seed: int = 0,
) -> list[str]:
    """Write the three tasks' data and YAML files under ``directory``; returns the task names.

    ``letters``: the choices are listed after the question and scored as " A".." D" (MMLU's
    form: one-token continuations, one input per question); else each choice's text is scored
    (1-3 tokens, four inputs per question, as ARC or HellaSwag)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)

    def data(name: str, docs: list[dict]) -> str:
        path = directory / f"{prefix}_{name}.json"
        path.write_text(json.dumps(docs))
        return str(path)

    description = "The following are questions about " + _text(rng, description_words) + ".\n\n"
    mc = {
        "task": f"{prefix}_mc",
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {
                "train": data("mc_train", [_mc_doc(rng, example_words) for _ in range(shots)]),
                "test": data("mc_test", [_mc_doc(rng, question_words) for _ in range(questions)]),
            }
        },
        "training_split": "train",
        "test_split": "test",
        "fewshot_split": "train",
        "fewshot_config": {"sampler": "first_n"},
        "num_fewshot": shots,
        "output_type": "multiple_choice",
        "description": description,
        "doc_to_text": "Question: {{question}}\n"
        + ("".join(f"{x}. {{{{choices[{i}]}}}}\n" for i, x in enumerate("ABCD")) if letters else "")
        + "Answer:",
        "doc_to_choice": ["A", "B", "C", "D"] if letters else "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True},
        ],
    }
    ppl = {
        "task": f"{prefix}_ppl",
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {
                "test": data("ppl", [{"text": _text(rng, text_words // (1 + i % 3))} for i in range(texts)])
            }
        },
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "{{text}}",
        "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")],
    }

    def gen_doc(words: int) -> dict:
        return {"question": _text(rng, words) + "?", "answer": _text(rng, 2)}

    gen = {
        "task": f"{prefix}_gen",
        "dataset_path": "json",
        "dataset_kwargs": {
            "data_files": {
                "train": data("gen_train", [gen_doc(example_words) for _ in range(3)]),
                "test": data("gen_test", [gen_doc(gen_words) for _ in range(gen_questions)]),
            }
        },
        "training_split": "train",
        "test_split": "test",
        "fewshot_split": "train",
        "fewshot_config": {"sampler": "first_n"},
        "num_fewshot": 3,
        "output_type": "generate_until",
        "description": description,
        "doc_to_text": "Q: {{question}}\nA:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {
            "until": ["\n\n", "Q:", "how"],
            "max_gen_toks": max_gen_toks,
            "do_sample": False,
        },
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    }
    for task in (mc, ppl, gen):
        _yaml(directory / f"{task['task']}.yaml", task)
    return [mc["task"], ppl["task"], gen["task"]]


def offline_env(tmp: Path) -> dict[str, str]:
    """The environment of an lm-eval subprocess: offline, datasets cached under ``tmp``, and this
    checkout first on the path (a subprocess must test this worktree's code, not an install)."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        **OFFLINE,
        "HF_DATASETS_CACHE": str(tmp / "datasets"),
        "PYTHONPATH": root + (os.pathsep + path if path else ""),
    }


def read_results(output_dir: Path) -> dict:
    """The aggregated ``results`` of one run (task -> metric -> value)."""
    (path,) = output_dir.rglob("results_*.json")
    return json.loads(path.read_text())["results"]


def read_samples(output_dir: Path) -> dict[str, list[dict]]:
    """``--log_samples`` output of one run: task -> samples sorted by doc_id."""
    samples = {}
    for path in sorted(output_dir.rglob("samples_*.jsonl")):
        task = path.name[len("samples_") :].rsplit("_", 1)[0]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        samples[task] = sorted(rows, key=lambda r: r["doc_id"])
    return samples


def _scalar(x):
    """lm-eval's sample files hold responses as strings ("-14.62", "False"); in memory they are
    floats and bools. Both to one form: bools, floats, other text as it is."""
    if isinstance(x, str):
        if x in ("True", "False"):
            return x == "True"
        try:
            return float(x)
        except ValueError:
            return x
    return x


def _close(a, b, atol: float) -> bool:
    """Equal structure; numbers within ``atol``; bools and text identical."""
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_close(x, y, atol) for x, y in zip(a, b))
        )
    a, b = _scalar(a), _scalar(b)
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b or math.isclose(a, b, rel_tol=0, abs_tol=atol)
    return a == b


def _arguments(value) -> list:
    """A sample's request arguments as lists: files hold {"gen_args_0": {"arg_0": ...}}, memory
    holds a list of tuples."""
    if isinstance(value, dict):
        return [list(args.values()) for args in value.values()]
    return [list(args) for args in value]


def compare_samples(ref: dict[str, list[dict]], got: dict[str, list[dict]], atol: float = 1e-4) -> list[str]:
    """Differences between two runs' samples (empty: the same numbers). Responses and filtered
    responses: log-likelihoods within ``atol``, greedy flags and generations identical;
    per-sample metrics identical (perplexity terms, which are log-likelihoods, within ``atol``)."""
    problems = []
    if sorted(ref) != sorted(got):
        return [f"tasks differ: {sorted(ref)} vs {sorted(got)}"]
    for task in ref:
        if [s["doc_id"] for s in ref[task]] != [s["doc_id"] for s in got[task]]:
            problems.append(f"{task}: doc ids differ")
            continue
        for a, b in zip(ref[task], got[task]):
            if _arguments(a["arguments"]) != _arguments(b["arguments"]) or str(a["target"]) != str(
                b["target"]
            ):
                problems.append(f"{task} doc {a['doc_id']}: other requests")
            for field in ("resps", "filtered_resps", *a["metrics"]):
                if not _close(a[field], b[field], atol):
                    problems.append(f"{task} doc {a['doc_id']} {field}: {a[field]!r} vs {b[field]!r}")
    return problems
