"""Hostile adapter loads (issue 28, item 4), in a real server process whose Hub (HF_ENDPOINT) is a
loopback server that never answers: a Hub id that does not answer never freezes generation (the
load waits for its files without the model lock, and gives up after --lora-download-timeout
with a 504), and a path that looks local and does not exist is a 404 at once, the Hub never
asked."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
import requests

from tests.demo_process import start_demo

TOKEN = "admin-secret"


class _SilentHub(http.server.BaseHTTPRequestHandler):
    """Counts requests and holds each one unanswered until ``release`` is set."""

    asked = 0
    release = threading.Event()

    def do_GET(self):  # noqa: N802
        type(self).asked += 1
        type(self).release.wait(120)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture()
def hub():
    _SilentHub.asked = 0
    _SilentHub.release.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SilentHub)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    _SilentHub.release.set()
    server.shutdown()


def load(url: str, name: str, path: str):
    return requests.post(
        url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": path},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=120,
    )


def test_a_silent_hub_never_freezes_generation_and_a_missing_local_path_never_asks_it(
    hub, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_ENDPOINT", hub)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    args = ["--model", "builtin-tiny", "--port", "0", "--admin-token", TOKEN, "--lora-download-timeout", "8"]
    proc, url = start_demo(args, str(tmp_path / "server.log"))
    try:
        # "tests/" is a directory beside the server: "tests/no-such-adapter" is a mistyped path
        for path in ("tests/no-such-adapter", "/nonexistent/adapter", "./no-such-adapter", "~/nope"):
            r = load(url, "a", path)
            assert r.status_code == 404 and "no such directory" in r.json()["error"]["message"], r.text
        assert _SilentHub.asked == 0
        # A Hub id whose Hub never answers: the load waits, generation goes on meanwhile.
        loaded = {}
        loader = threading.Thread(target=lambda: loaded.update(r=load(url, "x", "someorg/some-adapter")))
        started = time.monotonic()
        loader.start()
        deadline = time.monotonic() + 30
        while _SilentHub.asked == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _SilentHub.asked >= 1  # the load is waiting for the Hub now
        r = requests.post(
            url + "/v1/completions",
            json={"prompt": "hello there", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert loader.is_alive()  # answered while the load still waits: it holds no model lock
        loader.join(60)
        took = time.monotonic() - started
        r = loaded["r"]
        assert r.status_code == 504 and "longer than 8 s" in r.json()["error"]["message"], r.text
        assert took < 30, took  # bounded by --lora-download-timeout, not by the client's retries
        models = requests.get(url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["builtin-tiny"]  # nothing half-loaded
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_which_paths_look_local(tmp_path, monkeypatch):
    from demo.model.adapter_files import looks_local

    monkeypatch.chdir(tmp_path)
    (tmp_path / "adapters").mkdir()
    for path in ("/abs/x", "./x", "../x", "~/x", "a/b/c", "a\\b", "adapters/sq1", ".hidden"):
        assert looks_local(path), path
    for path in ("someorg/some-adapter", "adapter-only-name"):
        assert not looks_local(path), path


class _Payload:
    """Unpickling it would create ``path``: what a malicious adapter_model.bin does."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_adapter_that_runs_code_is_refused_and_runs_nothing(tmp_path):
    """The weights are read off the lock now (peft's load_peft_weights): still weights-only."""
    import os
    import shutil

    import torch

    from demo.api.app import create_app
    from demo.config import Config
    from tests.demo_checkpoints import save_adapter

    good = save_adapter(tmp_path / "good", seed=1)
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copy(os.path.join(good, "adapter_config.json"), bad)
    marker = tmp_path / "pwned"
    torch.save({"x": _Payload(str(marker))}, bad / "adapter_model.bin")
    client = create_app(Config(model="builtin-tiny", cache_tokens=4096, admin_token=TOKEN)).test_client()
    r = client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "evil", "lora_path": str(bad)},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 400 and "cannot load adapter 'evil'" in r.get_json()["error"]["message"]
    assert not marker.exists()
    r = client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": "good", "lora_path": good},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200, r.get_json()


def test_a_name_being_loaded_cannot_be_loaded_twice(tmp_path, monkeypatch):
    """Files are read off the lock, so two loads of one name may overlap: the second is refused."""
    from demo.model import adapters as adapters_module
    from demo.model.adapters import AdapterError, Adapters, LoraModule
    from demo.model.loading import build_builtin
    from tests.demo_checkpoints import save_adapter

    good = save_adapter(tmp_path / "good", seed=2)
    model, _ = build_builtin("builtin-tiny")
    held, reading = threading.Event(), threading.Event()
    real = adapters_module.local_files

    def slow(path, timeout):
        reading.set()
        held.wait(30)
        return real(path, timeout)

    monkeypatch.setattr(adapters_module, "local_files", slow)
    adapters = Adapters(model, "builtin-tiny")
    first = threading.Thread(target=adapters.load, args=(LoraModule("x", good),))
    first.start()
    try:
        assert reading.wait(30)
        with pytest.raises(AdapterError, match="already been loaded"):
            adapters.load(LoraModule("x", good))
    finally:
        held.set()
        first.join(60)
    assert adapters.names() == ["x"]


def test_lora_download_timeout_flag_and_environment():
    from demo.config import Config, from_args

    assert from_args(["--lora-download-timeout", "5"], {}).lora_download_timeout == 5.0
    assert from_args([], {"RADIXKV_LORA_DOWNLOAD_TIMEOUT": "7.5"}).lora_download_timeout == 7.5
    with pytest.raises(ValueError, match="lora_download_timeout must be > 0"):
        Config(lora_download_timeout=0)
