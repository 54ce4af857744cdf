"""``python -m evalrun [lm-eval's arguments]``: lm-eval's own command line, model type
``radixkv`` registered (``--model hf`` and every other type still work, for A/B runs), and the
cache's figures (evalrun.figures) printed after lm-eval's results table.

Every rank runs this; the figures are gathered from all ranks and printed by rank 0.
"""

from __future__ import annotations

import sys

import torch

from evalrun import figures
from evalrun.model import RadixLM  # noqa: F401  (registers --model radixkv)


def main(argv: list[str] | None = None) -> int:
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
        gathered = figures.gather(figures.runs())
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if gathered and (not distributed or torch.distributed.get_rank() == 0):
            print(figures.table(gathered), flush=True)
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0
