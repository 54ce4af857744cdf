"""The cache's figures for an evaluation: prompt tokens, served from cache, hit rate, time.

Each ``RadixLM`` registers one ``CacheFigures`` record (it outlives the model, which
``simple_evaluate`` drops when it returns); ``python -m evalrun`` prints the records of its
process (of every rank, gathered) under lm-eval's results table.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

_runs: list[CacheFigures] = []
_lock = threading.Lock()


@dataclasses.dataclass
class CacheFigures:
    """Counters of one RadixLM's store since it was built (after a restore), and the seconds its
    request calls took. Prompt tokens count every model input token (scored inputs, generation
    prompts); ``cached_tokens`` those read from the store instead of computed."""

    rank: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def register(figures: CacheFigures) -> CacheFigures:
    with _lock:
        _runs.append(figures)
    return figures


def runs() -> list[CacheFigures]:
    """The figures of every RadixLM built in this process, oldest first."""
    with _lock:
        return list(_runs)


def gather(figures: list[CacheFigures]) -> list[CacheFigures]:
    """Every rank's ``figures`` on every rank (a collective where torch.distributed is up)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return figures
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, figures)
    return [f for part in parts for f in part]


def table(figures: list[CacheFigures]) -> str:
    """A markdown table in the style of lm-eval's results table, one row per rank and a total."""
    from pytablewriter import MarkdownTableWriter  # lm-eval's own table writer

    rows = list(figures)
    if len(rows) > 1:
        rows.append(
            CacheFigures(
                rank=-1,
                prompt_tokens=sum(f.prompt_tokens for f in figures),
                cached_tokens=sum(f.cached_tokens for f in figures),
                seconds=max(f.seconds for f in figures),
            )
        )
    writer = MarkdownTableWriter()
    writer.headers = ["radixkv", "prompt tokens", "served from cache", "computed", "hit rate", "time (s)"]
    writer.value_matrix = [
        [
            "all ranks" if f.rank < 0 else f"rank {f.rank}",
            f.prompt_tokens,
            f.cached_tokens,
            f.computed_tokens,
            f"{f.hit_rate:.3f}",
            f"{f.seconds:.1f}",
        ]
        for f in rows
    ]
    return writer.dumps()
