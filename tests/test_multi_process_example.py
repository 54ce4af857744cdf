"""examples/multi_gpu.py under torchrun with two CPU processes: each rank serves its own
documents from its own store, reuses them, and matches stock generate() (--check)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_two_processes_each_reuse_their_documents():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "examples/multi_gpu.py"), "--check", "--docs", "4", "--questions", "3"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = re.findall(
        r"rank (\d)/2 on cpu[:\d]*: (\d+) requests, cached tokens per request \[([\d, ]*)\]", res.stdout
    )
    assert sorted(rank for rank, _, _ in lines) == ["0", "1"], res.stdout
    for _, count, cached in lines:
        per_request = [int(x) for x in cached.split(",")]
        assert int(count) == 6 == len(per_request)  # 2 documents x 3 questions per rank
        # Each document: the first question misses, the next two reuse its 300-token prefix.
        assert per_request[0::3] == [0, 0] and all(c >= 288 for i, c in enumerate(per_request) if i % 3)
