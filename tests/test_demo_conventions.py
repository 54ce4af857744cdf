"""CORS (--allowed-origins) and X-Request-Id (demo.api.conventions) through Flask's test client."""

from __future__ import annotations

import logging
import re

import pytest

from demo.api.app import build_engine, create_app
from demo.config import Config, from_args

ORIGIN = "https://app.example:8443"


@pytest.fixture(scope="module")
def engine():
    return build_engine(Config(model="builtin-tiny", cache_tokens=1 << 14))


def client(engine, **kw):
    return create_app(Config(model="builtin-tiny", **kw), engine).test_client()


def chat(c, headers=None):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}
    return c.post("/v1/chat/completions", json=body, headers=headers or {})


def test_cors_off_by_default(engine):
    c = client(engine)
    r = chat(c, {"Origin": ORIGIN})
    assert r.status_code == 200
    assert "Access-Control-Allow-Origin" not in r.headers
    pre = c.options(
        "/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    )
    assert "Access-Control-Allow-Origin" not in pre.headers


def test_cors_allows_listed_origins_only(engine):
    c = client(engine, allowed_origins=(ORIGIN,), api_keys=("k1",))
    pre = c.options(
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-request-id, x-stainless-os",
        },
    )
    assert pre.status_code == 200  # a preflight carries no key: answered without one
    assert pre.headers["Access-Control-Allow-Origin"] == ORIGIN
    allowed = pre.headers["Access-Control-Allow-Headers"].lower()
    for h in ("authorization", "content-type", "x-request-id", "x-stainless-os"):
        assert h in allowed
    assert "Access-Control-Allow-Credentials" not in pre.headers
    r = chat(c, {"Origin": ORIGIN, "Authorization": "Bearer k1"})
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "x-request-id" in r.headers["Access-Control-Expose-Headers"].lower()
    other = chat(c, {"Origin": "https://evil.example", "Authorization": "Bearer k1"})
    assert "Access-Control-Allow-Origin" not in other.headers
    assert "Access-Control-Allow-Origin" not in c.get("/metrics", headers={"Origin": ORIGIN}).headers
    star = client(engine, allowed_origins=("*",))
    assert chat(star, {"Origin": "https://any.example"}).headers["Access-Control-Allow-Origin"] in (
        "*",
        "https://any.example",
    )


def test_allowed_origins_config():
    assert from_args(["--allowed-origins", ORIGIN, "http://localhost:3000"], env={}).allowed_origins == (
        ORIGIN,
        "http://localhost:3000",
    )
    assert from_args([], env={"RADIXKV_ALLOWED_ORIGINS": "*"}).allowed_origins == ("*",)
    with pytest.raises(ValueError, match="allowed_origins"):
        Config(allowed_origins=("app.example/path",))


def test_request_id_echoed_generated_and_logged(engine, caplog):
    c = client(engine)
    with caplog.at_level(logging.INFO, logger="demo.api.conventions"):
        r = chat(c, {"X-Request-Id": "trace-42.a:b"})
    assert r.headers["X-Request-Id"] == "trace-42.a:b"
    assert any(
        "POST /v1/chat/completions 200" in m and "request_id=trace-42.a:b" in m for m in caplog.messages
    )
    made = chat(c).headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert chat(c).headers["X-Request-Id"] != made
    for hostile in ("a b", "x" * 129, "id\tforged=1"):  # not safe in a log line: replaced
        rid = chat(c, {"X-Request-Id": hostile}).headers["X-Request-Id"]
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
    bad = c.post("/v1/chat/completions", data=b"{", headers={"X-Request-Id": "err-1"})
    assert bad.status_code == 400 and bad.headers["X-Request-Id"] == "err-1"
    assert c.get("/health").headers["X-Request-Id"]
