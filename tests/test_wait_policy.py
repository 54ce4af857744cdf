"""OMP_WAIT_POLICY is PASSIVE when torch loads in every entry point (python -m demo, batchrun,
evalrun, the lm-eval backend, python -m radixkv.sidecar, a library import of hf_patch or
radixkv), unless the user set it; a process that loaded torch first keeps what it had
(radixkv.wait_policy, re-exported as hf_patch.wait_policy).

Each case is a fresh interpreter whose audit hook records the variable at the moment ``import
torch`` starts (the OpenMP runtime loads inside it and reads the variable then), run in parallel.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_patch.wait_policy import quiet_threads as reexported
from radixkv.wait_policy import quiet_threads

ROOT = str(Path(__file__).resolve().parents[1])

# argv[1]: "module ARGS..." to run as python -m, or "import NAME[,NAME...]" to import in order.
CHILD = r"""
import json, os, runpy, sys
seen = {}
def hook(event, args):
    if event == "import" and args[0] == "torch" and "at_torch" not in seen:
        seen["at_torch"] = os.environ.get("OMP_WAIT_POLICY", "<unset>")
sys.addaudithook(hook)
how, *rest = sys.argv[1].split()
try:
    if how == "import":
        for name in rest[0].split(","):
            __import__(name)
    else:
        sys.argv = [how, *rest]
        runpy.run_module(how, run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print("\nPOLICY " + json.dumps({**seen, "torch_loaded": "torch" in sys.modules}))
"""

CASES = {
    # name: (what to run, OMP_WAIT_POLICY set by the user or None, expected at torch import).
    # The user's own value and a process that loaded torch first: the unit test below.
    "python -m evalrun (and the lm-eval backend: evalrun/__init__)": ("evalrun --help", None, "PASSIVE"),
    "python -m batchrun": ("batchrun --help", None, "PASSIVE"),
    "python -m demo (a model that is not there)": ("demo --model /nonexistent/model", None, "PASSIVE"),
    "import hf_patch": ("import hf_patch", None, "PASSIVE"),
    "python -m radixkv.sidecar (its process loads torch through radixkv)": (
        "radixkv.sidecar --help",
        None,
        "PASSIVE",
    ),
    "import radixkv": ("import radixkv", None, "PASSIVE"),
    "the user's ACTIVE stays for radixkv": ("import radixkv", "ACTIVE", "ACTIVE"),
    "the user's ACTIVE stays": ("import hf_patch", "ACTIVE", "ACTIVE"),
}


@pytest.fixture(scope="module")
def outcomes():
    procs = {}
    for name, (what, user, _) in CASES.items():
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        if user is not None:
            env["OMP_WAIT_POLICY"] = user
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", CHILD, what],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        lines = [line for line in stdout.splitlines() if line.startswith("POLICY ")]
        assert lines, f"{name}: no result line; stderr:\n{stderr[-2000:]}"
        out[name] = json.loads(lines[-1][len("POLICY ") :])
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_the_wait_policy_when_torch_loads(outcomes, name):
    expected = CASES[name][2]
    assert outcomes[name]["torch_loaded"], f"{name} never loaded torch: the case tests nothing"
    assert outcomes[name]["at_torch"] == expected


def test_quiet_threads_sets_only_an_unset_variable_before_torch(caplog):
    env = {}
    assert quiet_threads(env, modules={}) is True
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for value in ("ACTIVE", "passive", ""):
        env = {"OMP_WAIT_POLICY": value}
        assert quiet_threads(env, modules={}) is False
        assert env == {"OMP_WAIT_POLICY": value}
    env = {}
    with caplog.at_level(logging.INFO, logger="radixkv.wait_policy"):
        assert quiet_threads(env, modules={"torch": object()}) is False
    assert env == {}
    assert "OMP_WAIT_POLICY=PASSIVE" in caplog.text  # how to choose, since it is too late here


def test_hf_patch_re_exports_the_one_function():
    assert reexported is quiet_threads
