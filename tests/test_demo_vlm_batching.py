"""Image requests are ordinary rows of the demo engine's batches (demo.model.vision_batch): an
image request shares one generate() call with text requests and with image requests of other
sizes / grids, pauses and resumes between decode chunks, and n sampled image choices are n rows;
every reply equals the request alone and stock generate() of its own inputs, and cached_tokens
follows the padded-batch rule of text rows (what the row reads alone, unless a row with less to
read is much shorter). Tiny models per family built from configs (tests/vlm_models.py), each
request's inputs laid out as its processor lays out one prompt. Over HTTP:
tests/test_demo_vlm_batching_http.py; the merge itself: tests/test_demo_vlm_merge.py."""

from __future__ import annotations

import functools

import pytest
import torch

from demo.engine.engine import Engine, Params
from tests.engine_gate import Calls, Held, collect_all
from tests.hf_models import EOS, expected_full_hit, one_torch_thread, tokenizer  # noqa: F401
from tests.vlm_models import IMAGE, VLMS, Item, build_vlm, family_inputs, image, pixels, token_types

BS = 4
MAX_NEW = 6
# One family per merge rule: token types (Gemma 3; Qwen with patches and grids), items of one
# shape (LLaVA), zero-padded tiles (LLaVA-NeXT), zero-padded H x W (Mistral 3), a per-row input
# (LLaVA-OneVision's batch_num_images), flat tiles (Llama 4), rows of images (Idefics3). (All 18
# families of demo.model.vision_batch.RULES passed this test when it was written.)
FAMILIES = [
    "gemma3",
    "llava",
    "llava_next",
    "mistral3",
    "qwen2_5_vl",
    "llava_onevision",
    "llama4",
    "idefics3",
]


def text(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, IMAGE - 5, (n,), generator=g).tolist()  # never a placeholder or delimiter


@functools.cache
def model_of(name: str):
    model = build_vlm(name)
    # rows end at max_tokens; a reply never holds a placeholder or delimiter (real checkpoints
    # suppress them: demo.model.loading and tests/demo_vlm_checkpoints.py)
    model.generation_config.suppress_tokens = [EOS, *range(IMAGE - 5, IMAGE + 1)]
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model


def engine_of(name: str, **kw) -> Engine:
    return Engine(model_of(name), tokenizer(), 512, block_size=BS, cache_tokens=4096, **kw)


def request(name: str, parts: list) -> tuple[list[int], dict]:
    """Prompt ids and inputs of one prompt (text token lists and Items), as its processor gives."""
    model = model_of(name)
    items = [p for p in parts if isinstance(p, Item)]
    if not items:  # a text request: the server's processor gives no model inputs beside the ids
        return [t for p in parts for t in p], {}
    if VLMS[name][1] == "rows":  # Idefics3 / SmolVLM: [1, images, C, H, W], fixed-size images
        inputs = pixels(name, [[image(it.seed) for it in items]])
        item_tokens = [[[IMAGE] * VLMS[name][2] for _ in items]]
    else:
        item_tokens, inputs = family_inputs(name, model, [items])
    it = iter(item_tokens[0])
    ids = [t for p in parts for t in (next(it) if isinstance(p, Item) else p)]
    inputs.update(token_types(name, torch.tensor([ids])))
    if name == "llava_onevision":  # its processor gives each prompt's image count
        inputs["batch_num_images"] = torch.tensor([len(items)])
    return ids, inputs


def stock(name: str, ids: list[int], inputs: dict, max_new: int = MAX_NEW) -> list[int]:
    model = model_of(name)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), **inputs, max_new_tokens=max_new, do_sample=False)
    return out[0, len(ids) :].tolist()


def words(engine, ids: list[int]) -> str:
    return engine.decode(ids)


def asks(name: str, tag: int) -> list[tuple[list[int], dict]]:
    """Two image requests of different sizes / grids and two text requests."""
    return [
        request(name, [text(6, tag), Item(tag, 1), text(5, tag + 1)]),
        request(name, [text(9, tag + 2)]),
        request(name, [Item(tag + 3, 2), text(3, tag + 4)]),
        request(name, [text(4, tag + 5)]),
    ]


def batch(engine, monkeypatch, prompts, maxes) -> tuple[list, list]:
    """``prompts`` submitted while the worker is held, so they are taken together: (results,
    rows and pixels of each generate() call they ran in)."""
    held = Held(engine, monkeypatch)
    calls = Calls(engine, monkeypatch)
    gens = [engine.submit(ids, Params(m, temperature=0.0), inputs=kw) for (ids, kw), m in zip(prompts, maxes)]
    held.go()
    results = collect_all(gens)
    monkeypatch.undo()
    return results, calls.rows


@pytest.mark.parametrize("name", FAMILIES)
def test_image_and_text_requests_share_one_call_equal_alone_and_stock(name, monkeypatch):
    engine = engine_of(name, max_batch_size=8)
    prompts = asks(name, 3100)
    maxes = [MAX_NEW, 4, MAX_NEW - 1, 3]
    batched, calls = batch(engine, monkeypatch, prompts, maxes)
    assert calls == [(4, True)]  # the four requests were rows of one call, with the pixels
    for (ids, kw), m, r in zip(prompts, maxes, batched):
        assert r.text == words(engine, stock(name, ids, kw, m))
        assert (r.completion_tokens, r.cached_tokens) == (m, 0)  # nothing of them was stored
    # Again: each row reads its prompt from the store, through its image, as a text row of a
    # padded batch does: the batch preloads min(padding + match) columns (demo.engine.batching),
    # so a row reads its whole prompt, as alone, unless a row with less to read is far shorter.
    hits_before = engine.stats()["hit_tokens"]
    again, calls = batch(engine, monkeypatch, prompts, maxes)
    assert calls == [(4, True)]
    width = max(len(ids) for ids, _ in prompts)
    full = [expected_full_hit(len(ids), BS) for ids, _ in prompts]
    pads = [width - len(ids) for ids, _ in prompts]
    common = min(p + h for p, h in zip(pads, full))
    assert [r.cached_tokens for r in again] == [min(h, max(0, common - p)) for p, h in zip(pads, full)]
    assert sum(r.cached_tokens for r in again) == engine.stats()["hit_tokens"] - hits_before
    assert [r.text for r in again] == [r.text for r in batched]
    for (ids, kw), m, r, h in zip(prompts, maxes, again, full):
        alone = engine.submit(ids, Params(m, temperature=0.0), inputs=kw).collect()
        assert (alone.text, alone.cached_tokens) == (r.text, h)
    assert again[0].cached_tokens > prompts[0][0].index(IMAGE)  # into (or through) its image
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


@pytest.mark.parametrize("name", ["gemma3", "qwen2_5_vl", "llava_next"])
def test_image_requests_pause_and_resume_equal_alone(name):
    """Two rows at a time, decode chunks of 2: every request pauses (its context prompt + reply,
    its images sent again) and resumes in a re-formed batch, its image read from the store (no
    vision forward again); the replies equal stock."""
    engine = engine_of(name, max_batch_size=2, decode_chunk=2)
    prompts = asks(name, 3200)
    model = model_of(name)
    tower = getattr(model.model, "vision_tower", None) or model.model.visual
    encoded = []
    hook = tower.register_forward_hook(lambda *_: encoded.append(1))
    try:
        gens = [engine.submit(ids, Params(8, temperature=0.0), inputs=kw) for ids, kw in prompts]
        batched = collect_all(gens)
    finally:
        hook.remove()
    assert engine.scheduler.pauses >= 2 and engine.scheduler.resumes >= 2
    # each image encoded once: a resumed row's image is served by the store (its pixels dropped)
    assert len(encoded) == 2
    for (ids, kw), r in zip(prompts, batched):
        assert r.text == words(engine, stock(name, ids, kw, 8))
        assert r.cached_tokens == 0  # the prompt's reuse, fixed by its first chunk
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


@pytest.mark.parametrize("name", ["gemma3", "qwen2_5_vl"])
def test_image_rows_resume_after_the_store_evicted_their_image(name):
    """A store of 16 tokens: a paused row's image KV is evicted before it resumes, so its pixels
    (sent again) are encoded again; every reply still equals stock, nothing stays pinned."""
    engine = Engine(model_of(name), tokenizer(), 512, block_size=BS, cache_tokens=16, max_batch_size=2,
                    decode_chunk=2)  # fmt: skip
    prompts = asks(name, 3700)
    gens = [engine.submit(ids, Params(8, temperature=0.0), inputs=kw) for ids, kw in prompts]
    results = collect_all(gens)
    assert engine.scheduler.resumes >= 2 and engine.stats()["evicted_blocks"] > 0
    for (ids, kw), r in zip(prompts, results):
        assert r.text == words(engine, stock(name, ids, kw, 8))
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


# Llama 4 and Qwen3-VL: stock generate() fails to expand their image inputs to n sequences (the
# engine used to ask it to); as n rows each carrying the image they work.
@pytest.mark.parametrize("name", ["gemma3", "qwen2_5_vl", "llama4", "qwen3_vl"])
def test_sampled_choices_of_an_image_request_are_rows(name, monkeypatch):
    """n=2 seeded: two rows carrying the image each, beside a text request; equal to the same
    seeded request alone."""
    engine = engine_of(name, max_batch_size=8)
    (ids, kw), (tids, _), *_ = asks(name, 3300)
    params = Params(MAX_NEW, temperature=1.0, seed=7, n=2)
    held = Held(engine, monkeypatch)
    calls = Calls(engine, monkeypatch)
    gens = [engine.submit(ids, params, inputs=kw), engine.submit(tids, Params(3, temperature=0.0))]
    held.go()
    batched = collect_all(gens)
    monkeypatch.undo()
    assert calls.rows == [(3, True)]
    alone = engine.submit(ids, params, inputs=kw).collect()
    assert [c.text for c in batched[0].choices] == [c.text for c in alone.choices]
    if name in ("gemma3", "qwen2_5_vl"):  # and stock sampling after torch.manual_seed(seed)
        cfg = engine.runner.config(params)
        cfg.top_k = 0
        torch.manual_seed(7)
        out = model_of(name).generate(torch.tensor([ids]), **kw, generation_config=cfg)
        assert [c.text for c in alone.choices] == [words(engine, row[len(ids) :].tolist()) for row in out]
    assert batched[1].text == words(engine, stock(name, tids, {}, 3))


def test_a_family_without_a_batch_rule_runs_image_requests_alone(monkeypatch, caplog):
    """PaliGemma (not keyed, no rule): its image request runs alone, unpaused, with one log line
    saying why; the text request beside it still runs; both equal stock."""
    name = "paligemma"
    model = model_of(name)
    engine = engine_of(name, max_batch_size=8)
    ids = [IMAGE] * VLMS[name][2] + text(5, 3400)
    kw = pixels(name, [[image(3400)]])
    tids = text(7, 3401)
    with caplog.at_level("INFO", logger="demo.engine.runner"):
        held = Held(engine, monkeypatch)
        calls = Calls(engine, monkeypatch)
        gens = [engine.submit(ids, Params(4, temperature=0.0), inputs=kw) for _ in range(2)]
        gens.append(engine.submit(tids, Params(4, temperature=0.0)))
        held.go()
        results = collect_all(gens)
        monkeypatch.undo()
    assert sorted(calls.rows) == [(1, False), (1, True), (1, True)]
    lines = [r.getMessage() for r in caplog.records if "run alone" in r.getMessage()]
    assert len(lines) == 1 and "paligemma" in lines[0]
    assert engine.runner.image_rule is None and model.config.model_type == name
    assert [r.text for r in results] == [words(engine, stock(name, ids, kw, 4))] * 2 + [
        words(engine, stock(name, tids, {}, 4))
    ]


def test_placeholder_ids_in_a_text_prompt_or_a_reply(monkeypatch, caplog):
    """A text request whose prompt holds the image placeholder id runs alone (beside image rows
    the model would count it as an image's token and fail the whole call); a row whose reply
    holds one is not paused (resumed, its context would). Everyone answers as alone."""
    name = "gemma3"
    model = build_vlm(name)  # no placeholder suppressed: a logit_bias can make the reply one
    model.generation_config.suppress_tokens = [EOS]
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, 0
    engine = Engine(
        model, tokenizer(), 512, block_size=BS, cache_tokens=4096, max_batch_size=2, decode_chunk=2
    )
    (ids, kw), _, (ids2, kw2), _ = asks(name, 3500)
    odd = text(5, 3501) + [IMAGE, IMAGE] + text(3, 3502)
    biased = Params(8, temperature=0.0, logit_bias=((IMAGE, 100.0),))
    caplog.set_level("INFO", logger="demo.engine.runner")
    alone = [
        engine.submit(odd, Params(5, temperature=0.0)).collect(),
        engine.submit(ids, biased, inputs=kw).collect(),
        engine.submit(ids2, Params(8, temperature=0.0), inputs=kw2).collect(),
    ]
    assert alone[1].text == words(engine, [IMAGE] * 8)
    pauses = engine.scheduler.pauses
    held = Held(engine, monkeypatch)
    calls = Calls(engine, monkeypatch)
    gens = [
        engine.submit(ids, biased, inputs=kw),
        engine.submit(ids2, Params(8, temperature=0.0), inputs=kw2),
        engine.submit(odd, Params(5, temperature=0.0)),
    ]
    held.go()
    results = collect_all(gens)
    monkeypatch.undo()
    # the image requests share a call while the odd text request waits (alone); at the chunk's
    # end the unbiased image row pauses, the biased one runs on to its end, then the odd one
    # runs, then the paused row resumes
    assert calls.rows == [(2, True), (1, False), (1, True)]
    assert [r.text for r in results] == [alone[1].text, alone[2].text, alone[0].text]
    assert engine.scheduler.pauses == pauses + 1
    # one log line for the odd prompt, at its first submit
    assert sum("image placeholder id" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("mode", ["cache_prompt_false", "reuse_off"])
def test_image_rows_without_the_prefix_cache(mode, monkeypatch):
    """cache_prompt=false (no store read or write: a paused row recomputes its context, images
    encoded again) and a server with reuse off: image and text rows still share calls, as stock."""
    name = "gemma3"
    reuse = mode != "reuse_off"
    engine = Engine(model_of(name), tokenizer(), 512, reuse=reuse, block_size=BS, cache_tokens=4096,
                    max_batch_size=2, decode_chunk=2)  # fmt: skip
    prompts = asks(name, 3600)
    params = Params(6, temperature=0.0, cache_prompt=not reuse)
    held = Held(engine, monkeypatch)
    calls = Calls(engine, monkeypatch)
    gens = [engine.submit(ids, params, inputs=kw) for ids, kw in prompts]
    held.go()
    results = collect_all(gens)
    monkeypatch.undo()
    assert (2, True) in calls.rows  # image rows shared calls (two rows at a time)
    assert (engine.scheduler.pauses > 0) == reuse  # cache_prompt=false pauses; reuse off never does
    for (ids, kw), r in zip(prompts, results):
        assert (r.text, r.cached_tokens) == (words(engine, stock(name, ids, kw, 6)), 0)
    if reuse:
        assert engine.stats()["hit_tokens"] == 0 and engine.stats()["pinned_blocks"] == 0


def test_a_request_whose_images_the_model_refuses_fails_alone(monkeypatch, caplog):
    """Two images' pixels for one image's placeholders: the batched call fails before its first
    token, its requests then run one by one, and only that request gets the error; the image
    and text requests beside it answer as stock, the store stays consistent."""
    name = "gemma3"
    engine = engine_of(name, max_batch_size=8)
    (ids, kw), (tids, _), (ids2, kw2), _ = asks(name, 3800)
    bad = {**kw, "pixel_values": torch.cat([kw["pixel_values"], kw2["pixel_values"]])}
    held = Held(engine, monkeypatch)
    calls = Calls(engine, monkeypatch)
    gens = [
        engine.submit(ids, Params(4, temperature=0.0), inputs=bad),
        engine.submit(tids, Params(4, temperature=0.0)),
        engine.submit(ids2, Params(4, temperature=0.0), inputs=kw2),
    ]
    caplog.set_level("WARNING", logger="demo.engine.batching")
    held.go()
    results, errors = [None] * 3, [None] * 3
    for i, g in enumerate(gens):
        try:
            results[i] = g.collect()
        except Exception as e:  # the refused request's own error
            errors[i] = e
    monkeypatch.undo()
    assert calls.rows == [(3, True), (1, True), (1, False), (1, True)]
    assert errors[0] is not None and errors[1:] == [None, None]
    assert [r.text for r in results[1:]] == [
        words(engine, stock(name, tids, {}, 4)),
        words(engine, stock(name, ids2, kw2, 4)),
    ]
    assert sum("run one by one" in r.getMessage() for r in caplog.records) == 1
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0
