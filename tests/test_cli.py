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


def _saved_cache(path) -> tuple[str, dict]:
    import hf_patch
    from tests.hf_models import build, ids, tokens

    model = build("llama-sdpa")
    store = hf_patch.build_store(model, block_size=4, budget_tokens=256)
    cache = hf_patch.RadixCache(store=store, namespace="tenant-a")
    model.generate(ids(tokens(30, 1)), past_key_values=cache, max_new_tokens=2, do_sample=False)
    hf_patch.save_cache(model, path, store)
    return str(path), store.stats()


def test_cache_inspect_tells_what_a_file_holds_and_finds_a_flipped_byte(tmp_path, capsys):
    import json

    path, _ = _saved_cache(tmp_path / "c.radixkv")
    assert main(["cache", "inspect", path, "--verify"]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "2 x (2 KV heads, head dim 16/16, float32)" in out
    assert "28 tokens in 7 blocks" in out and "'tenant-a'" in out and "every tensor matches" in out
    assert main(["cache", "inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tokens"] == 28 and info["block_size"] == 4 and "verified" not in info
    data = bytearray(open(path, "rb").read())
    data[-5] ^= 0x40  # a bit of the last tensor's KV
    open(path, "wb").write(bytes(data))
    assert main(["cache", "inspect", path]) == 0  # the header alone is intact
    capsys.readouterr()
    assert main(["cache", "inspect", path, "--verify"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH in kv." in out and out.count("kv.") == 1, out  # the one tensor holding that byte
    open(path, "wb").write(bytes(data[:-100]))  # cut short
    assert main(["cache", "inspect", path]) == 2
    assert "truncated" in capsys.readouterr().err
    (tmp_path / "x").write_bytes(b"not a cache file at all")
    assert main(["cache", "inspect", str(tmp_path / "x")]) == 2
    assert "not a safetensors file" in capsys.readouterr().err
    assert main(["cache", "inspect", str(tmp_path / "missing")]) == 2
    assert "No such file" in capsys.readouterr().err
