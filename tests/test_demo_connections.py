"""Issue 17: one client address cannot take every connection, and what waitress refuses itself
(an oversized body, an absurd Content-Length) comes back in the API's JSON error shape.

Against the real server (waitress, demo.api.server). Another client address is 127.0.0.2: Linux
routes all of 127.0.0.0/8 to the loopback interface.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from demo.api.app import build_engine, create_app
from demo.api.server import Limits, serving
from demo.config import Config, from_args


@pytest.fixture(scope="module")
def app():
    engine = build_engine(Config(model="builtin-tiny", cache_tokens=4096))
    return create_app(Config(model="builtin-tiny"), engine)


def raw(url: str, request: bytes, source: str = "127.0.0.1") -> tuple[int, dict, dict]:
    """Send ``request`` bytes, read the whole reply: (status, headers, JSON body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30, source_address=(source, 0)) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(body)


def test_an_oversized_body_or_content_length_is_a_json_413(app):
    with serving(app) as url:
        big = requests.post(url + "/v1/chat/completions", data=b"x" * (10 << 20),
                            headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
        assert big.status_code == 413 and big.headers["Content-Type"] == "application/json"
        assert "request body too large" in big.json()["error"]["message"]
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        status, headers, body = raw(url, head + b"Content-Length: 100000000000000000000\r\n\r\n{}")
        assert status == 413 and headers["content-type"] == "application/json"
        assert body["error"]["type"] == "invalid_request_error"
        # a body over the app's own (smaller) limit: the app's JSON 413, as before
        mid = requests.post(url + "/v1/chat/completions", data=b"x" * (2 << 20), timeout=60)
        assert mid.status_code == 413 and mid.json()["error"]["message"].startswith(
            "request body larger than"
        )
        # malformed requests waitress refuses are JSON too
        status, headers, body = raw(url, b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
        assert status == 400 and headers["content-type"] == "application/json" and "error" in body


def test_1500_idle_sockets_from_one_address_leave_room_for_another(app):
    """Before: 1,279 idle connections from one address made the server stop accepting, and
    another client waited for its connect timeout. Now that address holds at most its cap (half
    of the connections by default); the rest are answered with a JSON 429 and closed."""
    limits = Limits(connections=256)
    assert limits.address_cap == 128
    idle: list[socket.socket] = []
    with serving(app, limits=limits) as url:
        host, port = url.removeprefix("http://").split(":")
        try:
            for _ in range(1500):
                idle.append(socket.create_connection((host, int(port)), timeout=10))
            # the server reads the ones over the cap a 429 and closes them
            deadline, refused = time.monotonic() + 30, []
            while time.monotonic() < deadline:
                refused = [s for s in idle if _closed_with_429(s)]
                if len(refused) >= 1500 - 128:
                    break
                time.sleep(0.2)
            assert len(refused) == 1500 - 128
            t0 = time.monotonic()
            status, _, body = raw(
                url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "127.0.0.2"
            )
            assert status == 200 and body == {"status": "ok"}
            assert time.monotonic() - t0 < 5  # served at once, not after a connect timeout
            # the first address is refused while it holds its cap, served once it lets go
            over = raw(url, b"")  # read what the server says before sending anything
            assert over[0] == 429 and over[2]["error"]["code"] == "too_many_connections"
            for s in idle:
                s.close()
            idle.clear()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")[0] == 200:
                        break
                except OSError:
                    pass
                time.sleep(0.2)
            else:
                pytest.fail("the address was still refused after closing its connections")
        finally:
            for s in idle:
                s.close()


def _closed_with_429(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        data = s.recv(4096, socket.MSG_PEEK)
    except BlockingIOError:
        return False
    finally:
        s.setblocking(True)
    return data.startswith(b"HTTP/1.1 429 ")


def test_the_cap_is_a_flag_and_zero_turns_it_off():
    assert from_args(["--connections-per-address", "16"], {}).connections_per_address == 16
    assert from_args([], {"RADIXKV_CONNECTIONS_PER_ADDRESS": "0"}).connections_per_address == 0
    assert Limits(connections=256, per_address=0).address_cap == 0
    assert Limits.for_engine(32, 8, 16).address_cap == 16
    with pytest.raises(ValueError, match="connections_per_address must be >= 0"):
        Config(connections_per_address=-1)


def _idle(host: str, port: int, source: str, n: int) -> list[socket.socket]:
    return [socket.create_connection((host, port), timeout=10, source_address=(source, 0)) for _ in range(n)]


def test_two_addresses_holding_their_caps_leave_room_for_a_third(app):
    """Issue 28: two addresses each holding their cap (half of the connections) took every slot,
    and a third waited for the idle timeout. Near the limit the oldest idle connections give way."""
    limits = Limits(connections=64, idle_timeout=120)
    assert limits.address_cap == 32
    held: list[socket.socket] = []
    with serving(app, limits=limits) as url:
        host, port = url.removeprefix("http://").split(":")
        try:
            held += _idle(host, int(port), "127.0.0.1", 32)
            held += _idle(host, int(port), "127.0.0.2", 32)
            time.sleep(0.5)  # accepted by the loop
            status, _, body = raw(
                url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "127.0.0.3"
            )
            assert status == 200 and body == {"status": "ok"}  # not after the 120 s idle timeout
            closed = sum(1 for s in held if _closed(s))
            assert closed >= 1  # the oldest idle gave way
        finally:
            for s in held:
                s.close()


def _closed(s: socket.socket, wait: float = 0.0) -> bool:
    s.settimeout(wait or 0.01)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_connection_dripping_its_headers_is_closed_at_the_header_timeout(app):
    """A byte every 0.3 s keeps the idle timeout from ever firing; the header timeout does not
    care: a request not complete within it is closed."""
    limits = Limits(connections=64, idle_timeout=120, header_timeout=2)
    with serving(app, limits=limits) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\n")
            started, gone = time.monotonic(), False
            while time.monotonic() - started < 30:
                try:
                    s.sendall(b"X")
                except OSError:
                    gone = True
                    break
                if _closed(s, 0.3):
                    gone = True
                    break
            assert gone and time.monotonic() - started < 25
        # a keep-alive connection answered in time stays usable
        status, _, body = raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert status == 200
