"""The ``radixkv`` command (radixkv_cli): the installed script runs each program as a subcommand
with that program's own flags, and refuses what it does not know."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from radixkv_cli import COMMANDS, main


def _script() -> str:
    path = shutil.which("radixkv")
    if path is None:
        pytest.fail("no radixkv script on PATH: the package is not installed (scripts/install.sh does it)")
    return path


def test_the_installed_script_saves_the_builtin_model_and_shows_each_programs_flags(tmp_path):
    script = _script()
    saved = subprocess.run([script, "save-builtin", str(tmp_path / "tiny"), "--name", "builtin-tiny"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    assert (tmp_path / "tiny" / "config.json").is_file() and (tmp_path / "tiny" / "tokenizer.json").is_file()
    helps = subprocess.run([script, "sidecar", "--help"], capture_output=True, text=True, timeout=60)
    assert helps.returncode == 0 and "--host-bytes" in helps.stdout and "--kv-events-config" in helps.stdout


def test_subcommands_reach_their_programs_with_the_flags_that_follow(monkeypatch):
    seen = []
    for name in COMMANDS:
        run, form, what = COMMANDS[name]
        monkeypatch.setitem(
            COMMANDS, name, (lambda argv, name=name: seen.append((name, argv)) or 0, form, what)
        )
    assert main(["batch", "--model", "m", "--input", "in.jsonl"]) == 0
    assert main(["eval", "--tasks", "x"]) == 0
    assert seen == [("batch", ["--model", "m", "--input", "in.jsonl"]), ("eval", ["--tasks", "x"])]


def test_no_subcommand_or_an_unknown_one_is_refused_with_the_list(capsys):
    assert main([]) == 2
    assert "subcommands:" in capsys.readouterr().err
    assert main(["srve"]) == 2
    err = capsys.readouterr().err
    assert "no subcommand 'srve'" in err and all(name in err for name in COMMANDS)
    assert main(["--help"]) == 0 and "subcommands:" in capsys.readouterr().out


def test_the_module_form_runs_where_no_script_is_installed():
    proc = subprocess.run(
        [sys.executable, "-m", "radixkv_cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and all(name in proc.stdout for name in COMMANDS)
