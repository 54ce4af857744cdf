"""The docs site builds with ``mkdocs build --strict`` (a broken link or anchor, or a page left
out of the navigation, fails), and the reference pages name every flag, environment variable,
endpoint and metric the code has, so they cannot fall behind it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"


def test_mkdocs_build_strict(tmp_path):
    if shutil.which("mkdocs") is None and not _importable("mkdocs"):
        pytest.skip("mkdocs is not installed (it is in the dev extra: pip install -e '.[dev]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (dev extra)")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "flags" / "index.html").is_file()


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_every_demo_and_batchrun_flag_and_environment_variable_is_in_the_reference():
    from demo.config import parser

    text = (REFERENCE / "flags.md").read_text()
    flags = [o for a in parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    source = (ROOT / "batchrun" / "runner.py").read_text()
    flags += re.findall(r'add_argument\(\s*"(--[a-z-]+)"', source)
    missing = [f for f in flags if f"`{f}" not in text]
    assert not missing, f"docs/reference/flags.md lacks {missing}"
    code = "".join(p.read_text() for d in ("radixkv", "hf_patch", "cuda_ext", "demo", "batchrun", "evalrun", "scripts")
                   for p in (ROOT / d).rglob("*.py"))  # fmt: skip
    variables = set(re.findall(r"RADIXKV_[A-Z_]+[A-Z]", code))
    assert variables and not sorted(v for v in variables if v not in text)


def test_every_endpoint_and_metric_is_in_the_reference():
    from demo.api.app import create_app
    from demo.config import Config

    app = create_app(Config(model="builtin-tiny", admin_token="t", lora_modules=()))
    endpoints = (REFERENCE / "endpoints.md").read_text()
    routes = {r.rule for r in app.url_map.iter_rules() if not r.rule.startswith("/static")}
    assert not sorted(r for r in routes if r != "/" and f"{r}`" not in endpoints)
    client = app.test_client()
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    names = set(re.findall(r"^# TYPE (\w+) ", client.get("/metrics").get_data(as_text=True), re.M))
    metrics = (REFERENCE / "metrics.md").read_text()
    assert names and not sorted(n for n in names if f"`{n}`" not in metrics)
