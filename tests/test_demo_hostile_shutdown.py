"""Hostile shutdowns (issue 28, items 5 and 9), on real server processes: SIGTERM with eight streams
in flight still saves the cache within --cache-save-timeout (the requests are cut, not waited for)
and a restart reads the prompts that were running; no temporary directory outlives the process,
however it ends."""

from __future__ import annotations

import os
import signal
import threading
import time

import requests

from demo.model.loading import build_builtin
from tests.demo_process import start_demo

BLOCK = 16
ARGS = ["--model", "builtin-tiny", "--block-size", str(BLOCK), "--cache-tokens", "16384", "--port", "0"]


def prompt(i: int) -> str:
    return f"Stream {i} reads a list:\n" + "\n".join(f"| Item {i}-{k} | {k * 7 % 13} |" for k in range(12))


def test_sigterm_under_load_cuts_the_streams_and_saves_within_the_timeout(tmp_path):
    _, tokenizer = build_builtin("builtin-tiny")
    no_eos = {str(tokenizer.eos_token_id): -100}  # the streams run to max_tokens unless cut
    cache, log = str(tmp_path / "cache.radixkv"), str(tmp_path / "server.log")
    args = [*ARGS, "--cache-file", cache, "--cache-save-timeout", "3"]
    proc, url = start_demo(args, log)
    first = [threading.Event() for _ in range(8)]

    def stream(i: int) -> None:
        body = {
            "prompt": prompt(i),
            "max_tokens": 700,
            "temperature": 0,
            "stream": True,
            "logit_bias": no_eos,
        }
        try:
            with requests.post(url + "/v1/completions", json=body, stream=True, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        first[i].set()
        except requests.RequestException:  # cut by the shutdown
            pass

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
    try:
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in first)  # eight streams generating
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    text = open(log).read()
    assert rc == 0, text[-3000:]
    assert took < 3 + 3, took  # within --cache-save-timeout (slack for a loaded machine)
    assert "shutdown save to" in text and os.path.exists(cache), text[-3000:]
    for t in threads:
        t.join(30)
    # The restart reads the prompts of the streams that were running.
    proc, url = start_demo([*ARGS, "--cache-file", cache], str(tmp_path / "restart.log"))
    try:
        for i in (0, 7):
            body = {"prompt": prompt(i), "max_tokens": 1, "temperature": 0}
            r = requests.post(url + "/v1/completions", json=body, timeout=120).json()
            usage = r["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - BLOCK, usage
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_no_tokenizer_directory_outlives_the_process_however_it_ends(tmp_path, monkeypatch):
    """/model_info saves a built-in model's tokenizer for the gateway: into the user's cache, named
    for its content, never a temporary directory that an exit through os._exit (SIGTERM) or a
    SIGKILL leaves behind; two processes share the one directory, which loads as the tokenizer."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the server's temporary files, if any
    (tmp_path / "tmp").mkdir()
    paths = set()
    for how in (signal.SIGTERM, signal.SIGKILL):
        proc, url = start_demo(ARGS, str(tmp_path / "server.log"))
        try:
            paths.add(requests.get(url + "/model_info", timeout=30).json()["tokenizer_path"])
            proc.send_signal(how)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        left = [
            f for f in os.listdir(tmp_path / "tmp") if not f.startswith("torchinductor_")
        ]  # torch's cache
        assert left == [], (how, left)
    (path,) = paths
    assert path.startswith(str(tmp_path / "cache" / "radixkv" / "tokenizers")), path
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no partial copies
    _, tokenizer = build_builtin("builtin-tiny")
    text = "| Item 3-4 | 2 |"
    assert AutoTokenizer.from_pretrained(path)(text)["input_ids"] == tokenizer(text)["input_ids"]
