"""Every example in README.md and the docs' guides that is marked runnable runs as pasted.

A fenced ``python`` or ``bash`` block directly under a line ``<!-- test: run -->`` is run, in
file order, in one scratch folder (so the quickstart's ``save-builtin`` folder serves the
examples after it), each in its own process with the repository's examples/ linked in, offline
and under a time bound; a block fails the test when it exits non-zero. Python blocks run as
``python -c``, shell blocks with ``bash -euo pipefail``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- test: run -->"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)
# README first: its quickstart writes the model folder the guides' examples use.
FILES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
TIMEOUT = 180  # seconds for one block


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block right after a MARK line (blank lines allowed between)."""
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() == MARK:
            if match.group(1) not in ("python", "bash"):
                raise ValueError(f"a runnable block must be python or bash, got {match.group(1)!r}")
            blocks.append((match.group(1), match.group(2)))
    return blocks


def test_the_marker_finds_marked_blocks_only():
    text = (
        f"intro\n\n{MARK}\n```python\nprint(1)\n```\n\n```bash\nexit 1\n```\n{MARK}\n```bash\necho 2\n```\n"
    )
    assert runnable_blocks(text) == [("python", "print(1)\n"), ("bash", "echo 2\n")]


def test_readme_and_guide_examples_run(tmp_path):
    for module in ("lm_eval", "peft"):  # the examples use the eval extra and the demo's peft
        pytest.importorskip(module, reason=f"the examples need {module} (pip install -e '.[dev]')")
    examples = [
        (name, lang, code) for name in FILES for lang, code in runnable_blocks((ROOT / name).read_text())
    ]
    assert sum(name == "README.md" for name, _, _ in examples) >= 8, (
        "the README's runnable examples went missing"
    )
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    path = os.environ.get("PYTHONPATH", "")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / ".datasets"),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],  # `python` = this one
    }
    for name, lang, code in examples:
        command = (
            [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
        )
        started = time.monotonic()
        proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        took = time.monotonic() - started
        print(f"{name}: {lang} block, {took:.1f} s")
        if proc.returncode != 0:
            pytest.fail(
                f"{name}: this {lang} example failed ({proc.returncode}):\n{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            )
