"""evalrun through lm-eval against ``--model hf`` on the same model and dtype.

Local tasks (tests/eval_tasks.py: multiple choice, loglikelihood_rolling perplexity,
generate_until with stop sequences) over JSON files, offline. Both backends run lm-eval's own
command line with ``--log_samples``; per-sample responses must match (log-likelihoods within
1e-4, greedy flags and generations identical) and so must the metrics. Also: simple_evaluate
with a RadixLM object and a cache file (the second run starts warm), and two CPU ranks under
torchrun with either split.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")  # the eval extra (the dev extra has it)

from tests.batch_job import save_tiny_model  # noqa: E402
from tests.eval_tasks import compare_samples, offline_env, read_results, read_samples, write_tasks  # noqa: E402

MODEL_ARGS = "dtype=float32,max_length=128"  # 128: the long perplexity texts take several windows
EXACT_METRICS = ("acc,none", "acc_norm,none", "exact_match,none")
FIGURES = re.compile(r"^\|rank (\d+)\s*\|\s*(\d+)\|\s*(\d+)\|\s*(\d+)\|\s*([\d.]+)\|", re.M)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalrun")
    model_dir = save_tiny_model(tmp / "tiny")
    tasks = write_tasks(tmp / "tasks")
    return tmp, model_dir, tasks


def run_cli(
    workspace,
    model: str,
    name: str,
    model_args: str = "",
    launcher=(sys.executable, "-m", "evalrun"),
    env: dict | None = None,
):
    """One lm-eval run on the command line; returns (samples, results, stdout)."""
    tmp, model_dir, tasks = workspace
    out = tmp / name
    command = [
        *launcher,
        "--model", model,
        "--model_args", f"pretrained={model_dir},{MODEL_ARGS}{model_args}",
        "--tasks", ",".join(tasks),
        "--include_path", str(tmp / "tasks"),
        "--batch_size", "4",
        "--device", "cpu",
        "--log_samples",
        "--output_path", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        command, env={**offline_env(tmp), **(env or {})}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return read_samples(out), read_results(out), proc.stdout


@pytest.fixture(scope="module")
def hf(workspace):
    return run_cli(workspace, "hf", "hf")


def assert_same_metrics(ref: dict, got: dict) -> None:
    assert sorted(ref) == sorted(got)
    for task, metrics in ref.items():
        for name, value in metrics.items():
            if name in EXACT_METRICS:
                assert got[task][name] == value, f"{task} {name}"
            elif "_stderr" not in name and ("perplexity" in name or "bits_per_byte" in name):
                assert math.isclose(got[task][name], value, rel_tol=1e-5), f"{task} {name}"


def figures(stdout: str) -> dict[int, tuple[int, int, int, float]]:
    """The cache's figures under lm-eval's table: rank -> (prompt, served, computed, hit rate)."""
    rows = {int(m[1]): (int(m[2]), int(m[3]), int(m[4]), float(m[5])) for m in FIGURES.finditer(stdout)}
    for prompt, served, computed, _ in rows.values():
        assert prompt == served + computed
    return rows


def test_radixkv_on_the_command_line_gives_the_numbers_of_model_hf(workspace, hf):
    samples, results, stdout = run_cli(workspace, "radixkv", "radixkv")
    ref_samples, ref_results, _ = hf
    assert {task: len(s) for task, s in samples.items()} == {"tiny_gen": 8, "tiny_mc": 12, "tiny_ppl": 5}
    assert compare_samples(ref_samples, samples) == []
    assert_same_metrics(ref_results, results)
    gens = [s["resps"][0][0] for s in samples["tiny_gen"]]
    assert any(len(g) < 12 for g in gens), "no generation stopped at a stop sequence"
    (prompt, served, computed, hit_rate), *_ = figures(stdout).values()
    assert "| Tasks" in stdout and served > 0.3 * prompt, "the few-shot preambles were not reused"


def test_simple_evaluate_with_a_radixlm_and_a_cache_file_starts_warm(workspace, hf, monkeypatch):
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM

    from evalrun import RadixLM

    tmp, model_dir, tasks = workspace
    for key, value in offline_env(tmp).items():
        monkeypatch.setenv(key, value)
    cache_file = tmp / "kv.safetensors"
    # The local tasks only: indexing lm-eval's own ~14,000 task files costs ~8 s of CPU and none
    # of them runs here (the command-line runs above index them as lm-eval's CLI does).
    manager = TaskManager(include_path=str(tmp / "tasks"), include_defaults=False)
    computed = []
    # A path, then a model object loaded from it (same weights: the cache file's identity holds).
    for pretrained in (str(model_dir), AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)):
        lm = RadixLM(
            pretrained=pretrained, tokenizer=str(model_dir), dtype="float32", max_length=128, batch_size=4,
            device="cpu", cache_file=str(cache_file), block_size=4,
        )  # fmt: skip
        out = lm_eval.simple_evaluate(model=lm, tasks=[tasks[0]], task_manager=manager, log_samples=True)
        assert compare_samples({tasks[0]: hf[0][tasks[0]]}, out["samples"]) == []
        assert out["results"][tasks[0]]["acc,none"] == hf[1][tasks[0]]["acc,none"]
        assert cache_file.exists() and lm.store.stats()["pinned_blocks"] == 0
        computed.append(lm.figures.computed_tokens)
        lm.store.check_invariants()
    # The second run restored every input it scored: only the continuations' positions run.
    distinct_inputs = len({s["arguments"]["gen_args_0"]["arg_0"] for s in hf[0][tasks[0]]})
    assert computed[1] < computed[0] / 4 and computed[1] >= distinct_inputs


TWO_RANKS = (
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    "-m",
    "evalrun",
)


@pytest.mark.parametrize("split", ["affine", "docs"])
def test_two_cpu_ranks_under_torchrun_give_the_numbers_of_model_hf(workspace, hf, split):
    samples, results, stdout = run_cli(workspace, "radixkv", f"ranks-{split}", f",split={split}", TWO_RANKS)
    check_two_ranks(hf, split, samples, results, stdout)


def test_two_cpu_ranks_sharing_a_sidecar_give_the_numbers_of_model_hf(workspace, hf, tmp_path_factory):
    from tests.sidecar_process import sidecar_stats, start_sidecar

    path = tmp_path_factory.mktemp("sc") / "s.sock"
    sidecar = start_sidecar(path)
    try:
        env = {"RADIXKV_SIDECAR": str(path)}
        samples, results, stdout = run_cli(
            workspace, "radixkv", "ranks-sidecar", ",split=docs", TWO_RANKS, env
        )
        check_two_ranks(hf, "docs", samples, results, stdout)
        stats = sidecar_stats(path)
    finally:
        sidecar.kill()
        sidecar.wait()
    # Both ranks attached and wrote their prefixes through; nothing is left pinned.
    assert stats["clients_total"] >= 2 and stats["inserted_tokens"] > 0, stats
    assert stats["open_leases"] == stats["open_txns"] == stats["pinned_blocks"] == 0, stats


def check_two_ranks(hf, split, samples, results, stdout) -> None:
    if split == "docs":
        # lm-eval's own data-parallel padding: a rank with fewer requests of a type runs its last
        # request again, and that request logs both responses. The first is the real one.
        for task, ref in hf[0].items():
            for a, b in zip(ref, samples[task]):
                b["resps"] = [rb[: len(ra)] for ra, rb in zip(a["resps"], b["resps"])]
    assert compare_samples(hf[0], samples) == []
    assert_same_metrics(hf[1], results)
    rows = figures(stdout)
    assert sorted(rows) == [0, 1] and all(prompt > 0 for prompt, *_ in rows.values()), "a rank did nothing"
    assert stdout.count("| Tasks") == 1, "one rank prints lm-eval's table"


def test_bad_radixkv_arguments_are_refused_by_name(workspace):
    from evalrun import RadixLM
    from radixkv import CorruptCacheFile

    _, model_dir, _ = workspace
    for kwargs, message in (
        ({"split": "random"}, r"split must be one of \('affine', 'docs'\)"),
        ({"cache_tokens": 0}, "cache_tokens must be a positive integer"),
        ({"host_cache_bytes": "1GB"}, "host_cache_bytes must be a positive integer"),
        ({"block_size": 3}, "block_size must be a power of two"),
        ({"cache_file": str(model_dir)}, "is a directory"),
        ({"cache_file": str(model_dir / "no" / "kv.safetensors")}, "does not exist"),
    ):
        with pytest.raises(ValueError, match=message):
            RadixLM(pretrained=str(model_dir), device="cpu", **kwargs)
    damaged = model_dir.parent / "damaged.safetensors"
    damaged.write_bytes(b"not a cache file")
    with pytest.raises(
        CorruptCacheFile, match="cache_file .*damaged.safetensors: .*delete it or pass another"
    ):
        RadixLM(pretrained=str(model_dir), device="cpu", cache_file=str(damaged))
    assert damaged.read_bytes() == b"not a cache file", "a refused cache file was changed"


def test_a_cache_file_that_cannot_be_written_costs_the_file_not_the_results(workspace, monkeypatch, caplog):
    """The cache file only makes a rerun faster: a full disk when it is written after a request
    type must not throw away the results lm-eval computed (``--model hf`` would have them)."""
    import errno

    from lm_eval.api.instance import Instance

    import hf_patch
    from evalrun import RadixLM

    tmp, model_dir, _ = workspace
    lm = RadixLM(pretrained=str(model_dir), device="cpu", dtype="float32", block_size=4,
                 cache_file=str(tmp / "full-disk.safetensors"))  # fmt: skip

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_patch, "save_cache", full_disk)
    requests = [Instance("loglikelihood", {}, ("The cache of the tree", " is"), 0)]
    with caplog.at_level("WARNING", logger="evalrun.model"):
        (answer,) = lm.loglikelihood(requests, disable_tqdm=True)
    assert isinstance(answer[0], float) and isinstance(answer[1], bool)
    assert "No space left on device" in caplog.text and "full-disk.safetensors" in caplog.text
