"""batchrun in one process: OpenAI batch lines in, one result per line in input order, equal to
stock generate(); bad lines as error lines; a rerun skips what is done; routing units."""

from __future__ import annotations

import json
import random

import pytest

from batchrun.runner import run
from hf_patch.planning.routing import assign_ranks, prefix_groups, round_robin
from radixkv import pack_tokens
from tests.batch_job import check_results, save_tiny_model, stock_answers, write_requests
from tests.hf_models import one_torch_thread  # noqa: F401  (autouse)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    directory = tmp_path_factory.mktemp("batchrun")
    model_dir = save_tiny_model(directory / "model")
    raw = write_requests(directory / "requests.jsonl")
    return directory, model_dir, raw, stock_answers(model_dir, raw)


def test_one_process_answers_every_line_like_stock_generate(job, capsys):
    directory, model_dir, raw, answers = job
    output = directory / "results.jsonl"
    argv = ["--model", str(model_dir), "--input", str(directory / "requests.jsonl"), "--output", str(output),
            "--no-progress", "--cpu"]  # fmt: skip
    assert run(argv) == 0
    results = check_results(output, raw, answers)
    report = capsys.readouterr().out
    assert "errors 5, missing 0" in report
    assert not (directory / "results.jsonl.parts").exists()  # merged and removed
    # The chats over one system prompt reuse it: most of their prompt tokens were cached.
    usage = [
        r["response"]["body"]["usage"]
        for r in results
        if r["error"] is None and r["custom_id"].startswith("chat-")
    ]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    assert cached > 0.6 * sum(u["prompt_tokens"] for u in usage)

    # A rerun after a crash that lost some results serves only those, and keeps the rest as they were.
    kept = output.read_text().splitlines()
    output.write_text("\n".join(kept[:5]) + "\n")
    assert run(argv) == 0
    assert "skipped (done before) 4" in capsys.readouterr().out  # lines 0-4 hold 4 results + 1 error
    rerun = output.read_text().splitlines()
    assert rerun[:5] == kept[:5]
    check_results(output, raw, answers)


def test_affine_routing_keeps_prefix_groups_on_one_rank_and_balances():
    rng = random.Random(1)
    docs = [[rng.randrange(1000) for _ in range(64 + 16 * d)] for d in range(6)]
    prompts = [docs[d % 6] + [rng.randrange(1000) for _ in range(5)] for d in range(60)]
    packed = [pack_tokens(p) for p in prompts]
    ranks = assign_ranks(packed, 3, block_size=16)
    for d in range(6):
        assert len({ranks[i] for i in range(d, 60, 6)}) == 1  # one document, one rank
    load = [sum(len(docs[d]) for d in range(6) if ranks[d] == r) for r in range(3)]
    assert max(load) - min(load) <= 64  # documents of 64-144 tokens balance to within one
    assert assign_ranks(packed, 3, block_size=16) == ranks  # deterministic
    assert round_robin(5, 2) == [0, 1, 0, 1, 0]


def test_a_group_larger_than_a_fair_share_is_split_where_it_shares_least():
    shared_part = list(range(32))
    prompts = [pack_tokens(shared_part + [100 + i // 4] * 16 + [i]) for i in range(16)]
    groups = prefix_groups(prompts, 2, block_size=16)
    # Cut where only the 32 common tokens are shared, never inside a sub-group of 4 (48 shared).
    assert sorted(sorted(members) for _, members in groups) == [list(range(k, k + 4)) for k in (0, 4, 8, 12)]
    ranks = assign_ranks(prompts, 2, block_size=16)
    assert sorted(ranks) == [0] * 8 + [1] * 8


def test_bad_input_file_lines(tmp_path):
    from batchrun.runner import read_requests

    path = tmp_path / "in.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}),
                json.dumps({"custom_id": "", "url": "/v1/completions", "body": {}}),
                json.dumps([1, 2]),
                json.dumps(
                    {"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x", "temperature": 9}}
                ),
                json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": {"messages": []}}),
            ]
        )  # fmt: skip
    )
    errors = [r.error for r in read_requests(path)]
    assert "method must be POST" in errors[0] and "custom_id must be a non-empty string" in errors[1]
    assert "not a JSON object" in errors[2] and "temperature must be a number in [0.0, 2.0]" in errors[3]
    assert "non-empty 'messages'" in errors[4]


def test_merge_after_a_failed_rank_keeps_what_the_others_finished(tmp_path):
    """Rank 1 died before writing: rank 0's results and the error lines are merged in input order,
    the parts stay for the rerun, and the missing requests are counted."""
    from batchrun.runner import finished, merge, parts_dir, read_requests

    path = tmp_path / "in.jsonl"
    lines = [{"custom_id": f"r{i}", "url": "/v1/completions", "body": {"prompt": "x"}} for i in range(4)]
    path.write_text("\n".join([json.dumps(x) for x in lines] + ["{broken"]))
    requests = read_requests(path)
    output = tmp_path / "out.jsonl"
    parts_dir(output).mkdir()
    served = [
        {"id": f"i{i}", "custom_id": f"r{i}", "response": {"status_code": 200}, "error": None} for i in (2, 0)
    ]
    (parts_dir(output) / "rank0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in served) + '{"cut sh')
    assert merge(requests, output) == 2
    merged = [json.loads(x) for x in output.read_text().splitlines()]
    assert [m["custom_id"] for m in merged] == ["r0", "r2", None] and "not JSON" in merged[-1]["error"]
    assert (parts_dir(output) / "rank0.jsonl").exists()  # kept until the job is complete
    assert set(finished(output)) == {"r0", "r2"}  # what a rerun skips


def test_a_failed_generation_becomes_error_lines_and_a_rerun_serves_them(job, tmp_path, monkeypatch, capsys):
    import batchrun.runner

    directory, model_dir, raw, answers = job
    output = tmp_path / "results.jsonl"
    argv = ["--model", str(model_dir), "--input", str(directory / "requests.jsonl"), "--output", str(output),
            "--no-progress", "--cpu", "--chunk", "4"]  # fmt: skip
    calls = []

    def second_chunk_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return original(*args, **kwargs)

    original = batchrun.runner.hf_patch.generate_many
    monkeypatch.setattr(batchrun.runner.hf_patch, "generate_many", second_chunk_fails)
    assert run(argv) == 0
    results = [json.loads(x) for x in output.read_text().splitlines()]
    failed = [r for r in results if r["response"]["status_code"] == 500]
    assert len(failed) == 4 and all("RuntimeError: out of memory (simulated)" in r["error"] for r in failed)
    assert "missing 0" in capsys.readouterr().out
    monkeypatch.setattr(batchrun.runner.hf_patch, "generate_many", original)
    assert run(argv) == 0
    assert "skipped (done before) 8" in capsys.readouterr().out  # the 4 failed ones are served now
    check_results(output, raw, answers)


def test_a_prompt_longer_than_the_context_is_an_error_line():
    from batchrun.openai_batch import BatchRequest, encode

    class Vocab:
        def __len__(self):
            return 100

    too_long = BatchRequest(0, "a", "completion", {"prompt": [5] * 30, "max_tokens": 5})
    encode(too_long, Vocab(), default_max_tokens=256, context=32)
    assert too_long.error == "the prompt has 30 tokens and asks for 5 more; the model's context is 32 tokens"
    fits = BatchRequest(1, "b", "completion", {"prompt": [5] * 30})
    encode(fits, Vocab(), default_max_tokens=256, context=32)
    assert fits.error is None and fits.generate_kwargs["max_new_tokens"] == 2  # the default, shortened
