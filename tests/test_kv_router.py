"""examples/kv_router.py against two real demo replicas publishing KV events: a question about
a document goes to the replica whose events say it holds the document, a new document to the
replica holding less, and a flush empties the router's view of that replica."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import requests

from tests.demo_process import ROOT, start_demo

pytest.importorskip("zmq")
ADMIN = "t"


def start_router(replicas: list[tuple[str, dict]], log_path: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, os.path.join(ROOT, "examples", "kv_router.py"), "--port", "0",
           "--tokenizer", "builtin-tiny"]  # fmt: skip
    for url, events in replicas:
        cmd += ["--replica", f"{url}={events['endpoint']},{events['replay_endpoint']}"]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                                stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and select.select([proc.stdout], [], [], 120)[0]:
        line = proc.stdout.readline()
        if "serving on " in line:
            return proc, line.split("serving on ", 1)[1].strip()
        if not line:
            break
    proc.kill()
    raise AssertionError("the router did not start:\n" + open(log_path).read()[-3000:])


def document(d: int) -> str:
    return f"Document {d}.\n" + "\n".join(
        f"| Person {d}-{i} | {20 + i} | Town {(d * 7 + i) % 13} |" for i in range(12)
    )


def ask(url: str, d: int, q: int) -> tuple[int, int]:
    """(the replica that answered, its cached prompt tokens)."""
    body = {"model": "builtin-tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": document(d) + f"\nQ{q}: who is {q}?"}]}  # fmt: skip
    r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return int(r.headers["x-kv-router-replica"]), r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def state(url: str) -> list[dict]:
    return requests.get(url + "/kv_router/state", timeout=30).json()["replicas"]


def until(url: str, done) -> list[dict]:
    """The router's state once ``done(state)`` (events leave a replica within ~50 ms)."""
    for _ in range(400):
        s = state(url)
        if done(s):
            return s
        time.sleep(0.05)
    raise AssertionError(f"the router's state never got there: {s}")


def test_the_router_routes_by_what_the_events_say(tmp_path):
    events = [
        {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/r{i}.pub",
         "replay_endpoint": f"ipc://{tmp_path}/r{i}.replay"}
        for i in range(2)
    ]  # fmt: skip
    args = ["--model", "builtin-tiny", "--block-size", "16", "--port", "0", "--admin-token", ADMIN]
    procs = []
    try:
        for i, e in enumerate(events):
            procs.append(
                start_demo([*args, "--kv-events-config", json.dumps(e)], str(tmp_path / f"r{i}.log"))
            )
        router, url = start_router([(u, e) for (_, u), e in zip(procs, events)], str(tmp_path / "router.log"))
        procs.append((router, url))
        a, cached = ask(url, 0, 1)
        assert cached == 0
        held = until(url, lambda s: s[a]["blocks"] > 0)[a]["blocks"]
        # the same document again: the replica that holds it, the document read from its cache
        again, cached = ask(url, 0, 2)
        assert again == a and cached >= 16 * (held - 2)
        # a new document: nothing matches, so the replica holding fewer blocks takes it
        b, cached = ask(url, 1, 1)
        assert b != a and cached == 0
        until(url, lambda s: s[b]["blocks"] > 0)
        assert ask(url, 1, 2)[0] == b and ask(url, 0, 4)[0] == a
        # a flush on replica a is an AllBlocksCleared: the router forgets what a held
        r = requests.post(
            procs[a][1] + "/v1/cache/flush", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30
        )
        assert r.status_code == 200
        until(url, lambda s: s[a]["blocks"] == 0 and s[b]["blocks"] > 0)
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGINT if proc is not procs[-1][0] else signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
