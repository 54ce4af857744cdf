"""scripts/torch_choice.py: which torch build scripts/install.sh installs, and from where.

The decision is tested here for every case. What this machine cannot test: an install from the
public indexes (PyPI, download.pytorch.org) is unreachable here, so that ``--index-url
https://download.pytorch.org/whl/cpu`` really yields the CPU build on a fresh public machine is
PyTorch's documented behaviour, not something these tests ran.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torch_choice.py"
spec = importlib.util.spec_from_file_location("torch_choice", SCRIPT)
torch_choice = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_choice)
choose, CPU, PIN = torch_choice.choose, torch_choice.CPU_INDEX, torch_choice.DEFAULT_SPEC


@pytest.mark.parametrize(
    ("env", "system", "nvidia", "local", "args"),
    [
        ({}, "Linux", False, False, [PIN, "--index-url", CPU]),  # a public CPU machine
        ({}, "Linux", False, True, [PIN]),  # a local CPU wheel (this machine, CI)
        ({}, "Linux", True, False, [PIN]),  # a GPU: PyPI's CUDA build
        ({}, "Darwin", False, False, [PIN]),  # PyPI's macOS wheel is the CPU build
        (
            {"RADIXKV_TORCH_INDEX": "https://mirror/cu121"},
            "Linux",
            True,
            True,
            [PIN, "--index-url", "https://mirror/cu121"],
        ),
        ({"RADIXKV_TORCH_INDEX": ""}, "Linux", False, False, [PIN]),  # pip's own configuration
        ({"RADIXKV_TORCH_SPEC": "torch==2.6.0"}, "Linux", False, False, ["torch==2.6.0", "--index-url", CPU]),
        ({"RADIXKV_TORCH_SPEC": ""}, "Linux", False, True, [PIN]),
    ],
)
def test_choose(env, system, nvidia, local, args):
    chosen, why = choose(env, system, nvidia, local)
    assert chosen == args and why.startswith(args[0])


def test_the_script_prints_a_reason_then_the_arguments_and_never_goes_online():
    """Offline by construction (the probe passes --no-index); on this machine and CI pip's
    find-links hold a CPU wheel of the pin, so the plain pin is chosen."""
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    why, *args = proc.stdout.splitlines()
    assert args[0] == PIN and why.startswith(PIN)
    assert args == [PIN] or args == [PIN, "--index-url", CPU] or "NVIDIA" in why


def test_local_cpu_wheel_is_false_for_a_version_nobody_has():
    assert torch_choice.local_cpu_wheel("torch==0.0.1") is False


def test_install_script_parses_and_reads_the_choice():
    """scripts/install.sh is valid bash and takes torch's arguments from torch_choice.py's output
    (the sentence first, then the arguments): a fresh-venv install here ran it end to end."""
    script = SCRIPT.parent / "install.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "scripts/torch_choice.py)" in text and '"${choice[@]:1}"' in text and 'say "done"' in text
