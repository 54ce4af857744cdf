"""How many bytes a rollout pool may take: a fixed number, or a fraction of the memory free on
the model's device when the pool is built (after the previous step's activations are gone).

- CUDA: ``torch.cuda.mem_get_info`` (free in the driver) plus what PyTorch's caching allocator
  holds reserved but unused (freed activations and optimizer temporaries it keeps for reuse:
  free for the pool too, though the driver counts them as used).
- CPU: ``psutil.virtual_memory().available`` (psutil comes with accelerate, which transformers'
  Trainer needs).

Either way the result is capped at ``max_tokens`` tokens of the model's KV: a pool larger than a
rollout round can fill only costs its block bookkeeping (a free list of every block).
"""

from __future__ import annotations

import torch

DEFAULT_FRACTION = 0.25
DEFAULT_MAX_TOKENS = 1 << 20


def free_bytes(device: torch.device) -> int:
    """Bytes free for a new allocation on ``device`` now (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.virtual_memory().available)


def pool_bytes(
    device: torch.device,
    bytes_per_token: int,
    *,
    budget_bytes: int | None = None,
    budget_fraction: float | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
) -> int:
    """The pool's byte budget: ``budget_bytes`` if given, else ``budget_fraction`` (default 0.25)
    of ``free_bytes(device)``; at most ``max_tokens * bytes_per_token`` either way."""
    if budget_bytes is not None and budget_fraction is not None:
        raise ValueError("give at most one of budget_bytes= and budget_fraction=")
    if budget_bytes is not None:
        if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
        wanted = budget_bytes
    else:
        fraction = DEFAULT_FRACTION if budget_fraction is None else budget_fraction
        if not 0 < fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1], got {fraction!r}")
        wanted = int(fraction * free_bytes(device))
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    return min(wanted, max_tokens * max(1, bytes_per_token))
