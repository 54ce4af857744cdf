"""The Python example of docs/l2.md runs as written (docs that are tested cannot rot)."""

from __future__ import annotations

import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "l2.md"


def test_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks, "docs/l2.md lost its Python example"
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {})
    assert "'hits': 2" in capsys.readouterr().out
