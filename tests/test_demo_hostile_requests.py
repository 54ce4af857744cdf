"""What hostile clients found in request fields (issue 44, items 5-11): each test failed before
its fix. Request validation goes through Flask's test client; what lives in the process (its
log, its start-up) is checked against a real `python -m demo`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from demo.api import media_fetch
from demo.api.app import create_app
from demo.config import Config
from tests.demo_checkpoints import save_agent_model
from tests.demo_process import ROOT


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = save_agent_model(tmp_path_factory.mktemp("agent") / "agent-tiny")
    return create_app(Config(model=path))


@pytest.fixture(scope="module")
def client(app):
    return app.test_client()


def chat(client, **body):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, **body}
    return client.post("/v1/chat/completions", json=body)


def error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.get_data(as_text=True)[:2000]
    return r.get_json()["error"]


# -- item 11: int() of client digits ----------------------------------------------------------


@pytest.mark.parametrize("key", ["1" * 5000, "9" * 4301, "²", "1" * 19], ids=["5000", "4301", "sup2", "19"])
def test_logit_bias_keys_past_int_limits_are_400s(client, key):
    err = error(chat(client, logit_bias={key: 1}))
    assert err["param"] == "logit_bias" and len(err["message"]) < 200, err


def test_logit_bias_key_with_leading_zeros_is_its_token(client):
    assert chat(client, logit_bias={"0" * 5000 + "7": 1}).status_code == 200


class _OneAnswer:
    """A loopback HTTP server answering one GET with ``head`` (status line and headers) and
    ``body``."""

    def __init__(self, head: bytes, body: bytes):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, args=(head, body), daemon=True).start()

    def _serve(self, head: bytes, body: bytes) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(head + b"\r\n" + body)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    "length,outcome",
    [(b"9" * 5000, "too large"), (b"\xb2", "body"), (b"1" * 19, "too large"), (b"5", "body")],
    ids=["5000", "sup2", "19", "5"],
)
def test_a_remote_content_length_is_read_as_digits_only(length, outcome):
    """A media host's Content-Length: 5,000 digits (int() raises) or "²" (isdigit() says yes,
    int() refuses) failed the fetch with int()'s ValueError text, where http.client itself
    reads such a body to its end (here: to the byte limit)."""
    server = _OneAnswer(
        b"HTTP/1.1 200 OK\r\nContent-Length: " + length + b"\r\nConnection: close\r\n", b"hello"
    )
    try:
        if outcome == "too large":
            with pytest.raises(media_fetch.TooLarge):
                media_fetch.fetch("/x.png", "http", "127.0.0.1", server.port, time.monotonic() + 10, 1000)
        else:
            assert (
                media_fetch.fetch("/x.png", "http", "127.0.0.1", server.port, time.monotonic() + 10, 1000)
                == b"hello"
            )
    finally:
        server.close()


# -- item 9: reserved names in --default-chat-template-kwargs ---------------------------------


@pytest.mark.parametrize("kwargs,named", [('{"messages": []}', "messages"), ('{"add_generation_prompt": false}', "add_generation_prompt")])  # fmt: skip
def test_reserved_default_template_kwargs_refuse_to_start(kwargs, named):
    """The server used to start, then answer every chat request 400 blaming its messages."""
    args = [sys.executable, "-m", "demo", "--model", "builtin-tiny", "--port", "0"]
    proc = subprocess.Popen(
        [*args, "--default-chat-template-kwargs", kwargs], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        started = "serving on" in proc.stdout.readline()  # "" at exit; the line once it listens
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert not started and proc.wait() == 2, stderr[-2000:]
    assert "default_chat_template_kwargs" in stderr and named in stderr, stderr[-2000:]
    with pytest.raises(ValueError, match=named):
        Config(default_chat_template_kwargs=json.loads(kwargs))
    assert Config(default_chat_template_kwargs={"enable_thinking": False})  # a template variable: fine
