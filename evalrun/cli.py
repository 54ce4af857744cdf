"""``python -m evalrun [lm-eval's arguments]``: lm-eval's own command line, model type
``radixkv`` registered (``--model hf`` and every other type still work, for A/B runs), and the
cache's figures (evalrun.figures) printed after lm-eval's results table.

``--help`` prints what evalrun adds (HELP) before lm-eval's own help. Every rank runs this; the
figures are gathered from all ranks and printed by rank 0.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from evalrun import figures
from evalrun.model import RadixLM  # noqa: F401  (registers --model radixkv)

HELP = """\
python -m evalrun: lm-evaluation-harness with radixkv's prefix cache (docs/evaluation.md).

It adds the model type `radixkv`: lm-eval's HuggingFace backend (`--model hf`) whose forwards
read the prompt prefixes (few-shot preambles, a question shared by its choices) from a prefix
store and compute only the rest, with the same numbers as `--model hf`:

  python -m demo save-builtin ./tiny        # a local model, if you have none
  python -m evalrun --model radixkv --model_args pretrained=./tiny,dtype=float32 \\
      --include_path examples/eval --tasks radixkv_arith --batch_size 8
  torchrun --nproc_per_node 2 -m evalrun --model radixkv ...   # data parallel, a store per rank

--model_args of radixkv: every one of --model hf (pretrained, dtype, peft, max_length, ...) plus
  cache_tokens=N       store budget per rank, in tokens (default: 1 GiB of KV, or RADIXKV_CACHE_TOKENS)
  block_size=N         tokens per KV block, a power of two (default 16, or RADIXKV_BLOCK_SIZE)
  host_cache_bytes=N   a host-memory tier behind the device pool (default none)
  cache_file=PATH      restored at start when it exists, written after each request type that
                       cached something new (several ranks: NAME.rankR.EXT)
  split=affine|docs    how requests are split over ranks: by shared prefix (affine, default)
                       or lm-eval's own striding by document (docs)
After lm-eval's results table, a table of the cache's figures per rank (prompt tokens, served
from cache, computed, hit rate, time). Tips: few-shot with `fewshot_config: {sampler: first_n}`
(the same examples before every question: hit rate 0.89 vs 0.67 on examples/eval), and one
torch thread on a busy machine (OMP_NUM_THREADS=1).

lm-eval's own help follows.
"""


def _quiet_git_hash() -> str | None:
    """lm-eval's ``get_git_commit_hash`` without git's ``fatal: not a git repository`` on stderr
    outside a checkout: the same lookup (``git describe --always``, then the folder's .git)."""
    from lm_eval.loggers.utils import get_commit_from_path

    try:
        out = subprocess.run(
            ["git", "describe", "--always"], capture_output=True, check=True, text=True
        ).stdout.strip()
        return out or None
    except (subprocess.CalledProcessError, FileNotFoundError):
        return get_commit_from_path(os.getcwd())


def main(argv: list[str] | None = None) -> int:
    import lm_eval.evaluator
    from lm_eval.__main__ import cli_evaluate

    argv = sys.argv[1:] if argv is None else argv
    sys.argv = [sys.argv[0], *argv]
    if any(a in ("-h", "--help") for a in argv):
        print(HELP, flush=True)
    # lm-eval records the git hash of the working directory with each result; its own lookup
    # lets git print "fatal: not a git repository" anywhere outside a checkout.
    lm_eval.evaluator.get_git_commit_hash = _quiet_git_hash
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
