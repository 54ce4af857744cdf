"""PyTorch's cuDNN attention backend off for serving on CUDA, unless ``RADIXKV_CUDNN_SDPA=1``.

On Hopper GPUs torch picks cuDNN's fused attention for SDPA when it can (bf16/fp16, a mask).
cuDNN builds an execution graph per shape, and decoding changes the key length at every
step, so every step of every layer builds a new graph on the CPU: measured on an H200
(torch 2.11, cuDNN through torch, the built-in model, 32 rows at ~620 columns;
``benchmarks/bench_step.py``), one decode step took 57.9 ms with cuDNN and 5.45 ms without
(85% of the step's CPU time was ``aten::_cudnn_attention_forward`` for 0.6 ms of GPU work).
Without it, torch picks flash or memory-efficient attention, which need no per-shape build.

The demo and batchrun call ``avoid_cudnn_sdpa`` for a CUDA model; the library does not change
torch's settings on import (a user's own process keeps its choice: call it, or
``torch.backends.cuda.enable_cudnn_sdp(False)``). evalrun leaves it as ``--model hf`` has it,
so its numbers stay those of the same kernels.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV = "RADIXKV_CUDNN_SDPA"


def cudnn_sdpa_wanted() -> bool:
    """``RADIXKV_CUDNN_SDPA``: 1 keeps torch's cuDNN attention backend; 0 or unset turns it off."""
    value = os.environ.get(ENV, "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def avoid_cudnn_sdpa(device) -> bool:
    """Turn torch's cuDNN SDPA backend off for this process when ``device`` is CUDA (see the
    module); True when it did. Process-wide: every later SDPA call on any CUDA device."""
    if torch.device(device).type != "cuda" or cudnn_sdpa_wanted():
        return False
    if torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        logger.info(
            "cuDNN attention off (it builds a graph per key length, i.e. per decode step); %s=1 keeps it", ENV
        )
    return True
