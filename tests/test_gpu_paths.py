"""The cache's paths on a CUDA device, against stock generate() on the same device.

Everything else in the suite runs on the CPU; this module moves the same oracles onto CUDA
(fp32, so greedy equality is exact up to kernel rounding): prefix reuse through the store and
its copy kernels, the page-locked host tier, cache files written from and restored into a CUDA
pool, the step loop's persistent batch (hf_patch.running_batch) and the demo engine with mixed
per-row options. Skipped without CUDA (marker ``gpu``).
"""

from __future__ import annotations

import threading

import pytest
import torch

import cuda_ext
import hf_patch
from hf_patch.running_batch import RunningBatch, prefill_keys
from tests.hf_models import (
    EOS,
    PAD,
    assert_same_as_stock,
    block_floor,
    build,
    expected_full_hit,
    ids,
    left_pad,
    stock,
    tokens,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = "cuda"
BS = 4
DOC = tokens(61, seed=4101)
QUESTIONS = [tokens(5 + i, seed=4102 + i) for i in range(3)]


def on_cuda(name: str, seed: int = 0):
    return build(name, seed).to(CUDA)


def cuda_ids(*rows: list[int]) -> torch.Tensor:
    return ids(*rows).to(CUDA)


@pytest.mark.parametrize("family", ("llama-sdpa", "gpt2", "qwen2-sliding", "deepseek-v3-mla"))
def test_prefix_reuse_on_cuda_equals_stock(family):
    model = on_cuda(family)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    assert store.pool.k[0].device.type == "cuda"
    for i, q in enumerate(QUESTIONS):
        cache, _ = assert_same_as_stock(model, cuda_ids(DOC + q), store)
        if i:  # the document is read back from the CUDA pool
            assert cache.cached_tokens == [block_floor(len(DOC), BS)]
    store.check_invariants()
    if family == "llama-sdpa":
        assert cuda_ext.backend_for(CUDA) == "cuda-kernel", cuda_ext.build.unavailable_reason()


def test_left_padded_batch_sharing_a_prefix_on_cuda():
    model = on_cuda("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    rows = [DOC + q for q in QUESTIONS]
    input_ids, mask = left_pad(rows)
    input_ids, mask = input_ids.to(CUDA), mask.to(CUDA)
    ref = stock(model, input_ids, attention_mask=mask)
    assert_same_as_stock(model, input_ids, store, reference=ref, attention_mask=mask)
    cache, _ = assert_same_as_stock(model, input_ids, store, reference=ref, attention_mask=mask)
    assert all(c >= block_floor(len(DOC), BS) for c in cache.cached_tokens)


def test_host_tier_is_page_locked_and_its_hits_equal_stock():
    model = on_cuda("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=64, host_cache_tokens=4096)
    prompts = [tokens(44, seed=4200 + i) for i in range(4)]
    refs = [stock(model, cuda_ids(p)) for p in prompts]
    for p, ref in zip(prompts, refs):  # each commit demotes the previous prompt to the host
        assert_same_as_stock(model, cuda_ids(p), store, reference=ref)
    assert store.stats()["demoted_blocks"] > 0
    for p, ref in zip(prompts, refs):
        cache, _ = assert_same_as_stock(model, cuda_ids(p), store, reference=ref)
        assert cache.cached_tokens == [expected_full_hit(len(p), BS)]
    assert store.stats()["host_hit_tokens"] >= 3 * expected_full_hit(44, BS)
    host = store.host_pool.k + store.host_pool.v
    assert all(t.device.type == "cpu" and t.is_pinned() for t in host)
    store.check_invariants()


def test_a_cache_file_from_a_cuda_pool_restores_into_another(tmp_path):
    model = on_cuda("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    assert_same_as_stock(model, cuda_ids(DOC + QUESTIONS[0]), store)
    path = tmp_path / "kv.safetensors"
    assert hf_patch.save_cache(model, path, store).num_tokens >= block_floor(len(DOC), BS)
    again = on_cuda("llama-sdpa")  # another model object: as after a restart
    restored = hf_patch.build_store(again, block_size=BS, budget_tokens=4096, restore=path)
    restored.check_invariants()
    cache, _ = assert_same_as_stock(again, cuda_ids(DOC + QUESTIONS[1]), restored)
    assert cache.cached_tokens == [block_floor(len(DOC), BS)]


def pick(logits: torch.Tensor) -> int:
    """Greedy with EOS suppressed (as stock's suppress_tokens=[EOS]): every row runs its length."""
    logits = logits.clone()
    logits[EOS] = float("-inf")
    return int(logits.argmax())


def _admit(batch, model, store, prompts, out):
    input_ids, mask = left_pad(prompts)
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        res = model.generate(
            input_ids.to(CUDA), attention_mask=mask.to(CUDA), past_key_values=cache, max_new_tokens=1,
            do_sample=False, pad_token_id=PAD, eos_token_id=EOS, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    first = [pick(res.logits[0][i]) for i in range(len(prompts))]
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    slots = batch.admit(
        kv, input_ids.to(CUDA), mask.to(CUDA), first, prefill_keys(model, cache, len(prompts))
    )
    for slot, prompt, token in zip(slots, prompts, first):
        out[slot] = (prompt, [token])
    return cache.cached_tokens


def test_running_batch_on_cuda_rows_admitted_between_steps_equal_stock_alone():
    """The step loop's persistent left-padded batch with its KV on the GPU: rows admitted at
    different steps, each row's greedy reply equals stock generate() of it alone on CUDA."""
    model = on_cuda("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    batch = RunningBatch(model, store, PAD, [EOS])
    new = 10
    out: dict[int, tuple[list[int], list[int]]] = {}
    done: list[tuple[list[int], list[int]]] = []

    def steps(n):
        for _ in range(n):
            finished = [s for s, (_, r) in out.items() if len(r) >= new]
            batch.remove(finished)
            done.extend(out.pop(s) for s in finished)
            if not out:
                return
            logits = batch.step()
            picks = [pick(logits[s]) if s in out else PAD for s in range(batch.size)]
            batch.set_next(picks)
            for s in out:
                out[s][1].append(picks[s])

    _admit(batch, model, store, [DOC + QUESTIONS[0]], out)
    steps(3)
    cached = _admit(batch, model, store, [DOC + QUESTIONS[1], tokens(9, seed=4300)], out)
    assert cached[0] >= block_floor(len(DOC), BS)  # read back from the CUDA pool
    steps(4)
    _admit(batch, model, store, [tokens(70, seed=4301)], out)  # wider than the rows
    steps(40)
    assert not batch.rows and not out and len(done) == 4
    for prompt, reply in done:
        with torch.no_grad():
            ref = model.generate(
                cuda_ids(prompt), max_new_tokens=new, do_sample=False, pad_token_id=PAD, eos_token_id=EOS,
                suppress_tokens=[EOS],
            )  # fmt: skip
        alone = ref[0, len(prompt) :].tolist()
        assert reply == alone, prompt
    store.check_invariants()


@pytest.fixture(scope="module")
def engine():
    from demo.api.app import build_engine
    from demo.config import Config

    e = build_engine(
        Config(model="builtin-tiny", device=CUDA, dtype="float32", cache_tokens=1 << 14, max_batch_size=8)
    )
    cfg = e.model.generation_config
    cfg.suppress_tokens = [*(cfg.suppress_tokens or []), *e.runner.eos]  # rows end only where we say
    yield e
    e.shutdown(wait=30)


def _stock(engine, prompt_ids: list[int], p) -> str:
    """Stock generate() of the request alone on CUDA, no cache (greedy, or sampled after
    torch.manual_seed(seed), which seeds the CUDA generator too); top_k through the config."""
    cfg = engine.runner.config(p)
    if p.sampled:
        cfg.top_k = p.top_k
        torch.manual_seed(p.seed % 2**64)
    t = torch.tensor([prompt_ids], device=CUDA)
    with torch.no_grad():
        out = engine.model.generate(t, attention_mask=torch.ones_like(t), generation_config=cfg)
    return engine.decode(out[0, len(prompt_ids) :].tolist())


def test_engine_on_cuda_mixed_options_in_one_running_batch_equal_each_alone(engine):
    """The demo engine on CUDA (step loop, per-row samplers with CUDA generators): greedy,
    seeded, top-p, top-k, logit-bias and penalty requests submitted at once; each reply equals
    the request sent alone, and stock generate() of it alone where stock's config has its
    options (logit_bias and OpenAI's penalties are the engine's own processors); a second round
    reads the prompts back from the store."""
    from demo.engine.engine import Params

    assert engine.model.device.type == "cuda" and engine.loop is not None
    params = [
        Params(24, temperature=0.0),
        Params(24, temperature=0.8, seed=11),
        Params(18, temperature=1.1, top_p=0.8, seed=12),
        Params(20, temperature=0.0, logit_bias=((5, 4.0),)),
        Params(16, temperature=0.9, seed=13, frequency_penalty=0.5, presence_penalty=0.3),
        Params(22, temperature=0.7, seed=14, top_k=8),
    ]
    prompts = [engine.text_ids(f"request {i} asks about Porto and its bridges") for i in range(len(params))]
    alone = [engine.submit(prompts[i], p).collect().text for i, p in enumerate(params)]
    for i in (0, 1, 2, 5):
        assert alone[i] == _stock(engine, prompts[i], params[i]), params[i]
    for round_ in range(2):
        gens = []
        start = threading.Barrier(len(params))

        def submit(i, start=start, gens=gens):
            start.wait()
            gens.append((i, engine.submit(prompts[i], params[i])))

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(params))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = {i: g.collect() for i, g in gens}
        for i, p in enumerate(params):
            assert results[i].text == alone[i], (round_, p)
        assert all(results[i].cached_tokens > 0 for i in results)  # read back (sent alone first)
    engine.check_invariants()
