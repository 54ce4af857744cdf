"""Data-parallel ranks for lm-eval: which rank computes which request, and how results meet.

lm-eval splits a data-parallel run by documents: rank r builds the requests of documents
r, r + W, r + 2W, ... of every task (``split=docs``, what ``--model hf`` does). Every rank
then holds every task's few-shot preamble, so each of W stores computes each preamble once.

``split=affine`` (the default) routes by prefix instead: every rank builds all requests (the
evaluator is told rank 0 of 1, as lm-eval's own tensor-parallel mode does), each request type
is routed by ``hf_patch.planning.routing.assign_ranks`` (requests sharing leading blocks go to one rank;
a group bigger than a rank's fair share is split where its members share least), each rank
computes its share with its own store, and ``all_gather_object`` gives every rank all results
in lm-eval's order. A preamble is then computed by one rank, or by as few as balance allows.
Only the process with LOCAL_RANK 0 reports (lm-eval's rule), so ``affine`` needs one node;
across nodes it falls back to ``docs``.

On a machine without CUDA, accelerate's ``Accelerator()`` (HFLM builds one) sees no
distributed setup and every torchrun process would run the whole evaluation alone:
``start_cpu_ranks`` initialises gloo ranks first (``PartialState(cpu=True)``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_patch.planning.routing import assign_ranks
from radixkv import PackedTokens

logger = logging.getLogger(__name__)

SPLITS = ("affine", "docs")


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


def start_cpu_ranks() -> None:
    """Make torchrun / accelerate-launched processes gloo ranks where CUDA is absent."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available():
        from accelerate import PartialState

        PartialState(cpu=True)


@dataclass(frozen=True)
class Ranks:
    """This process's rank among ``world`` and the split in force (``SPLITS``)."""

    rank: int = 0
    world: int = 1
    split: str = "affine"

    @classmethod
    def of(cls, accelerator, split: str) -> Ranks:
        """From HFLM's ``accelerator`` (set only when several processes run), with ``split``."""
        if accelerator is None or accelerator.num_processes <= 1:
            return cls(0, 1, split)
        world = accelerator.num_processes
        if split == "affine" and int(os.environ.get("LOCAL_WORLD_SIZE", world)) != world:
            logger.warning("evalrun: ranks on several nodes: split=affine falls back to split=docs")
            split = "docs"
        return cls(accelerator.process_index, world, split)

    @property
    def routed(self) -> bool:
        """Whether requests are routed here (affine over several ranks), not by lm-eval."""
        return self.world > 1 and self.split == "affine"

    @property
    def evaluator_view(self) -> tuple[int, int]:
        """``(rank, world_size)`` lm-eval's evaluator sees: the documents it hands this rank."""
        return (0, 1) if self.routed else (self.rank, self.world)

    def mine(self, prompts: Sequence[PackedTokens], block_size: int) -> list[int]:
        """Indices of the requests this rank computes (all of them unless routed). The same
        on every rank for the same ``prompts``: routing uses no seeds, clocks or hashes."""
        if not self.routed:
            return list(range(len(prompts)))
        ranks = assign_ranks(prompts, self.world, block_size, min_shared=block_size)
        return [i for i, r in enumerate(ranks) if r == self.rank]

    def gather(self, local: dict[int, Any], total: int) -> list:
        """All ``total`` results in request order, from each rank's ``{index: result}``.
        A collective when routed: every rank must call it for the same request list."""
        if self.routed:
            parts: list[dict | None] = [None] * self.world
            torch.distributed.all_gather_object(parts, local)
            local = {i: result for part in parts for i, result in part.items()}
        missing = total - len(local)
        if missing:
            raise RuntimeError(f"evalrun: {missing} of {total} requests got no result from any rank")
        return [local[i] for i in range(total)]
