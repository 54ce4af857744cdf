"""Models by Hub id, never touching the network: from_pretrained monkeypatched (to check what
is passed), and a real from_pretrained, offline, on a snapshot-shaped local Hub cache."""

from __future__ import annotations

import pytest
import transformers

from demo.__main__ import main as demo_main
from demo.api.app import build_engine, create_app
from demo.config import Config, from_args
from demo.model.loading import ModelNotFound, build_builtin

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture
def fake_hub(monkeypatch):
    """from_pretrained records its arguments and returns the built-in tiny model."""
    calls = []
    model, tokenizer = build_builtin("builtin-tiny")

    def fake(kind, obj):
        def from_pretrained(name, **kwargs):
            calls.append((kind, name, kwargs))
            return obj

        return from_pretrained

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fake("config", model.config))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake("tokenizer", tokenizer))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake("model", model))
    return calls


def test_a_hub_id_is_loaded_with_revision_and_no_remote_code(fake_hub):
    engine = build_engine(Config(model=HUB_ID, revision="v1.2", cache_tokens=4096))
    assert [(kind, name) for kind, name, _ in fake_hub] == [
        ("config", HUB_ID),  # read first: a vision-language checkpoint loads with its processor
        ("tokenizer", HUB_ID),
        ("model", HUB_ID),
    ]
    for _, _, kwargs in fake_hub:
        assert kwargs["revision"] == "v1.2" and kwargs["trust_remote_code"] is False
        assert "local_files_only" not in kwargs and "device_map" not in kwargs
    client = create_app(Config(model=HUB_ID), engine).test_client()
    assert client.get("/v1/models").get_json()["data"][0]["id"] == HUB_ID  # the full id, as vLLM
    body = {"model": HUB_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_device_map_and_trust_remote_code_are_passed_through(fake_hub):
    build_engine(Config(model=HUB_ID, device_map="auto", trust_remote_code=True, cache_tokens=4096))
    _, (_, _, tok_kwargs), (_, _, model_kwargs) = fake_hub
    assert tok_kwargs["trust_remote_code"] is True and "device_map" not in tok_kwargs
    assert model_kwargs["device_map"] == "auto" and model_kwargs["trust_remote_code"] is True


def test_an_unknown_id_is_a_clear_error(monkeypatch, capsys):
    def missing(name, **kwargs):  # what transformers raises for a repository it cannot find
        raise OSError(f"{name} is not a local folder and is not a valid model identifier")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", missing)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", missing)
    with pytest.raises(ModelNotFound, match="nobody/none-such.*Hugging Face Hub"):
        build_engine(Config(model="nobody/none-such"))
    with pytest.raises(SystemExit) as exit_:  # python -m demo: a usage error, not a traceback
        demo_main(["--model", "nobody/none-such", "--port", "0"])
    assert exit_.value.code == 2
    assert "nobody/none-such" in capsys.readouterr().err


def test_flags_and_environment():
    c = from_args(
        ["--model", HUB_ID, "--revision", "abc", "--trust-remote-code", "--device-map", "auto"], env={}
    )
    assert (c.revision, c.trust_remote_code, c.device_map) == ("abc", True, "auto")
    c = from_args([], env={"RADIXKV_MODEL": HUB_ID, "RADIXKV_DEVICE_MAP": "balanced"})
    assert c.trust_remote_code is False and c.device_map == "balanced" and c.revision is None
    with pytest.raises(ValueError, match="device_map"):
        Config(device_map="auto")  # the built-in model
    with pytest.raises(ValueError, match="device_map"):
        Config(model=HUB_ID, device_map="everywhere")


def test_from_a_snapshot_shaped_hub_cache_offline(tmp_path, monkeypatch):
    """The real from_pretrained path (no monkeypatch of it) on a local Hub cache, offline."""
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someone--tiny-chat"
    model, tokenizer = build_builtin("builtin-tiny")
    model.save_pretrained(repo / "snapshots" / commit)
    tokenizer.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    for revision in (None, commit):
        engine = build_engine(Config(model="someone/tiny-chat", revision=revision, cache_tokens=4096))
        assert engine.tokenizer.get_vocab() == tokenizer.get_vocab()
        assert all(a.equal(b) for a, b in zip(engine.model.parameters(), model.parameters()))
    with pytest.raises(ModelNotFound, match="someone/tiny-chat"):
        build_engine(Config(model="someone/tiny-chat", revision="f" * 40))
