"""Hostile shutdowns (issue 28, items 5 and 9), on a real server process: SIGTERM with eight streams
in flight still saves the cache within --cache-save-timeout (the requests are cut, not waited for)
and a server started on the file reads the prompts that were running; the server makes no
temporary directory (the gateway's tokenizer goes to the user's cache), so none outlives it."""

from __future__ import annotations

import os
import signal
import threading
import time

import requests

from demo.api.app import create_app
from demo.config import Config
from demo.model.loading import build_builtin
from tests.demo_process import start_demo

BLOCK = 16
ARGS = ["--model", "builtin-tiny", "--block-size", str(BLOCK), "--cache-tokens", "16384", "--port", "0"]


def prompt(i: int) -> str:
    return f"Stream {i} reads a list:\n" + "\n".join(f"| Item {i}-{k} | {k * 7 % 13} |" for k in range(12))


def test_sigterm_under_load_cuts_the_streams_and_saves_within_the_timeout(tmp_path, monkeypatch):
    """Also item 9: the tokenizer /model_info hands the gateway is saved into the user's cache,
    named for its content; the server makes no temporary file or directory at all, so none
    can outlive it, whether it ends through os._exit (SIGTERM) or a SIGKILL."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def temporaries() -> list[str]:  # torch's own compile cache aside
        return [f for f in os.listdir(tmp_path / "tmp") if not f.startswith("torchinductor_")]

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
        path = requests.get(url + "/model_info", timeout=30).json()["tokenizer_path"]
        assert path.startswith(str(tmp_path / "cache" / "radixkv" / "tokenizers")), path
        assert temporaries() == []  # nothing that an exit could leave behind
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
    assert temporaries() == []
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no partial copies
    text = "| Item 3-4 | 2 |"
    assert AutoTokenizer.from_pretrained(path)(text)["input_ids"] == tokenizer(text)["input_ids"]
    for t in threads:
        t.join(30)
    # A server started on the file reads the prompts of the streams that were running.
    config = Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=16384, cache_file=cache)
    client = create_app(config).test_client()
    for i in (0, 7):
        r = client.post("/v1/completions", json={"prompt": prompt(i), "max_tokens": 1, "temperature": 0})
        usage = r.get_json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - BLOCK, usage


def test_engine_shutdown_cuts_queued_and_running_requests_and_refuses_new_ones():
    import pytest

    from demo.api.app import build_engine
    from demo.engine.engine import Busy, Params
    from demo.errors import ApiError

    engine = build_engine(Config(model="builtin-tiny", cache_tokens=4096, max_batch_size=1, decode_chunk=0))
    no_eos = ((engine.tokenizer.eos_token_id, -100.0),)
    running = engine.submit(engine.text_ids(prompt(1)), Params(700, temperature=0.0, logit_bias=no_eos))
    queued = engine.submit(engine.text_ids(prompt(2)), Params(700, temperature=0.0, logit_bias=no_eos))
    deadline = time.monotonic() + 60
    while running.generated < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.shutdown(wait=30)
    assert running.finished.is_set() and running.generated < 700  # stopped at a step, not its end
    for gen in (running, queued):
        with pytest.raises(ApiError, match="shutting down") as e:
            gen.collect()
        assert e.value.status == 503
    assert queued.generated == 0
    with pytest.raises(Busy, match="shutting down"):
        engine.reserve()
