"""Every example in README.md and the docs' guides that is marked runnable runs as pasted.

A fenced ``python`` or ``bash`` block directly under a line ``<!-- test: run -->`` is run, in
file order, in one scratch folder (so the quickstart's ``save-builtin`` folder serves the
examples after it, and the repository's examples/ is linked in), offline and under a time
bound; a block fails the test when it raises or exits non-zero. Shell blocks run with ``bash
-euo pipefail`` in their own process. Python blocks run in this process, each with fresh
globals as a script's (``__name__ == "__main__"``): the same code, without paying torch's and
transformers' import once per block (which made this test take minutes on a busy machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
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


@contextlib.contextmanager
def time_bound(seconds: int):
    """Raise TimeoutError in this (main) thread after ``seconds``."""

    def expired(signum, frame):
        raise TimeoutError(f"the example ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_the_marker_finds_marked_blocks_only():
    text = (
        f"intro\n\n{MARK}\n```python\nprint(1)\n```\n\n```bash\nexit 1\n```\n{MARK}\n```bash\necho 2\n```\n"
    )
    assert runnable_blocks(text) == [("python", "print(1)\n"), ("bash", "echo 2\n")]


def test_readme_and_guide_examples_run(tmp_path, monkeypatch):
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
    monkeypatch.chdir(tmp_path)  # python blocks read and write relative paths, as pasted
    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE"):
        monkeypatch.setenv(key, env[key])
    for name, lang, code in examples:
        started = time.monotonic()
        if lang == "python":
            with time_bound(TIMEOUT):
                try:
                    exec(compile(code, f"<{name} example>", "exec"), {"__name__": "__main__"})
                except Exception as e:
                    pytest.fail(f"{name}: this python example raised {type(e).__name__}: {e}\n{code}")
        else:
            command = ["bash", "-euo", "pipefail", "-c", code]
            proc = subprocess.run(
                command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT
            )
            if proc.returncode != 0:
                pytest.fail(
                    f"{name}: this bash example failed ({proc.returncode}):\n{code}\n"
                    f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
                )
        print(f"{name}: {lang} block, {time.monotonic() - started:.1f} s")
