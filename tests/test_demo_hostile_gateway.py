"""Hostile clients behind a gateway (issue 28, items 6 and 8): with --trusted-proxies the failed-auth
throttle keys on the client the gateway names (X-Forwarded-For), never on the gateway itself, and
the gateway's connections are not capped per address; behind the real sglang_router, a flood of
bad keys leaves other tenants served; the gateway metadata routes need a key when keys are set."""

from __future__ import annotations

import socket

import pytest
import requests

from demo.api.app import build_engine, create_app
from demo.api.proxies import TrustedProxies
from demo.api.server import Limits, serving
from demo.config import Config, from_args
from tests.test_demo_gateway import start_replica, start_router  # noqa: F401

KEYS = ("k1", "k2")


@pytest.fixture(scope="module")
def engine():
    return build_engine(Config(model="builtin-tiny", cache_tokens=4096))


def client(engine, **kw):
    return create_app(Config(model="builtin-tiny", api_keys=KEYS, **kw), engine).test_client()


def models(c, key: str, peer: str = "127.0.0.1", forwarded: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    if forwarded is not None:
        headers["X-Forwarded-For"] = forwarded
    return c.get("/v1/models", headers=headers, environ_base={"REMOTE_ADDR": peer}).status_code


def test_behind_a_trusted_proxy_the_throttle_keys_on_the_forwarded_client(engine):
    c = client(engine, trusted_proxies=("127.0.0.1", "10.0.0.0/8"))
    # one client guessing through the gateway: throttled itself...
    assert [models(c, "bad", forwarded="203.0.113.7") for _ in range(11)][-2:] == [401, 429]
    assert models(c, "k1", forwarded="203.0.113.7") == 429  # even with a right key, for a while
    # ...never another client of the gateway, nor the gateway's own requests
    assert models(c, "k1", forwarded="203.0.113.8") == 200
    assert models(c, "k2", peer="10.1.2.3", forwarded="198.51.100.1, 203.0.113.9") == 200
    assert models(c, "k1") == 200
    # the gateway's own requests naming no client are never throttled as one client
    assert set(models(c, "bad") for _ in range(30)) == {401}
    assert models(c, "k1") == 200
    # a client that writes its own X-Forwarded-For gets the address the gateway appended
    spoofed = [models(c, "bad", forwarded=f"192.0.2.{i}, 203.0.113.20") for i in range(11)]
    assert spoofed[-1] == 429
    # an untrusted peer's X-Forwarded-For is ignored: it is throttled as itself
    assert [models(c, "bad", peer="198.51.100.50", forwarded=f"192.0.2.{i}") for i in range(11)][-1] == 429
    assert models(c, "k1", peer="198.51.100.50", forwarded="192.0.2.99") == 429


def test_trusted_proxies_flag_and_its_errors():
    assert from_args(["--trusted-proxies", "127.0.0.1,10.0.0.0/8"], {}).trusted_proxies == (
        "127.0.0.1",
        "10.0.0.0/8",
    )
    assert from_args([], {"RADIXKV_TRUSTED_PROXIES": "::1"}).proxies.trusts("::1")
    with pytest.raises(ValueError, match="'gateway.local' is not an IP address"):
        Config(trusted_proxies=("gateway.local",))
    proxies = TrustedProxies.parse(["10.0.0.0/8"])
    assert proxies.client("10.0.0.1", None) is None and proxies.client("10.0.0.1", "10.0.0.2") is None
    assert proxies.client("::ffff:10.0.0.1", "203.0.113.1") == "203.0.113.1"
    assert TrustedProxies().client("10.0.0.1", "203.0.113.1") == "10.0.0.1"


def test_a_trusted_proxy_holds_more_connections_than_the_per_address_cap(engine):
    app = create_app(Config(model="builtin-tiny"), engine)
    limits = Limits(connections=64, per_address=2, trusted=TrustedProxies.parse(["127.0.0.1"]))
    with serving(app, limits=limits) as url:
        host, port = url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(6)]
        try:
            r = requests.get(url + "/health", timeout=10)  # a 7th from the gateway's address
            assert r.status_code == 200
        finally:
            for s in held:
                s.close()


def test_gateway_metadata_needs_a_key_when_keys_are_set(engine):
    c = client(engine)
    for route in ("/model_info", "/server_info", "/get_model_info", "/get_server_info", "/get_load"):
        r = c.get(route)
        assert r.status_code == 401 and r.get_json()["error"]["code"] == "invalid_api_key", route
        assert c.get(route, headers={"Authorization": "Bearer k2"}).status_code == 200, route
    # a trusted gateway's own requests (registration, load polls) need none; its clients do
    gated = client(engine, trusted_proxies=("10.0.0.7",))
    assert gated.get("/get_load", environ_base={"REMOTE_ADDR": "10.0.0.7"}).status_code == 200
    through = gated.get(
        "/get_load", environ_base={"REMOTE_ADDR": "10.0.0.7"}, headers={"X-Forwarded-For": "1.2.3.4"}
    )
    assert through.status_code == 401
    open_server = create_app(Config(model="builtin-tiny"), engine).test_client()
    assert open_server.get("/get_load").status_code == 200  # no keys: open, as before


def test_bad_keys_through_sglang_router_leave_other_tenants_served(tmp_path):
    """sglang_router 0.3 forwards the client's Authorization, sends no X-Forwarded-For, and its
    circuit breaker counts every non-2xx answer (401s too): with the breaker off (as
    docs/security.md says for tenant keys checked by the replicas) and the router's address
    trusted, twelve bad-key requests are twelve 401s and tenant k1 is still answered."""
    replica, url = start_demo_keyed(str(tmp_path / "replica.log"))
    router = None
    try:
        router, gateway = start_router(
            [url], "round_robin", str(tmp_path / "router.log"), extra=["--disable-circuit-breaker"]
        )
        body = {"model": "builtin-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        bad = [
            requests.post(
                gateway + "/v1/chat/completions",
                json=body,
                headers={"Authorization": "Bearer bad"},
                timeout=60,
            ).status_code
            for _ in range(12)
        ]
        assert bad == [401] * 12, bad
        for key in KEYS:
            r = requests.post(
                gateway + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            assert r.status_code == 200, r.text

        # the replica process itself (waitress keeps a trusted peer's X-Forwarded-For): a client
        # the proxy names is throttled on its own, another one is not
        def direct(key: str, client: str) -> int:
            headers = {"Authorization": f"Bearer {key}", "X-Forwarded-For": client}
            return requests.get(url + "/v1/models", headers=headers, timeout=60).status_code

        assert [direct("bad", "203.0.113.7") for _ in range(11)][-1] == 429
        assert direct("k1", "203.0.113.7") == 429 and direct("k1", "203.0.113.8") == 200
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        replica.terminate()
        replica.wait(timeout=60)


def start_demo_keyed(log_path: str):
    from tests.demo_process import start_demo

    args = ["--model", "builtin-tiny", "--cache-tokens", "4096", "--port", "0", "--api-keys", ",".join(KEYS)]
    return start_demo([*args, "--trusted-proxies", "127.0.0.1"], log_path)
