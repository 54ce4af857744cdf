"""What hostile clients found in request fields (issue 44, items 5-11): each test failed before
its fix. Request validation goes through Flask's test client; what lives in the process (its
log, its start-up) is checked against a real `python -m demo`."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

import jsonschema
import pytest
import requests
import torch

from demo import log_format
from demo.api import media_fetch, structured
from demo.api.app import create_app
from demo.config import Config
from demo.engine import constrained
from demo.engine.constrained import GrammarHook, json_lark
from demo.errors import ApiError
from tests.demo_checkpoints import save_agent_model
from tests.demo_process import ROOT, start_demo


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


# -- item 8: deep JSON in the template's inputs ------------------------------------------------


def nest(levels: int):
    """``levels`` objects and arrays inside one another, alternating: {"a": [{"a": [...]}]}."""
    value: object = 1
    for i in range(levels):
        value = [value] if i % 2 else {"a": value}
    return value


def called(name: str, arguments: str) -> list[dict]:
    """A conversation with an assistant turn that called ``name`` with ``arguments`` (text)."""
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"chat_template_kwargs": {"x": nest(900)}}, "chat_template_kwargs"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nest(900)}}]}, "tools"),
        (
            {"messages": called("f", json.dumps({"k": nest(900)}))},
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": called("f", '{"a": ' + "[" * 4000 + "]" * 4000 + "}")},
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
    ids=["chat_template_kwargs", "tools", "arguments", "arguments-past-json-recursion"],
)
def test_deep_json_is_a_400_naming_the_field(client, body, param):
    """These were 500s: RecursionError in demo/model/chat_tokens.py (the 4,000-level arguments:
    in json.loads)."""
    err = error(chat(client, tools=[TOOL], **body) if "tools" not in body else chat(client, **body))
    assert err["param"] == param and "more than 128 levels deep" in err["message"], err


def test_json_at_the_depth_bound_is_served(client):
    """128 levels in all (the body and its fields count): the walks over it stay within the
    recursion limit, through the chat template's rendering."""
    assert chat(client, chat_template_kwargs={"x": nest(126)}).status_code == 200
    assert error(chat(client, chat_template_kwargs={"x": nest(127)}))["param"] == "chat_template_kwargs"
    assert chat(client, tools=[TOOL], messages=called("f", json.dumps({"k": nest(127)}))).status_code == 200
    too_deep = called("f", json.dumps({"k": nest(128)}))
    assert error(chat(client, tools=[TOOL], messages=too_deep))["param"].endswith("function.arguments")


# -- item 5: Responses errors name the Responses fields ----------------------------------------

FC = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
LOOKAHEAD = {"type": "string", "pattern": "(?=a)"}  # llguidance cannot enforce a look-ahead


@pytest.mark.parametrize(
    "body,param",
    [
        *(({"max_output_tokens": v}, "max_output_tokens") for v in (0, -1, 10**12, 1.5, "8", True)),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": LOOKAHEAD}}}, "text.format.schema"),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
        ({"tools": [{"type": "function", "name": "f", "description": 3}]}, "tools[0].description"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": "\ud800"}, "input"),
        ({"input": [{"role": "user", "content": "x"}, {"role": "user", "content": "\ud800"}]}, "input[1].content"),
        ({"input": [{"role": "user", "content": "x"}, {**FC, "arguments": "{bad"}]}, "input[1].arguments"),
        ({"input": [{"role": "user", "content": "x"}, FC, {**FC, "call_id": "c2", "arguments": "[]"}]}, "input[2].arguments"),
        ({"input": [{"role": "user", "content": "x"}, FC, {**FC, "call_id": "\ud800"}]}, "input[2].call_id"),
        ({"input": [{"role": "user", "content": "x"}, {**FC, "arguments": json.dumps({"k": nest(200)})}]}, "input[1].arguments"),
        ({"input": [{"role": "user", "content": "x"}, FC, {"type": "function_call_output", "call_id": "c1", "output": "\ud800"}]}, "input[2].output"),
        ({"input": [{"type": "reasoning"}]}, "input"),
        ({"instructions": "\ud800"}, "instructions"),
    ],
)  # fmt: skip
def test_responses_errors_name_the_responses_fields(client, body, param):
    """They named chat's fields (max_tokens, response_format, tools[0].function.name, messages[1]),
    which a Responses client never sent."""
    err = error(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, **body}))
    assert err["param"] == param, err
    for chat_name in ("max_tokens", "response_format", ".function.", "messages"):
        assert chat_name not in err["message"], err
    if param == "max_output_tokens":
        assert "'max_output_tokens'" in err["message"], err


# -- item 7: schemas no finite value matches ---------------------------------------------------

SELF_REF = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
ROUND = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"],
         "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}  # fmt: skip
TREE = {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                        "additionalProperties": False}}, "$ref": "#/$defs/n"}  # fmt: skip


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [SELF_REF, ROUND], ids=["a-a", "x-a-b-a"])
def test_ref_cycles_with_no_way_out_are_refused_up_front(client, schema):
    """They answered 200, finish_reason "stop", with content "" or '{"x": '."""
    err = error(chat(client, max_tokens=20, response_format=json_schema(schema)))
    assert err["code"] == "unsupported_schema" and err["param"] == "response_format.json_schema.schema", err
    assert "#/$defs/a" in err["message"], err
    text_format = {"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}}
    err = error(
        client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 20, "text": text_format})
    )
    assert err["code"] == "unsupported_schema" and err["param"] == "text.format.schema", err


def test_a_recursive_schema_with_a_way_out_is_served(client):
    r = chat(client, max_tokens=12, response_format=json_schema(TREE))
    assert r.status_code == 200, r.get_json()
    choice = r.get_json()["choices"][0]
    if choice["finish_reason"] == "stop":  # complete: a tree (maybe {}), valid
        jsonschema.validate(json.loads(choice["message"]["content"]), TREE)
    else:
        assert choice["message"]["content"].startswith("{"), choice


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_with_no_way_on_is_never_a_finished_reply(client, monkeypatch, stream):
    """At depth: with the up-front check off, the matcher stops in an error state after the
    text it could write; the grammar hook used to take any stopped matcher for a complete
    grammar (EOS only), and the reply was a 200 with finish_reason "stop"."""
    monkeypatch.setattr(structured, "_check_refs", lambda schema: None, raising=False)
    for schema in (SELF_REF, ROUND):
        r = chat(client, max_tokens=20, response_format=json_schema(schema), stream=stream)
        if not stream:
            assert error(r)["code"] == "unsupported_schema"
            continue
        events = [
            json.loads(line[6:])
            for line in r.get_data(as_text=True).splitlines()
            if line.startswith("data: {")
        ]
        assert events[-1].get("error", {}).get("code") == "unsupported_schema", events[-3:]
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", ())), events


def test_a_refused_token_fails_the_row_instead_of_unmasking_it(app):
    """The matcher refusing the row's token used to leave the row unmasked for the rest of its
    reply (logged), answered as if it matched."""
    grammars = app.extensions["radixkv"]["engine"].runner.grammars
    hook = GrammarHook(grammars.start(grammars.check(json_lark({"type": "object"}))), prompt_length=2)
    scores = torch.zeros(grammars.vocab_size)
    brace = int(hook(torch.tensor([5, 6]), scores.clone()).argmax())  # '{' is the only token allowed
    not_brace = (brace + 1) % grammars.vocab_size
    with pytest.raises(constrained.GrammarError, match="refused"):
        hook(torch.tensor([5, 6, not_brace]), scores.clone())


def test_a_stopped_matcher_in_error_is_not_complete(app):
    grammars = app.extensions["radixkv"]["engine"].runner.grammars
    hook = GrammarHook(grammars.start(grammars.check(json_lark(SELF_REF))), prompt_length=2)
    with pytest.raises(ApiError) as e:
        hook(torch.tensor([5, 6]), torch.zeros(grammars.vocab_size))
    assert e.value.status == 400 and e.value.code == "unsupported_schema"


# -- against a real server process: its log (item 10) and $ref chains (item 7) ----------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(URL, log path) of a `python -m demo --model builtin-tiny`."""
    log = tmp_path_factory.mktemp("served") / "server.log"
    proc, url = start_demo(["--model", "builtin-tiny", "--port", "0"], str(log))
    yield url, log
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


FORGED = "1999-01-01 00:00:00,000 INFO demo.api.conventions: FORGED"


def raw_get(url: str, target: bytes) -> bytes:
    """The status line of a GET of ``target`` sent byte for byte (no client re-quoting)."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return s.makefile("rb").readline()


def test_a_request_path_cannot_forge_a_log_line(served):
    """The access log wrote the decoded path raw: CR, LF (a whole fake line) and ESC."""
    url, log = served
    target = b"/v1/x%0d%0a" + FORGED.replace(" ", "%20").encode() + b"%1b[31m%e2%80%a8end"
    assert b" 404 " in raw_get(url, target)
    written = log.read_bytes()
    assert b"\x1b" not in written and b"\r" not in written and "\u2028".encode() not in written
    lines = written.decode().splitlines()
    assert not any(line.startswith("1999-01-01") for line in lines), lines[-3:]
    assert any(f"GET /v1/x\\r\\n{FORGED}\\x1b[31m\\u2028end 404 " in line for line in lines), lines[-3:]


def test_the_log_formatter_escapes_every_record(caplog):
    """Any record (args, message, exception text) from any logger: one line, no escapes."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(log_format.EscapingFormatter(log_format.FORMAT))
    logger = logging.getLogger("tests.hostile.log")
    logger.addHandler(handler)
    try:
        logger.warning("model %s, adapter %r", "m\r\nFAKE", "a\x9b31m\u202e")
        try:
            raise ValueError("bad\r\n" + FORGED + "\x1b[0m")
        except ValueError:
            logger.exception("failed for %s", "x\ny")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert "m\\r\\nFAKE" in text and "\\x9b31m\\u202e" in text and "x\\ny" in text
    assert not any(c in text for c in "\r\x1b\x9b\u202e")
    assert "Traceback (most recent call last):" in text  # a traceback keeps its lines
    assert not any(line.startswith("1999") for line in text.splitlines())


def ref_chain(links: int) -> dict:
    """A schema whose $defs refer one to the next ``links`` times, ending in a string."""
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(links)}
    return {"$defs": {**defs, f"a{links}": {"type": "string"}}, "$ref": "#/$defs/a0"}


def test_a_long_ref_chain_is_a_400_not_a_dead_server(served):
    """2,500 refs in a row (a 90 KB body) made llguidance's schema compiler overflow its stack:
    SIGSEGV, the whole server gone."""
    url, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": json_schema(ref_chain(2500))}  # fmt: skip
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_schema", r.text
    assert "levels deep" in r.json()["error"]["message"]
    assert requests.get(url + "/health", timeout=30).status_code == 200


def test_a_ref_chain_within_the_bound_is_served(client):
    assert chat(client, max_tokens=2, response_format=json_schema(ref_chain(400))).status_code == 200


def test_lone_surrogates_in_cache_salt_and_previous_response_id_are_400s(client):
    """They key the cache and cross to the engine process (msgpack refuses them: a 500 and, in a
    front end, a leaked request); refused by name like any other text."""
    assert error(chat(client, cache_salt="\ud800"))["param"] == "cache_salt"
    body = {"input": "hi", "max_output_tokens": 2, "previous_response_id": "resp_\ud800"}
    assert error(client.post("/v1/responses", json=body))["param"] == "previous_response_id"
