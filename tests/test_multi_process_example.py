"""batchrun under torchrun with two CPU processes (gloo): the merged result file is complete, in
input order, equal line by line to stock generate(); each system prompt is served by one rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.batch_job import check_results, save_tiny_model, stock_answers, write_requests

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_two_ranks_route_by_prefix_and_match_stock(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    raw = write_requests(tmp_path / "requests.jsonl", questions_per_system=6)
    output = tmp_path / "results.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "batchrun", "--model", str(model_dir), "--input", str(tmp_path / "requests.jsonl"),
           "--output", str(output), "--cpu", "--no-progress"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = check_results(output, raw, stock_answers(model_dir, raw))
    served = [int(count) for _, count in re.findall(r"rank (\d): (\d+) requests", res.stdout)]
    assert len(served) == 2 and all(n > 0 for n in served) and sum(served) == 14, res.stdout
    assert "missing 0" in res.stdout
    # Prefix-affine: all chats over one system prompt went to one rank, so that rank computed the
    # system prompt once and its other 5 chats reused it.
    for s in (0, 1):
        usage = [r["response"]["body"]["usage"] for r in results
                 if r["error"] is None and r["custom_id"].startswith(f"chat-{s}-")]  # fmt: skip
        assert sum(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usage) >= 5, json.dumps(usage)


@pytest.mark.slow
def test_two_round_robin_ranks_through_one_sidecar_match_stock(tmp_path):
    """With the wait (ranks wait for a prefix the other is computing, docs/sidecar.md); the
    sidecar without it: tests/test_evalrun.py (two ranks) and tests/test_sidecar.py."""
    from tests.sidecar_process import sidecar_stats, start_sidecar

    model_dir = save_tiny_model(tmp_path / "model")
    raw = write_requests(tmp_path / "requests.jsonl", questions_per_system=2)
    output = tmp_path / "results.jsonl"
    path = tmp_path / "s.sock"
    sidecar = start_sidecar(path)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "RADIXKV_SIDECAR": str(path),
               "RADIXKV_SIDECAR_WAIT_S": "10"}  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "batchrun", "--model", str(model_dir), "--input", str(tmp_path / "requests.jsonl"),
               "--output", str(output), "--cpu", "--no-progress", "--routing", "round-robin"]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        check_results(output, raw, stock_answers(model_dir, raw))
        stats = sidecar_stats(path)
    finally:
        sidecar.kill()
        sidecar.wait()
    assert stats["clients_total"] >= 2 and stats["inserted_tokens"] > 0, stats
    assert stats["open_leases"] == stats["open_txns"] == stats["pinned_blocks"] == 0, stats
    assert stats["claims"] == 0, stats  # fulfilled by the ranks' commits or gone with them
