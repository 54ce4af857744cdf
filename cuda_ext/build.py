"""Which implementation runs on a device, and the just-in-time build of the CUDA kernels.

Nothing is compiled at install or import time. The first time a CUDA tensor reaches the ops
(or :func:`backend_for` is asked about a CUDA device), the kernels are built with
``torch.utils.cpp_extension.load`` (cached in torch's extension directory, so later
processes only load the ``.so``) provided that this torch was built with CUDA
(``torch.version.cuda``) and ``nvcc`` is found. If anything is missing or the build fails,
one warning is logged and CUDA tensors use the pure-torch reference instead.

``RADIXKV_FORCE_REFERENCE=1`` (read on every call) or :func:`set_force_reference` selects
the reference everywhere, e.g. to compare both paths.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV_FORCE_REFERENCE = "RADIXKV_FORCE_REFERENCE"
EXTENSION_NAME = "radixkv_paged_copy"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "paged_copy.cu", CSRC / "paged_copy_bindings.cpp")

_force_reference: bool | None = None  # None: follow the environment variable
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_failure: str | None = None


def set_force_reference(force: bool | None) -> None:
    """Forces (True) or allows (False) the reference path; None defers to the env variable."""
    global _force_reference
    _force_reference = force


def force_reference() -> bool:
    """Whether the reference path is forced (flag first, then ``RADIXKV_FORCE_REFERENCE``)."""
    if _force_reference is not None:
        return _force_reference
    return os.environ.get(ENV_FORCE_REFERENCE, "").strip().lower() not in ("", "0", "false", "no")


def backend_for(device: torch.device | str) -> str:
    """``"cuda-kernel"``, ``"cpu-runs"`` or ``"reference"``: what the ops run on ``device``.

    Asking about a CUDA device builds/loads the kernels if that has not been tried yet.
    """
    device = torch.device(device)
    if force_reference():
        return "reference"
    if device.type == "cpu":
        return "cpu-runs"
    if device.type != "cuda":
        return "reference"
    return "cuda-kernel" if load_kernels() else "reference"


def unavailable_reason() -> str | None:
    """Why the kernels could not be loaded (None if loaded or not tried)."""
    return _failure


def load_kernels() -> bool:
    """Builds (first time only) and loads the CUDA kernels; True when they are registered."""
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                _build_and_load()
                _loaded = True
            except Exception as exc:  # any failure means: use the reference
                _failure = f"{type(exc).__name__}: {exc}"
                _loaded = False
                logger.warning(
                    "radixkv: CUDA paged-copy kernels unavailable (%s); "
                    "CUDA tensors use the pure-torch reference (full reason: "
                    "cuda_ext.unavailable_reason())",
                    _failure[:500],
                )
    return _loaded


def find_nvcc() -> str | None:
    """Path of nvcc: ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, PATH, then /usr/local/cuda."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.path.isfile(default) else None


def _build_and_load() -> None:
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} was built without CUDA")
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    from torch.utils import cpp_extension  # slow import, and only needed here

    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError(f"torch.utils.cpp_extension found no CUDA_HOME (nvcc is {nvcc})")

    logger.info("radixkv: building %s with %s (first use; cached afterwards)", EXTENSION_NAME, nvcc)
    cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(s) for s in SOURCES],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        is_python_module=False,
        verbose=logger.isEnabledFor(logging.DEBUG),
    )
