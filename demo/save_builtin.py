"""``python -m demo save-builtin DIR``: the built-in model as a normal checkpoint folder.

The folder holds what ``save_pretrained`` writes for the model and its tokenizer (config,
safetensors weights, generation config, tokenizer files and the chat template), so
``AutoModelForCausalLM.from_pretrained(DIR)`` / ``AutoTokenizer.from_pretrained(DIR)``, batchrun,
evalrun (``pretrained=DIR``) and ``python -m demo --model DIR`` all load it offline. The
weights are the built-in model's seeded random ones: the same folder on every machine, and its
text is noise (it shows the cache at work, not language).
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from demo.model.loading import BUILTIN, build_builtin

log = logging.getLogger(__name__)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m demo save-builtin",
        description="Write the built-in model (random weights) with its tokenizer and chat template "
        "as a checkpoint folder that from_pretrained, batchrun, evalrun and the demo load offline.",
    )
    p.add_argument("directory", metavar="DIR", help="folder to write (created; must be empty if it exists)")
    p.add_argument("--name", choices=sorted(BUILTIN), default="builtin", help="which built-in model")
    return p


def save_builtin(directory: str, name: str = "builtin") -> str:
    """Write built-in model ``name`` and its tokenizer to ``directory``; returns the directory.

    Raises ValueError when ``directory`` is a file or a non-empty folder (nothing is written).
    """
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise ValueError(f"{directory} exists and is not an empty folder; give a new folder")
    model, tokenizer = build_builtin(name)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv: list[str]) -> int:
    from transformers.utils import logging as hf_logging

    args = parser().parse_args(argv)
    hf_logging.disable_progress_bar()  # a bar for writing one small file says nothing
    started = time.monotonic()
    try:
        save_builtin(args.directory, args.name)
    except ValueError as e:
        parser().error(str(e))
    log.info(
        "wrote the %s model (random weights) to %s in %.1f s: load it with --model %s "
        "(batchrun, demo) or pretrained=%s (evalrun)",
        args.name,
        args.directory,
        time.monotonic() - started,
        args.directory,
        args.directory,
    )
    return 0
