"""The demo's cache file: restore at start, admin save/restore/files, tenants across restarts.

A "restart" here is a new engine (new model object, new store) and a new app on the same
configuration; tests/test_demo_restart.py does the same with real processes and SIGTERM.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from demo.api.app import build_engine, create_app
from demo.config import Config

BLOCK = 16
ADMIN = {"X-Admin-Token": "adm"}
TABLE = "Here is a table:\n" + "\n".join(f"| Bruno {i} | {30 + i} | Lagos | pilot |" for i in range(30))


def doc() -> str:
    return f"[{uuid.uuid4().hex}]\n{TABLE}\n"


def engine():
    return build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 14))


def app(eng, **kw):
    kw.setdefault("admin_token", "adm")
    return create_app(Config(model="builtin-tiny", block_size=BLOCK, **kw), eng).test_client()


def chat(client, content, key=None, expect=200):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == expect, r.get_json()
    return r.get_json()


def cached(resp) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_admin_save_list_restore(tmp_path):
    eng = engine()
    c = app(eng, cache_dir=str(tmp_path))
    text = doc()
    first = chat(c, text + "Who is Bruno 3?")
    for r in (
        app(eng, admin_token=None).post("/v1/cache/save", json={"name": "a"}),
        c.post("/v1/cache/save", json={"name": "a"}, headers={"X-Admin-Token": "wrong"}),
    ):
        assert r.status_code in (401, 403)
    assert not list(tmp_path.iterdir())
    saved = c.post("/v1/cache/save", json={"name": "a"}, headers=ADMIN).get_json()
    assert saved["saved"] and saved["num_tokens"] > 0 and saved["path"] == str(tmp_path / "a.safetensors")
    listing = c.get("/v1/cache/files", headers=ADMIN).get_json()["data"]
    assert [(f["name"], f["bytes"]) for f in listing] == [("a.safetensors", saved["file_bytes"])]
    assert listing[0]["manifest"]["counts"]["tokens"] == saved["num_tokens"]
    assert "model_class" in listing[0]["manifest"]["identity"]
    eng.flush()
    restored = c.post("/v1/cache/restore", json={"name": "a.safetensors"}, headers=ADMIN).get_json()
    assert restored["restored_tokens"] == saved["num_tokens"] and restored["dropped_tokens"] == 0
    second = chat(c, text + "Who is Bruno 7?")
    assert cached(second) >= first["usage"]["prompt_tokens"] // BLOCK * BLOCK - 2 * BLOCK
    eng.check_invariants()


@pytest.mark.parametrize("name", ["../a", "a/b", "..", "a..b", ".hidden", "", "x" * 101, 5, "a\\b", "/etc/x"])
def test_bad_names_are_a_400(tmp_path, name):
    c = app(engine(), cache_dir=str(tmp_path))
    for path in ("/v1/cache/save", "/v1/cache/restore"):
        r = c.post(path, json={"name": name}, headers=ADMIN)
        assert r.status_code == 400 and r.get_json()["error"]["param"] == "name", r.get_json()
    assert not list(tmp_path.iterdir())


def test_restore_errors_name_the_problem_and_change_nothing(tmp_path):
    eng = engine()
    c = app(eng, cache_dir=str(tmp_path))
    assert c.post("/v1/cache/save", headers=ADMIN).status_code == 400  # no name and no --cache-file
    r = c.post("/v1/cache/restore", json={"name": "missing"}, headers=ADMIN)
    assert r.status_code == 404 and r.get_json()["error"]["code"] == "cache_file_not_found"
    text = doc()
    chat(c, text)
    c.post("/v1/cache/save", json={"name": "good"}, headers=ADMIN)
    data = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    before = eng.stats()
    r = c.post("/v1/cache/restore", json={"name": "cut"}, headers=ADMIN)
    assert r.status_code == 422 and r.get_json()["error"]["code"] == "cache_file_corrupt"
    other = app(
        build_engine(Config(model="builtin-tiny", block_size=8, cache_tokens=1 << 14)),
        cache_dir=str(tmp_path),
    )
    r = other.post("/v1/cache/restore", json={"name": "good"}, headers=ADMIN)
    assert r.status_code == 409 and "block_size" in r.get_json()["error"]["message"]
    assert eng.stats() == before
    eng.check_invariants()
    listing = {f["name"]: f for f in c.get("/v1/cache/files", headers=ADMIN).get_json()["data"]}
    assert "safetensors" in listing["cut.safetensors"]["error"] and "manifest" in listing["good.safetensors"]
    assert cached(chat(c, text)) > 0  # still serving what it had


def test_a_corrupt_cache_file_is_moved_aside_and_the_server_starts_cold(tmp_path):
    path = tmp_path / "kv.safetensors"
    path.write_bytes(b"")  # the empty file that crashed llama.cpp's server
    c = app(engine(), cache_file=str(path))
    assert not path.exists()
    assert [p.name[: len("kv.safetensors.rejected-")] for p in tmp_path.iterdir()] == [
        "kv.safetensors.rejected-"
    ]
    text = doc()
    assert cached(chat(c, text)) == 0
    assert cached(chat(c, text)) > 0


def test_tenants_keep_their_prefixes_across_a_restart_and_only_theirs(tmp_path):
    path = str(tmp_path / "kv.safetensors")
    conf = {"cache_file": path, "api_keys": ("key-a", "key-b")}
    first_engine = engine()
    c = app(first_engine, **conf)
    text = doc()
    answer = chat(c, text + "Who is Bruno 1?", key="key-a")
    c.application.extensions["radixkv"]["cache_files"].save_at_exit()
    assert oct(os.stat(path + ".secret").st_mode & 0o777) == "0o600"
    restarted = app(engine(), **conf)  # restores the file at start
    hit = chat(restarted, text + "Who is Bruno 2?", key="key-a")
    assert cached(hit) >= answer["usage"]["prompt_tokens"] // BLOCK * BLOCK - 2 * BLOCK
    assert cached(chat(restarted, text + "Who is Bruno 2?", key="key-b")) == 0
    # Other keys on the same file and secret never reach key-a's prefixes.
    others = app(engine(), cache_file=path, api_keys=("key-c",))
    assert cached(chat(others, text + "Who is Bruno 2?", key="key-c")) == 0
    chat(others, text, key="key-a", expect=401)
    # Without the secret file, the same key maps to another namespace: no hits.
    os.rename(path + ".secret", path + ".secret.old")
    fresh_secret = app(engine(), **conf)
    assert cached(chat(fresh_secret, text + "Who is Bruno 2?", key="key-a")) == 0


def test_periodic_saves(tmp_path):
    import time

    path = tmp_path / "kv.safetensors"
    c = app(engine(), cache_file=str(path), cache_save_every=0.2)
    chat(c, doc())
    deadline = time.monotonic() + 20
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    files = c.application.extensions["radixkv"]["cache_files"]
    files.stop()
    assert path.exists()
    from radixkv.persist.cache_file import read_manifest

    assert read_manifest(path)["counts"]["tokens"] > 0


def test_secret_file_with_loose_permissions_is_tightened(tmp_path):
    from demo.api.auth import load_or_create_secret

    p = tmp_path / "s"
    first = load_or_create_secret(str(p))
    os.chmod(p, 0o644)
    assert load_or_create_secret(str(p)) == first
    assert oct(os.stat(p).st_mode & 0o777) == "0o600"
    p.write_text("not hex")
    with pytest.raises(ValueError, match="hex secret"):
        load_or_create_secret(str(p))


def test_a_secret_file_another_server_is_writing_is_waited_for(tmp_path, monkeypatch):
    """Two servers starting at once on one --tenant-secret-file: the second finds the file the
    first created with O_EXCL still empty, and reads it once written (not a 'no secret' error);
    a file that stays empty is an error after EMPTY_WAIT_S."""
    import threading

    from demo.api import auth

    p = tmp_path / "s"
    p.touch(mode=0o600)  # created, not yet written
    secret = os.urandom(32)
    writer = threading.Timer(0.2, lambda: p.write_text(secret.hex() + "\n"))
    writer.start()
    try:
        assert auth.load_or_create_secret(str(p)) == secret
    finally:
        writer.cancel()
    empty = tmp_path / "empty"
    empty.touch(mode=0o600)
    monkeypatch.setattr(auth, "EMPTY_WAIT_S", 0.1)
    with pytest.raises(ValueError, match="hex secret"):
        auth.load_or_create_secret(str(empty))


def test_cache_flags_and_environment():
    from demo.config import from_args

    env = {"RADIXKV_CACHE_FILE": "/tmp/kv.safetensors", "RADIXKV_CACHE_SAVE_EVERY": "30"}
    config = from_args(["--cache-dir", "/tmp/caches"], env)
    assert (config.cache_file, config.cache_dir, config.cache_save_every) == (
        "/tmp/kv.safetensors",
        "/tmp/caches",
        30.0,
    )
    assert from_args(["--cache-file", "/a", "--tenant-secret-file", "/s"], {}).tenant_secret_file == "/s"
    for argv in (["--cache-save-every", "10"], ["--cache-file", "/a", "--cache-save-every", "0"]):
        with pytest.raises(ValueError, match="cache_save_every"):
            from_args(argv, {})


def test_a_restart_with_task_prompts_restores_a_full_pool_whole(tmp_path):
    """At start the task prompts are pinned before --cache-file is restored, and the file holds
    them too (they were cached when it was saved). Blocks the store already holds need no free
    room: a file saved from a full pool comes back whole, nothing dropped."""
    prompt = "You are the support desk of Example Corp. " + " ".join(f"Rule {i}: be kind." for i in range(12))
    kw = {
        "cache_file": str(tmp_path / "kv.safetensors"),
        "task_prompts_json": json.dumps([{"task_id": "support", "prompt": prompt}]),
    }

    def small_engine():
        return build_engine(Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=64 * BLOCK))

    eng = small_engine()
    c = app(eng, **kw)
    pinned = eng.stats()["task_pinned_blocks"]
    assert 0 < pinned < 32
    for i in range(12):  # more than the pool holds
        body = {"messages": [{"role": "user", "content": f"case {i}: " + "word " * 60}], "max_tokens": 2}
        assert c.post("/v1/chat/completions", json={**body, "task_id": "support"}).status_code == 200
    saved = c.post("/v1/cache/save", json={}, headers=ADMIN).get_json()
    assert saved["num_blocks"] == eng.stats()["cached_blocks"]
    assert saved["num_blocks"] > 64 - pinned  # fits beside the pins only if they need no room again

    eng2 = small_engine()
    c2 = app(eng2, **kw)  # pins, then restores the file
    stats = eng2.stats()
    assert stats["task_pinned_blocks"] == pinned
    assert stats["cached_blocks"] == saved["num_blocks"], stats
    again = c2.post("/v1/cache/restore", json={}, headers=ADMIN).get_json()
    assert again["dropped_blocks"] == 0 and again["duplicate_tokens"] == saved["num_tokens"], again
    eng2.check_invariants()


def test_metrics_name_the_cache_file_endpoints(tmp_path):
    """Errors of /v1/cache/save|restore|files are counted under their own endpoint label, as
    /v1/cache/flush's are, not lumped with unknown paths under "other"."""
    c = app(engine(), cache_dir=str(tmp_path))
    assert c.post("/v1/cache/save", json={"name": "a"}).status_code == 401
    assert c.post("/v1/cache/restore", json={"name": "missing"}, headers=ADMIN).status_code == 404
    assert c.get("/v1/cache/files", headers={"X-Admin-Token": "wrong"}).status_code == 401
    text = c.get("/metrics").get_data(as_text=True)
    for endpoint, status in (("save", 401), ("restore", 404), ("files", 401)):
        assert f'radixkv_requests_total{{endpoint="{endpoint}",status="{status}"}} 1' in text, text
    assert 'endpoint="other"' not in text


def test_a_bad_tenant_secret_file_stops_the_server_with_a_message_not_a_traceback(
    tmp_path, capsys, monkeypatch
):
    import demo.__main__ as demo_main

    monkeypatch.setattr("demo.api.server.serve_forever", lambda *a, **k: pytest.fail("the server started"))
    bad = tmp_path / "bad.secret"
    bad.write_text("not hex\n")
    with pytest.raises(SystemExit):
        demo_main.main(["--model", "builtin-tiny", "--api-keys", "k", "--tenant-secret-file", str(bad)])
    err = capsys.readouterr().err
    assert f"tenant secret file {bad} does not hold a hex secret" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory) -> str:
    """A tiny Qwen3.5 (Gated DeltaNet + attention layers) saved as a checkpoint with a tokenizer
    (word i <-> id i): the demo serves it as any local --model directory."""
    from tests.hf_models import tokenizer
    from tests.hybrid_models import build_hybrid

    path = str(tmp_path_factory.mktemp("qwen3_5_text"))
    build_hybrid("qwen3_5_text").save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def test_a_hybrid_model_restarts_on_its_cache_file_with_its_snapshots(tmp_path, hybrid_checkpoint):
    """The demo's restart path for a model with recurrent layers: the shutdown save writes the
    snapshots, the next server's start-up restore brings them back (a new model object from the
    same checkpoint, a new store), and the third question reads the whole document (the junction
    snapshot the second one took), answering as a cold server does. tests/test_demo_restart.py
    does this with real processes for the built-in model; here the two servers share a process,
    as each start would cost ~10 s of imports and model load."""
    from tests.hybrid_restart import DOC, QUESTIONS

    def words(ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)

    def ask(client, question: list[int]) -> dict:
        body = {"prompt": words(DOC + question), "max_tokens": 6, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.get_json()
        return r.get_json()

    conf = {"model": hybrid_checkpoint, "block_size": 4, "cache_tokens": 4096}
    path = str(tmp_path / "kv.safetensors")
    first = create_app(Config(**conf, cache_file=path), build_engine(Config(**conf))).test_client()
    assert [cached(ask(first, q)) for q in QUESTIONS[:2]] == [0, 0]  # the default interval: 256
    first.application.extensions["radixkv"]["cache_files"].save_at_exit()
    from radixkv.persist.cache_file import read_manifest

    manifest = read_manifest(path)
    assert manifest["version"] == 3 and manifest["counts"]["snapshots"] > 0 and manifest["layout"]["states"]
    restarted = create_app(Config(**conf, cache_file=path), build_engine(Config(**conf))).test_client()
    warm = ask(restarted, QUESTIONS[2])
    assert cached(warm) == len(DOC) // 4 * 4
    cold = ask(create_app(Config(**conf), build_engine(Config(**conf))).test_client(), QUESTIONS[2])
    assert cached(cold) == 0 and warm["choices"][0]["text"] == cold["choices"][0]["text"]


def test_a_hybrid_models_file_and_a_plain_ones_are_refused_by_each_other_naming_the_model(
    tmp_path, hybrid_checkpoint
):
    conf = {"model": hybrid_checkpoint, "block_size": BLOCK, "cache_tokens": 4096}
    hybrid = create_app(
        Config(**conf, cache_dir=str(tmp_path), admin_token="adm"), build_engine(Config(**conf))
    ).test_client()
    plain = app(engine(), cache_dir=str(tmp_path))
    r = hybrid.post("/v1/completions", json={"prompt": " ".join(["w5"] * 40), "max_tokens": 2})
    assert r.status_code == 200
    chat(plain, doc())
    for client, name in ((hybrid, "hybrid"), (plain, "plain")):
        assert client.post("/v1/cache/save", json={"name": name}, headers=ADMIN).status_code == 200
    for client, other in ((hybrid, "plain"), (plain, "hybrid")):
        r = client.post("/v1/cache/restore", json={"name": other}, headers=ADMIN)
        body = r.get_json()["error"]
        assert r.status_code == 409 and body["code"] == "cache_file_mismatch", body
        assert "--model" in body["message"] and "recurrent-state snapshots" in body["message"], body
