"""Which torch build scripts/install.sh installs, and from where (stdlib only: runs before torch).

    python scripts/torch_choice.py    -> a sentence saying what and why, then the pip install
                                         arguments, one per line (what scripts/install.sh reads)

The decision (``choose``), in order:

1. ``RADIXKV_TORCH_INDEX`` set: that index (``--index-url``); set but empty: pip's own
   configuration (PyPI unless pip.conf says otherwise). ``RADIXKV_TORCH_SPEC`` replaces the
   requirement (default ``torch==2.13.0``) in every case.
2. An NVIDIA GPU (``nvidia-smi`` on PATH or ``/proc/driver/nvidia``), or not Linux: pip's own
   configuration. PyPI's Linux torch is the CUDA build; on macOS and Windows it is the CPU one.
3. Linux without an NVIDIA GPU, where pip's own sources already hold a local CPU wheel of the
   requirement (a machine set up offline, like this project's test machines and CI): pip's own
   configuration, which finds that wheel (probed offline: ``local_cpu_wheel``).
4. Otherwise: PyTorch's CPU wheel index, as PyTorch's own instructions do
   (``--index-url https://download.pytorch.org/whl/cpu``): the CPU build and nothing of CUDA,
   instead of PyPI's CUDA build and its several GB of CUDA libraries.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping

DEFAULT_SPEC = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_nvidia_gpu() -> bool:
    """An NVIDIA driver is installed: its tool on PATH or its /proc entry."""
    return shutil.which("nvidia-smi") is not None or os.path.exists("/proc/driver/nvidia")


def local_cpu_wheel(spec: str, python: str = sys.executable) -> bool:
    """pip resolves ``spec`` to a CPU build (version ``+cpu``) from local sources alone: a dry run
    with ``--no-index`` (no network; find-links directories only), nothing installed."""
    command = [python, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps", "--ignore-installed"]
    command += ["--quiet", "--report", "-", spec]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        report = json.loads(proc.stdout) if proc.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return False
    versions = [item.get("metadata", {}).get("version", "") for item in report.get("install", [])]
    return bool(versions) and all(v.endswith("+cpu") for v in versions)


def choose(env: Mapping[str, str], system: str, nvidia: bool, local_cpu: bool) -> tuple[list[str], str]:
    """(pip install arguments, why) for torch; see the module docstring. ``local_cpu`` is only
    read in case 3 (callers may pass a function's result lazily by computing it first)."""
    spec = env.get("RADIXKV_TORCH_SPEC") or DEFAULT_SPEC
    if "RADIXKV_TORCH_INDEX" in env:
        index = env["RADIXKV_TORCH_INDEX"]
        if index:
            return [spec, "--index-url", index], f"{spec} from {index} (RADIXKV_TORCH_INDEX)"
        return [spec], f"{spec} from pip's configured index (RADIXKV_TORCH_INDEX is empty)"
    if nvidia:
        return [spec], f"{spec} from pip's configured index (an NVIDIA GPU: the CUDA build)"
    if system != "Linux":
        return [spec], f"{spec} from pip's configured index ({system}: the CPU build)"
    if local_cpu:
        return [spec], f"{spec}, the CPU build pip finds on this machine (no NVIDIA GPU)"
    return [spec, "--index-url", CPU_INDEX], f"{spec}, the CPU build from {CPU_INDEX} (no NVIDIA GPU)"


def main(argv: list[str]) -> int:
    env = os.environ
    system, nvidia = platform.system(), has_nvidia_gpu()
    spec = env.get("RADIXKV_TORCH_SPEC") or DEFAULT_SPEC
    probe = "RADIXKV_TORCH_INDEX" not in env and not nvidia and system == "Linux"
    args, why = choose(env, system, nvidia, probe and local_cpu_wheel(spec))
    print("\n".join([why, *args]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
