"""End to end: a real server process, SIGTERM, a restart on the same cache file.

The second question about the document must be served from the restored cache (cached_tokens
= the whole blocks the two prompts share) and answered exactly as a cold server answers it.
With API keys: the same key hits after the restart (the tenant secret persisted), another
key does not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import requests

from demo.api.app import build_engine, create_app
from demo.config import Config
from tests.demo_process import start_demo

BLOCK = 16
DOC = "A staff list:\n" + "\n".join(f"| Greta {i} | {20 + i} | Porto | nurse |" for i in range(24)) + "\n"
Q1, Q2 = "How old is Greta 4?", "Where does Greta 17 live?"
ARGS = ["--model", "builtin-tiny", "--block-size", str(BLOCK), "--cache-tokens", "16384", "--port", "0"]
ARGS += ["--cache-save-timeout", "20"]
ARGS += ["--api-keys", "key-a,key-b"]  # the tenant secret must survive the restart too


def start(cache_file: str, log_path: str) -> tuple[subprocess.Popen, str]:
    return start_demo([*ARGS, "--cache-file", cache_file], log_path)


def ask(url: str, content: str, key: str = "key-a") -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 6, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    r = requests.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()


def stop_in_time(proc: subprocess.Popen, log: str) -> None:
    """SIGTERM: the server saves and exits within --cache-save-timeout, saying what it saved."""
    started = time.monotonic()
    assert stop(proc) == 0, open(log).read()[-3000:]
    assert time.monotonic() - started < 20
    text = open(log).read()
    assert "shutdown save to" in text and "skipped 0 less recently used tokens" in text, text[-3000:]


def test_a_restarted_server_answers_from_the_saved_cache_like_a_cold_one(tmp_path):
    cache_file, log = str(tmp_path / "kv.safetensors"), str(tmp_path / "server.log")
    proc, url = start(cache_file, log)
    try:
        assert ask(url, DOC + Q1)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        stop_in_time(proc, log)
    assert os.path.getsize(cache_file) > 0, open(log).read()[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors", "kv.safetensors.secret", "server.log"]
    assert oct(os.stat(cache_file + ".secret").st_mode & 0o777) == "0o600"

    proc, url = start(cache_file, log)
    try:
        other_tenant = ask(url, DOC + Q2, key="key-b")
        warm = ask(url, DOC + Q2)
    finally:
        stop(proc)
    assert other_tenant["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "restored" in open(log).read()

    cold_engine = build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=16384))
    cold = create_app(Config(model="builtin-tiny"), cold_engine).test_client()
    r = cold.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": DOC + Q2}], "max_tokens": 6, "temperature": 0},
    ).get_json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == r["choices"][0]["message"]
    first = cold_engine.chat_ids([{"role": "user", "content": DOC + Q1}])
    second = cold_engine.chat_ids([{"role": "user", "content": DOC + Q2}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > 300  # the document
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == shared // BLOCK * BLOCK
