"""LoRA adapters as model names (demo.model.adapters): every reply equals offline stock generate() of a
fresh model with the same adapter loaded by peft; adapters never read each other's KV nor the
base's (exact cached_tokens); rows of different adapters share one generate(); run-time loading
and unloading behind the admin token, with the unloaded adapter's KV dropped; cache files
restoring per adapter weights; the refusals."""

from __future__ import annotations

import json
import shutil
import threading
import uuid

import pytest
import torch

pytest.importorskip("peft")

from demo.__main__ import main as demo_main  # noqa: E402
from demo.api.app import build_engine, create_app  # noqa: E402
from demo.config import Config, from_args  # noqa: E402
from demo.engine import batching  # noqa: E402
from demo.engine.engine import Params  # noqa: E402
from demo.model.adapters import LoraModule, parse_lora_modules, peft_name  # noqa: E402
from hf_patch.keys.adapters import adapter_digests  # noqa: E402
from tests.demo_checkpoints import peft_reference, save_adapter, stock_reply  # noqa: E402

BLOCK = 16
TOKEN = "admin-secret"
TABLE = "\n".join(f"| Dara {i} | {30 + i} | Lima | pilot |" for i in range(10))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: save_adapter(root / name, seed) for name, seed in (("a", 1), ("b", 2), ("c", 3), ("d", 4))}


@pytest.fixture(scope="module")
def references(paths):
    """Offline stock models: the base and each adapter, each loaded fresh by peft."""
    return {None: peft_reference(None), **{name: peft_reference(path) for name, path in paths.items()}}


def config(paths, **kw) -> Config:
    modules = (LoraModule("a", paths["a"]), LoraModule("b", paths["b"]))
    return Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 14, lora_modules=modules, **kw)


@pytest.fixture(scope="module")
def engine(paths):
    return build_engine(config(paths))


@pytest.fixture(scope="module")
def client(engine, paths):
    return create_app(config(paths, admin_token=TOKEN), engine).test_client()


def question() -> str:
    return f"[{uuid.uuid4().hex}]\n{TABLE}\nwho is the oldest?"


def chat(client, model, content, max_tokens=6, status=200):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    r = client.post("/v1/chat/completions", json={**body, "temperature": 0})
    assert r.status_code == status, r.get_json()
    return r.get_json()


def stock(references, adapter, content, max_new=6) -> str:
    model, tokenizer = references[adapter]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return stock_reply(model, tokenizer, list(ids["input_ids"] if hasattr(ids, "keys") else ids), max_new)[1]


def full_hit(r) -> int:
    """cached_tokens of a prompt cached whole: its block floor, one token always recomputed."""
    n = r["usage"]["prompt_tokens"]
    return (n - 1) // BLOCK * BLOCK


def cached(r) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(r) -> str:
    return r["choices"][0]["message"]["content"]


def test_models_lists_the_base_and_each_adapter_as_vllm_does(client, paths):
    data = client.get("/v1/models").get_json()["data"]
    assert [m["id"] for m in data] == ["builtin-tiny", "a", "b"]
    assert data[0]["root"] == "builtin-tiny" and data[0]["parent"] is None
    assert [(m["root"], m["parent"]) for m in data[1:]] == [
        (paths["a"], "builtin-tiny"),
        (paths["b"], "builtin-tiny"),
    ]
    assert all(m["object"] == "model" and m["max_model_len"] == 1024 for m in data)


def test_each_adapter_answers_as_offline_peft_and_never_reads_another_adapters_kv(client, references):
    content = question()
    replies = {}
    for model in ("a", "b", "builtin-tiny"):  # the same prompt under each: never a hit
        r = chat(client, model, content)
        assert cached(r) == 0 and r["model"] == model
        replies[model] = text(r)
        assert replies[model] == stock(references, None if model == "builtin-tiny" else model, content)
    assert len(set(replies.values())) == 3  # the adapters do change the output
    for model in ("a", "b", "builtin-tiny"):  # a repeat under the same model hits its own KV
        r = chat(client, model, content)
        assert cached(r) == full_hit(r) > 0 and text(r) == replies[model]
    completion = client.post(
        "/v1/completions", json={"model": "b", "prompt": content, "max_tokens": 4, "temperature": 0}
    ).get_json()
    assert completion["model"] == "b"
    body = {
        "model": "a",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    }
    events = client.post("/v1/chat/completions", json={**body, "stream": True}).get_data(as_text=True)
    chunks = [json.loads(e[6:]) for e in events.split("\n\n") if e.startswith("data: {")]
    assert {c["model"] for c in chunks} == {"a"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == replies["a"]


def test_seeded_sampled_choices_under_an_adapter_equal_offline_peft(engine, references):
    """n sampled choices are n rows: their common prompt is computed once under the adapter
    (hf_patch.batch_share) and read from the store, and they sample as stock generate() does
    with the same seed."""
    content = question()
    prompt = engine.chat_ids([{"role": "user", "content": content}])
    params = Params(5, temperature=1.0, seed=7, n=2, adapter="a")
    hits = engine.store.stats()["hit_tokens"]
    result = engine.submit(prompt, params).collect()
    model, tokenizer = references["a"]
    torch.manual_seed(7)
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        generation_config=engine.runner.config(params),
    )
    stock_texts = [tokenizer.decode(row[len(prompt) :], skip_special_tokens=True) for row in out]
    assert [c.text for c in result.choices] == stock_texts
    assert result.cached_tokens == 0  # a new prompt: nothing was cached before this request
    assert engine.store.stats()["hit_tokens"] - hits == (len(prompt) - 1) // BLOCK * BLOCK


def test_rows_of_different_adapters_share_one_generate_call(engine, references, monkeypatch):
    calls, generate = [], engine.adapters.generate
    entered, release = threading.Event(), threading.Event()

    def spy(names, *args, **kwargs):
        if not release.is_set():  # hold the blocker until the requests under test are queued
            entered.set()
            assert release.wait(60)
        calls.append(list(names))
        return generate(names, *args, **kwargs)

    monkeypatch.setattr(engine.adapters, "generate", spy)
    sizes, run = [], batching.run_batch
    monkeypatch.setattr(
        batching, "run_batch", lambda e, gens, *a: (sizes.append(len(gens)), run(e, gens, *a))[1]
    )
    blocker = engine.submit(engine.text_ids("blocker"), Params(1, temperature=0.0))
    assert entered.wait(30)
    contents = {name: question() for name in ("a", "b", None)}
    gens = {
        name: engine.submit(
            engine.chat_ids([{"role": "user", "content": c}]), Params(6, temperature=0.0, adapter=name)
        )
        for name, c in contents.items()
    }
    release.set()
    blocker.collect()
    results = {name: gen.collect() for name, gen in gens.items()}
    assert sizes[-1] == 3 and sorted(map(str, calls[-1])) == ["None", "a", "b"]  # one call, three adapters
    for name, result in results.items():
        assert result.cached_tokens == 0 and result.text == stock(references, name, contents[name])


def test_an_unknown_model_is_a_404(client):
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = client.post(path, json={**body, "model": "nope"})
        assert r.status_code == 404 and r.get_json()["error"]["code"] == "model_not_found"
        assert r.get_json()["error"]["param"] == "model"


def admin(client, path, body, token=TOKEN):
    return client.post(path, json=body, headers={"Authorization": f"Bearer {token}"})


def test_load_and_unload_at_run_time_drop_the_adapters_kv(client, engine, paths, references):
    content = question()
    assert (
        admin(client, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": paths["c"]}).status_code == 200
    )
    assert "c" in [m["id"] for m in client.get("/v1/models").get_json()["data"]]
    r = chat(client, "c", content)
    assert cached(r) == 0 and text(r) == stock(references, "c", content)
    assert cached(chat(client, "c", content)) == full_hit(r)
    before = engine.store.stats()["cached_blocks"]
    r = admin(client, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert (
        r.status_code == 200 and r.get_data(as_text=True) == "Success: LoRA adapter 'c' removed successfully."
    )
    assert engine.store.stats()["cached_blocks"] < before  # its prefixes are gone from the store
    engine.check_invariants()
    chat(client, "c", content, status=404)
    # "c" again, with other weights: the old KV is neither there nor would it match.
    assert (
        admin(client, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": paths["d"]}).status_code == 200
    )
    r = chat(client, "c", content)
    assert cached(r) == 0 and text(r) == stock(references, "d", content)
    assert admin(client, "/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    # The base and the start-up adapters kept their prefixes through all this.
    assert engine.store.stats()["flushes"] == 0


def test_unloading_every_adapter_leaves_the_plain_model(paths, references):
    engine = build_engine(config(paths))
    for name in ("a", "b"):
        engine.adapters.unload(name)
    assert engine.adapters.peft is None and not any("lora" in n for n, _ in engine.model.named_modules())
    content = question()
    prompt = engine.chat_ids([{"role": "user", "content": content}])
    assert engine.submit(prompt, Params(6, temperature=0.0)).collect().text == stock(
        references, None, content
    )


def test_a_request_queued_for_an_adapter_unloaded_meanwhile_gets_a_404(paths):
    engine = build_engine(config(paths))
    with engine.exclusive():  # no generate() can start: the request waits
        gen = engine.submit(engine.text_ids("hello"), Params(2, temperature=0.0, adapter="b"))
        engine.adapters.unload("b")
    with pytest.raises(Exception) as e:
        gen.collect()
    assert getattr(e.value, "status", None) == 404 and e.value.code == "model_not_found"


def test_adapter_admin_endpoints_refuse_bad_requests(client, paths):
    cases = [
        ({"lora_name": "a", "lora_path": paths["a"]}, 400, "already been loaded"),
        ({"lora_name": "builtin-tiny", "lora_path": paths["c"]}, 400, "base model"),
        ({"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 404, "No adapter found"),
        ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path'"),
        ({"lora_name": "", "lora_path": paths["c"]}, 400, "Both"),
    ]
    for body, status, message in cases:
        r = admin(client, "/v1/load_lora_adapter", body)
        assert r.status_code == status and message in r.get_json()["error"]["message"], (body, r.get_json())
    r = admin(client, "/v1/unload_lora_adapter", {"lora_name": "zzz"})
    assert r.status_code == 404 and "cannot be found" in r.get_json()["error"]["message"]
    r = client.post("/v1/load_lora_adapter", data=b"{nope", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400
    assert [m["id"] for m in client.get("/v1/models").get_json()["data"]] == ["builtin-tiny", "a", "b"]


def test_a_broken_adapter_directory_is_refused_and_changes_nothing(client, paths, tmp_path, engine):
    broken = tmp_path / "broken"
    shutil.copytree(paths["a"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    modules = dict(engine.model.named_modules())
    r = admin(client, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(broken)})
    assert r.status_code == 400 and "cannot load adapter 'x'" in r.get_json()["error"]["message"]
    assert set(dict(engine.model.named_modules())) == set(modules)  # no half-loaded layers left
    assert peft_name("x") not in engine.adapters.peft.peft_config


def test_admin_endpoints_need_the_token_under_the_failed_auth_throttle(engine, paths):
    body = {"lora_name": "x", "lora_path": paths["c"]}
    no_token = create_app(config(paths), engine).test_client()
    assert no_token.post("/v1/load_lora_adapter", json=body).status_code == 403
    client = create_app(config(paths, admin_token=TOKEN), engine).test_client()
    for _ in range(10):
        assert admin(client, "/v1/load_lora_adapter", body, token="wrong").status_code == 401
    r = admin(client, "/v1/unload_lora_adapter", {"lora_name": "a"})  # even the right token, now
    assert r.status_code == 429 and r.headers["Retry-After"]
    assert "a" in engine.adapters.names()


def test_a_restart_restores_adapter_prefixes_only_for_the_same_weights(paths, references, tmp_path):
    adapters = tmp_path / "adapters"
    for name in ("a", "b"):
        shutil.copytree(paths[name], adapters / name)
    modules = (LoraModule("a", str(adapters / "a")), LoraModule("b", str(adapters / "b")))
    cfg = Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 14, lora_modules=modules,
                 cache_file=str(tmp_path / "kv.safetensors"))  # fmt: skip
    content = question()

    def serve():
        app = create_app(cfg, build_engine(cfg))
        return app, app.test_client()

    app, client = serve()
    first = {model: chat(client, model, content) for model in ("a", "b", "builtin-tiny")}
    app.extensions["radixkv"]["cache_files"].save_at_exit()
    app, client = serve()  # a restart with the same adapters: every prefix hits
    for model, r in first.items():
        again = chat(client, model, content)
        assert cached(again) == full_hit(r) and text(again) == text(r)
    app.extensions["radixkv"]["cache_files"].save_at_exit()
    shutil.rmtree(adapters / "b")
    shutil.copytree(paths["d"], adapters / "b")  # b's weights changed on disk
    app, client = serve()
    assert cached(chat(client, "a", content)) == full_hit(first["a"])
    assert cached(chat(client, "builtin-tiny", content)) == full_hit(first["builtin-tiny"])
    r = chat(client, "b", content)
    assert cached(r) == 0 and text(r) == stock(references, "d", content)


def test_lora_modules_flag_and_environment(paths, capsys):
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == (
        LoraModule("a", "/x"),
        LoraModule("b", "/y", "m"),
    )
    assert from_args([], env={"RADIXKV_LORA_MODULES": "a=/x b=/y"}).lora_modules == (
        LoraModule("a", "/x"),
        LoraModule("b", "/y"),
    )
    env = {"RADIXKV_LORA_MODULES": '[{"name": "a", "path": "/x"}, "b=/y"]'}
    assert [m.name for m in from_args([], env=env).lora_modules] == ["a", "b"]
    for bad in (["a="], ["{nope"], ['{"name": "a"}'], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="lora-modules"):
            parse_lora_modules(bad)
    with pytest.raises(SystemExit) as exit_:
        demo_main(["--model", "builtin-tiny", "--port", "0", "--lora-modules", "x=/nonexistent/adapter"])
    assert exit_.value.code == 2 and "No adapter found" in capsys.readouterr().err
    assert peft_name("a.b/c") != peft_name("a_b_c") and "." not in peft_name("a.b/c")


def test_task_prompts_are_pinned_as_the_base_models_kv(paths, references):
    """Pinned once at start, with every adapter disabled: base requests read them, adapter
    requests compute their own (and equal offline peft)."""
    rules = "You are the desk of Example Corp. " + " ".join(f"Rule {i}: be brief." for i in range(12))
    tasks = json.dumps([{"task_id": "desk", "prompt": rules}])
    cfg = config(paths, task_prompts_json=tasks)
    client = create_app(cfg, build_engine(cfg)).test_client()
    body = {
        "messages": [{"role": "user", "content": question()}],
        "max_tokens": 6,
        "temperature": 0,
        "task_id": "desk",
    }
    base = client.post("/v1/chat/completions", json=body).get_json()
    assert cached(base) >= 64  # the pinned system prompt, read on first use
    r = client.post("/v1/chat/completions", json={**body, "model": "a"}).get_json()
    system = [{"role": "system", "content": rules}, body["messages"][0]]
    model, tokenizer = references["a"]
    prompt = tokenizer.apply_chat_template(system, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert cached(r) == 0 and text(r) == stock_reply(model, tokenizer, prompt, 6)[1]


def test_an_adapter_that_does_not_fit_the_model_is_a_400_and_leaves_no_layers(paths, references, tmp_path):
    """Target modules the model lacks, or a module type LoRA cannot wrap (found after some layers
    were injected): a 400 (vLLM: BadRequestError), and the model exactly as before, whether it
    is the first adapter (PEFT's wrapper is being built) or one more; the base still answers as
    stock generate()."""
    bad = {}
    for name, targets in (("nowhere", ["nope_proj"]), ("norm", ["q_proj", "input_layernorm"])):
        shutil.copytree(paths["a"], tmp_path / name)
        config_file = tmp_path / name / "adapter_config.json"
        settings = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**settings, "target_modules": targets}))
        bad[name] = str(tmp_path / name)
    cfg = Config(model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 14, admin_token=TOKEN)
    engine = build_engine(cfg)
    client = create_app(cfg, engine).test_client()
    for first in (True, False):
        modules = set(dict(engine.model.named_modules()))
        for name, path in bad.items():
            r = admin(client, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            assert r.status_code == 400, r.get_json()
            assert f"cannot load adapter '{name}'" in r.get_json()["error"]["message"]
            assert set(dict(engine.model.named_modules())) == modules, (first, name)
        assert engine.adapters.names() == ([] if first else ["a"])
        content = question()
        r = chat(client, "builtin-tiny", content)
        assert cached(r) == 0 and text(r) == stock(references, None, content)
        if first:
            assert (
                admin(
                    client, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": paths["a"]}
                ).status_code
                == 200
            )
    assert engine.store.stats()["flushes"] == 0


def test_a_lora_modules_entry_that_does_not_fit_the_model_is_a_usage_error(paths, tmp_path, capsys):
    shutil.copytree(paths["a"], tmp_path / "x")
    settings = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
    (tmp_path / "x" / "adapter_config.json").write_text(json.dumps({**settings, "target_modules": ["nope"]}))
    with pytest.raises(SystemExit) as exit_:
        demo_main(["--model", "builtin-tiny", "--port", "0", "--lora-modules", f"x={tmp_path / 'x'}"])
    assert exit_.value.code == 2 and "cannot load adapter 'x'" in capsys.readouterr().err


def test_an_adapter_peft_cannot_mix_runs_in_batches_of_its_own(paths, references, tmp_path, monkeypatch):
    """A LoRA on parameters (``target_parameters``: PEFT's ParamWrapper, MoE experts' usual
    LoRA) is plain LoRA by type, but while it is loaded PEFT refuses every ``adapter_names``
    batch. Requests batched before it was loaded (the base and a plain LoRA) and its own
    each get a generate() call of their own, and every request its stock reply; once it is
    unloaded, the others share calls again."""
    from peft import LoraConfig, get_peft_model

    from tests.demo_checkpoints import build_builtin

    base, _ = build_builtin("builtin-tiny")
    torch.manual_seed(6)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=[],
        target_parameters=["mlp.gate_proj.weight"],
        init_lora_weights=False,
    )
    get_peft_model(base, lora).save_pretrained(str(tmp_path / "param"))
    engine = build_engine(config(paths))
    calls, generate = [], engine.adapters.generate
    monkeypatch.setattr(
        engine.adapters,
        "generate",
        lambda names, *a, **k: calls.append(sorted(map(str, names))) or generate(names, *a, **k),
    )
    contents = {name: question() for name in ("a", None, "p")}

    def submit(name):
        prompt = engine.chat_ids([{"role": "user", "content": contents[name]}])
        return engine.submit(prompt, Params(6, temperature=0.0, adapter=name))

    with engine.exclusive():  # no generate() starts: a and the base are batched before p loads
        gens = {name: submit(name) for name in ("a", None)}
        engine.adapters.load(LoraModule("p", str(tmp_path / "param")))
        gens["p"] = submit("p")
    results = {name: gen.collect() for name, gen in gens.items()}
    assert sorted(calls) == [["None"], ["a"], ["p"]]
    references = {**references, "p": peft_reference(str(tmp_path / "param"))}
    for name, result in results.items():
        assert result.cached_tokens == 0 and result.text == stock(references, name, contents[name])
    engine.adapters.unload("p")
    assert engine.adapters.batch_group("a") is None and engine.adapters.batch_group(None) is None


def test_a_lora_modules_entry_named_as_the_base_model_is_a_usage_error(paths, capsys):
    """A request naming the base model's name gets the base, so such an adapter could never be
    reached (and /v1/models would list one id twice): refused as the load endpoint refuses it."""
    with pytest.raises(SystemExit) as exit_:
        demo_main(["--model", "builtin-tiny", "--port", "0", "--lora-modules", f"builtin-tiny={paths['a']}"])
    assert exit_.value.code == 2 and "the base model's name" in capsys.readouterr().err


def save_embedding_adapter(path, lora_seed: int, embedding_seed: int) -> str:
    """A LoRA that also trains its own copy of the input embeddings (``modules_to_save``): the
    copy changes every token's KV, and PEFT keeps it outside its tuner layers."""
    from peft import LoraConfig, get_peft_model

    from tests.demo_checkpoints import build_builtin

    base, _ = build_builtin("builtin-tiny")
    torch.manual_seed(lora_seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        modules_to_save=["embed_tokens"],
        init_lora_weights=False,
    )
    model = get_peft_model(base, config)
    copy = model.base_model.model.model.embed_tokens.modules_to_save["default"].weight
    with torch.no_grad():
        copy.add_(torch.randn(copy.shape, generator=torch.Generator().manual_seed(embedding_seed)) * 0.5)
    model.save_pretrained(str(path))
    return str(path)


def test_an_adapter_with_its_own_modules_is_keyed_by_them_and_flushes_nothing(paths, references, tmp_path):
    """modules_to_save copies are the adapter's weights: loading or unloading such an adapter
    keeps every other prefix (no flush), re-loading it with other copies (same LoRA weights)
    never reads its old KV, and a cache file saved without it restores with it loaded."""
    one = save_embedding_adapter(tmp_path / "one", 1, 1)
    two = save_embedding_adapter(tmp_path / "two", 1, 2)  # the same LoRA weights, another embedding
    file = str(tmp_path / "kv.safetensors")
    cfg = Config(
        model="builtin-tiny", block_size=BLOCK, cache_tokens=1 << 14, admin_token=TOKEN, cache_file=file
    )
    engine = build_engine(cfg)
    app = create_app(cfg, engine)
    client = app.test_client()
    content = question()
    base = chat(client, "builtin-tiny", content)
    app.extensions["radixkv"]["cache_files"].save()  # no adapter loaded
    assert admin(client, "/v1/load_lora_adapter", {"lora_name": "e", "lora_path": one}).status_code == 200
    assert cached(chat(client, "builtin-tiny", content)) == full_hit(base)  # the base KV kept
    r = chat(client, "e", content)
    assert cached(r) == 0 and text(r) == stock({"e": peft_reference(one)}, "e", content)
    assert cached(chat(client, "e", content)) == full_hit(r)
    digest = adapter_digests(engine.model)[peft_name("e")]
    assert admin(client, "/v1/unload_lora_adapter", {"lora_name": "e"}).status_code == 200
    assert admin(client, "/v1/load_lora_adapter", {"lora_name": "e", "lora_path": two}).status_code == 200
    assert adapter_digests(engine.model)[peft_name("e")] != digest  # the copies are in its key
    r = chat(client, "e", content)
    assert cached(r) == 0 and text(r) == stock({"e": peft_reference(two)}, "e", content)
    assert cached(chat(client, "builtin-tiny", content)) == full_hit(base)
    assert engine.store.stats()["flushes"] == 0
    # A restart that loads it from the start restores the file saved without it.
    restarted = Config(**{**cfg.__dict__, "lora_modules": (LoraModule("e", two),)})
    client = create_app(restarted, build_engine(restarted)).test_client()
    assert cached(chat(client, "builtin-tiny", content)) == full_hit(base)


def test_unloading_an_adapter_with_its_own_modules_gives_back_the_base_models(paths, references, tmp_path):
    """PEFT's unload() puts an active modules_to_save copy where the model's module was (it keeps
    the fine-tune): unloading the last adapter that way left the adapter's embeddings in the
    served base model. Unloaded, last or not, the base answers as stock generate() again."""
    one = save_embedding_adapter(tmp_path / "one", 1, 1)
    for others in ((), ("a",)):
        engine = build_engine(config(paths))
        for name in ("a", "b"):
            if name not in others:
                engine.adapters.unload(name)
        engine.adapters.load(LoraModule("e", one))
        content = question()
        prompt = engine.chat_ids([{"role": "user", "content": content}])
        assert engine.submit(prompt, Params(6, temperature=0.0, adapter="e")).collect().text == stock(
            {"e": peft_reference(one)}, "e", content
        )
        engine.adapters.unload("e")
        for name in others:  # the last one unloaded: the plain model again
            engine.adapters.unload(name)
        assert engine.adapters.peft is None and not any("lora" in n for n, _ in engine.model.named_modules())
        assert type(engine.model.model.embed_tokens).__name__ == "Embedding"
        result = engine.submit(prompt, Params(6, temperature=0.0)).collect()
        assert result.text == stock(references, None, content), others


def test_a_reply_paused_between_chunks_never_goes_on_under_other_weights(paths, references, monkeypatch):
    """Continuous batching pauses a long reply between decode chunks; an operator swapping an
    adapter's version under the same name (unload, load) in that gap must not have the rest of
    the reply computed by the new weights (a reply of two adapters, stock for neither): the
    request ends with an error instead, and a new request gets the new weights."""
    engine = build_engine(config(paths))
    engine.adapters.load(LoraModule("c", paths["c"]))
    monkeypatch.setattr(engine.scheduler, "decode_chunk", 4)
    entered, release, swapped = threading.Event(), threading.Event(), []
    generate = engine.adapters.generate

    def spy(names, *args, **kwargs):
        if "c" in names and not swapped:
            entered.set()
            assert release.wait(60)
            out = generate(names, *args, **kwargs)  # the first chunk, paused for the waiting request
            engine.adapters.unload("c")  # between generate() calls, as the admin endpoints do
            engine.adapters.load(LoraModule("c", paths["d"]))
            swapped.append(True)
            return out
        return generate(names, *args, **kwargs)

    monkeypatch.setattr(engine.adapters, "generate", spy)
    long_gen = engine.submit(
        engine.chat_ids([{"role": "user", "content": question()}]), Params(40, temperature=0.0, adapter="c")
    )
    assert entered.wait(30)
    short = engine.submit(engine.text_ids("a short question"), Params(2, temperature=0.0))
    release.set()
    short.collect()
    assert swapped
    with pytest.raises(Exception) as e:
        long_gen.collect()
    assert getattr(e.value, "status", None) == 404 and "reloaded" in str(e.value)
    content = question()
    prompt = engine.chat_ids([{"role": "user", "content": content}])
    result = engine.submit(prompt, Params(6, temperature=0.0, adapter="c")).collect()
    assert result.text == stock(references, "d", content)
