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
    # The README is outside the site, so mkdocs does not check its links into docs/: check each
    # page and anchor against the built site.
    links = re.findall(r"\]\(docs/([^)#]+)(?:#([^)]+))?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 10
    for page, anchor in links:
        html = (
            tmp_path
            / "site"
            / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        )
        assert html.is_file(), f"README.md links docs/{page}, which the site lacks"
        assert not anchor or f'id="{anchor}"' in html.read_text(), (
            f"README.md links docs/{page}#{anchor}: no such anchor"
        )


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


CODE_DIRS = ("radixkv", "hf_patch", "cuda_ext", "demo", "batchrun", "evalrun", "trlrun", "scripts")


def _code() -> dict[Path, str]:
    return {p: p.read_text() for d in CODE_DIRS for p in sorted((ROOT / d).rglob("*.py"))}


def test_every_flag_and_environment_variable_is_in_the_reference():
    """The demo's parser, and every ``add_argument("--...")`` of any command in the code (batchrun,
    ``python -m radixkv.sidecar``, ``demo save-builtin``, ...), and every RADIXKV_* variable."""
    from demo.config import parser

    text = (REFERENCE / "flags.md").read_text()
    flags = [o for a in parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    code = _code()
    sources = {p.relative_to(ROOT).as_posix(): t for p, t in code.items() if "add_argument(" in t}
    assert {"batchrun/runner.py", "radixkv/sidecar/__main__.py"} <= set(sources), sorted(sources)
    for source in sources.values():
        flags += re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', source)
    assert {"--prefill-chunk", "--socket", "--host-bytes", "--routing"} <= set(flags)
    missing = sorted({f for f in flags if f"`{f}" not in text})
    assert not missing, f"docs/reference/flags.md lacks {missing}"
    variables = set(re.findall(r"RADIXKV_[A-Z_]+[A-Z]", "".join(code.values())))
    assert variables and not sorted(v for v in variables if v not in text)


def test_every_sidecar_metric_is_in_the_reference(tmp_path):
    """What ``python -m radixkv.sidecar --l2 file:DIR --metrics-port P`` exports, built in process."""
    from radixkv.l2 import open_l2
    from radixkv.sidecar.l2_writer import L2Writer
    from radixkv.sidecar.metrics import prometheus_text
    from radixkv.sidecar.state import Sidecar

    l2 = open_l2(f"file:{tmp_path}")
    writer = L2Writer(l2)
    try:
        state = Sidecar(1 << 20, l2=l2, l2_writer=writer.put)
        with state.lock:
            stats = state.stats()
        stats.update(writer.stats())
    finally:
        writer.close()
        l2.close()
    names = set(re.findall(r"^# TYPE (\w+) ", prometheus_text(stats), re.M))
    metrics = (REFERENCE / "metrics.md").read_text()
    assert {"radixkv_sidecar_hit_tokens_total", "radixkv_sidecar_l2_hits_total"} <= names
    assert not sorted(n for n in names if f"`{n}`" not in metrics)


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
