"""The first hour: a local model in one command, and start-up messages that say what happens
and name the fix (python -m demo save-builtin, batchrun/evalrun on --model builtin, evalrun
--help, task prompts too big for the pool, a missing or mismatched --cache-file)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from demo.__main__ import main as demo_main
from demo.api.app import build_engine, create_app
from demo.cache_files import CacheFileConflict
from demo.config import Config
from demo.model.loading import build_builtin
from demo.task_prompts import TaskPromptError

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
TABLE = "Here is a table:\n" + "\n".join(f"| Chen {i} | {20 + i} | Osaka | nurse |" for i in range(20))


def test_save_builtin_writes_a_checkpoint_that_from_pretrained_loads_and_the_cache_serves(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_patch

    folder = tmp_path / "tiny"
    assert demo_main(["save-builtin", str(folder), "--name", "builtin-tiny"]) == 0
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    reference, ref_tok = build_builtin("builtin-tiny")
    text = ref_tok.apply_chat_template(
        [{"role": "user", "content": TABLE}], tokenize=False, add_generation_prompt=True
    )
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": TABLE}], tokenize=False, add_generation_prompt=True
        )
        == text
    )
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(text, return_tensors="pt").input_ids.tolist()
    stock = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    cache = hf_patch.RadixCache(store=hf_patch.build_store(model, budget_tokens=4096))
    first = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                           past_key_values=cache)  # fmt: skip
    assert first.tolist() == stock.tolist() and cache.cached_tokens == [0]
    again = hf_patch.RadixCache(store=cache.store)
    second = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                            past_key_values=again)  # fmt: skip
    assert (
        second.tolist() == stock.tolist() and again.cached_tokens[0] >= ids.shape[1] // BLOCK * BLOCK - BLOCK
    )
    with pytest.raises(SystemExit) as exit_:  # never writes over a folder that holds something
        demo_main(["save-builtin", str(folder)])
    assert exit_.value.code == 2


@pytest.mark.parametrize("name", ["builtin", "builtin-tiny", "no/such-folder"])
def test_batchrun_on_no_folder_is_one_line_naming_save_builtin(name, capsys):
    from batchrun.runner import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", name, "--input", "in.jsonl", "--output", "out.jsonl"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "save-builtin" in err and "usage" not in err


def test_evalrun_help_says_what_it_adds_before_lm_evals_help_and_pretrained_builtin_is_refused(capsys):
    pytest.importorskip("lm_eval")
    from evalrun.cli import main
    from evalrun.model import RadixLM

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    ours = out.index("--model_args of radixkv")
    for arg in ("cache_tokens=", "block_size=", "host_cache_bytes=", "cache_file=", "split=", "first_n"):
        assert ours < out.index(arg) < out.index("lm-eval's own help follows") < out.index("usage:")
    task = re.search(r"--include_path (\S+) --tasks (\w+)", out)
    assert task and (ROOT / task.group(1) / f"{task.group(2)}.yaml").is_file()  # the example exists
    with pytest.raises(ValueError, match="save-builtin"):
        RadixLM(pretrained="builtin")


def test_evalrun_git_hash_lookup_is_quiet_outside_a_checkout(tmp_path, monkeypatch, capfd):
    pytest.importorskip("lm_eval")
    from evalrun.cli import _quiet_git_hash

    monkeypatch.chdir(tmp_path)
    assert _quiet_git_hash() is None
    assert "fatal" not in capfd.readouterr().err


def test_task_prompts_too_big_name_the_cache_tokens_that_fit_and_those_do(tmp_path):
    tasks = json.dumps([{"task_id": "desk", "prompt": "You are the desk. " + "Be brief. " * 60}])
    with pytest.raises(TaskPromptError) as err:
        create_app(Config(model="builtin-tiny", cache_tokens=64, task_prompts_json=tasks))
    fits = int(re.search(r"--cache-tokens (\d+)", str(err.value)).group(1))
    client = create_app(
        Config(model="builtin-tiny", cache_tokens=fits, task_prompts_json=tasks)
    ).test_client()
    body = {"task_id": "desk", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body).get_json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 160


def _saved_file(tmp_path) -> str:
    path = str(tmp_path / "kv.safetensors")
    eng = build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=4096))
    client = create_app(Config(model="builtin-tiny", block_size=BLOCK, cache_file=path), eng).test_client()
    client.post("/v1/completions", json={"prompt": TABLE, "max_tokens": 2})
    client.application.extensions["radixkv"]["cache_files"].save_at_exit()
    return path


def test_a_missing_cache_file_is_logged_and_written_at_shutdown(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="demo.cache_files"):
        path = _saved_file(tmp_path)
    assert (
        f"cache file {path} does not exist yet: starting cold; it will be written at shutdown" in caplog.text
    )
    with caplog.at_level(logging.INFO, logger="demo.cache_files"):
        create_app(Config(model="builtin-tiny", block_size=BLOCK, cache_file=path))
    assert f"restoring the cache from {path}" in caplog.text and "restored " in caplog.text


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"block_size": 8}, "--block-size: the file has blocks of 16 tokens, this server 8"),
        ({"model": "builtin"}, "of another configuration (sizes, layers or vocabulary) than --model builtin"),
        ({"dtype": "bfloat16"}, "--dtype: the file holds float32 KV, this server bfloat16"),
    ],
)
def test_a_cache_file_of_other_flags_names_the_flag_and_stays(tmp_path, flags, words, capsys):
    path = _saved_file(tmp_path)
    before = open(path, "rb").read()
    config = Config(**{"model": "builtin-tiny", "block_size": BLOCK, "cache_file": path, **flags})
    with pytest.raises(CacheFileConflict) as err:
        create_app(config)
    message = str(err.value)
    assert words in message and message.index(words) < message.index(
        "sha256" if "model" in flags else "Details"
    )
    assert open(path, "rb").read() == before and [p.name for p in tmp_path.iterdir()] == ["kv.safetensors"]
    if "block_size" in flags:  # the admin restore says the same words first (a 409)
        eng = build_engine(Config(model="builtin-tiny", block_size=8, cache_tokens=4096))
        admin = Config(model="builtin-tiny", block_size=8, admin_token="a", cache_dir=str(tmp_path))
        r = (
            create_app(admin, eng)
            .test_client()
            .post("/v1/cache/restore", json={"name": "kv"}, headers={"X-Admin-Token": "a"})
        )
        assert r.status_code == 409 and r.get_json()["error"]["message"].startswith(words)
    argv = ["--model", config.model, "--block-size", str(config.block_size), "--dtype", config.dtype]
    argv += ["--cache-file", path, "--port", "0"]
    with pytest.raises(SystemExit) as exit_:  # python -m demo: one line, no usage text
        demo_main(argv)
    err_text = capsys.readouterr().err
    assert exit_.value.code == 2 and words in err_text and "usage:" not in err_text


def test_a_cache_file_of_other_weights_is_moved_aside_and_the_server_starts_cold(tmp_path, caplog):
    path = _saved_file(tmp_path)
    eng = build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=4096))
    with torch.no_grad():
        eng.model.model.embed_tokens.weight.add_(0.5)  # another checkpoint of the same configuration
    with caplog.at_level(logging.WARNING, logger="demo.cache_files"):
        create_app(Config(model="builtin-tiny", block_size=BLOCK, cache_file=path), eng)
    assert "written for other weights than --model builtin-tiny" in caplog.text
    assert [p.name[:24] for p in tmp_path.iterdir()] == ["kv.safetensors.rejected-"]
