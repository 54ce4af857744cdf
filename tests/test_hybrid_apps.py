"""batchrun and evalrun on a hybrid checkpoint (Qwen3.5-style: Gated DeltaNet + full attention)
and a pure state-space one (Mamba-2): the same answers as stock generate() and lm-eval's own
``hf`` model, with the shared system prompts and few-shot preambles read from the cache.

The family matrix (tests/test_hf_recurrent.py) checks generate() and scoring per family; this
checks that the applications built on them take stateful stores as they are."""

from __future__ import annotations

import pytest

from batchrun.runner import run
from tests.batch_job import check_results, stock_answers, write_requests
from tests.hf_models import one_torch_thread  # noqa: F401  (autouse)
from tests.hybrid_models import save_hybrid

FAMILIES = ("qwen3_5_text", "mamba2")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, save_hybrid(directory / "model", request.param)


def test_batchrun_answers_like_stock_and_reuses_the_system_prompts(checkpoint, tmp_path, capsys):
    name, model_dir = checkpoint
    raw = write_requests(tmp_path / "requests.jsonl")
    output = tmp_path / "results.jsonl"
    argv = ["--model", str(model_dir), "--input", str(tmp_path / "requests.jsonl"), "--output", str(output),
            "--no-progress", "--cpu"]  # fmt: skip
    assert run(argv) == 0
    results = check_results(output, raw, stock_answers(model_dir, raw))
    assert "errors 5, missing 0" in capsys.readouterr().out
    usage = [
        r["response"]["body"]["usage"]
        for r in results
        if r["error"] is None and r["custom_id"].startswith("chat-")
    ]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    # 10 chats over 2 system prompts: all but the first of each reuse theirs up to a snapshot
    assert cached > 0.5 * sum(u["prompt_tokens"] for u in usage), (name, cached)


def test_evalrun_scores_and_generates_like_lm_evals_hf_model(checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")  # the eval extra (the dev extra has it)
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from evalrun import RadixLM
    from tests.eval_tasks import compare_samples, offline_env, write_tasks

    name, model_dir = checkpoint
    tasks = write_tasks(tmp_path / "tasks")
    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    common = dict(pretrained=str(model_dir), dtype="float32", max_length=128, batch_size=4, device="cpu")
    out = {}
    for kind, make in (("hf", HFLM), ("radixkv", RadixLM)):
        lm = make(**common)
        out[kind] = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True)
    assert compare_samples(out["hf"]["samples"], out["radixkv"]["samples"]) == []
    for task in tasks:
        ref, got = out["hf"]["results"][task], out["radixkv"]["results"][task]
        for metric, value in ref.items():
            if isinstance(value, float) and "_stderr" not in metric:
                assert got[metric] == pytest.approx(value, rel=1e-5), (task, metric)
    figures = lm.figures
    assert 0 < figures.cached_tokens < figures.prompt_tokens, (
        f"{name}: no few-shot preamble was read from the cache"
    )
    lm.store.check_invariants()
    assert lm.store.stats()["pinned_blocks"] == 0
