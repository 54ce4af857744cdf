"""hf_patch.running_batch: running rows read their cached prefixes from the store's pool in place
(issue 41). Rows over one cached document, joining by seat (inside a step) or by an admission
prefill at different steps, give the logits of a batch that copies each prefix into its slot
bit for bit, and stock generate()'s tokens; their slots hold only their own columns; a finished
row commits only those (commit offset) and its reply is read back; the prefix stays pinned
while rows read it (a flush and NaN in every free block change nothing); host-tier prefixes,
the switch, a kernel that stops applying and recurrent models take the copy path."""

from __future__ import annotations

import logging

import pytest
import torch

import hf_patch
from cuda_ext import ragged_decode
from hf_patch import ragged_attention, running_batch
from hf_patch.running_batch import RunningBatch, pool_reason, prefill_keys, prefill_tensors
from tests.hf_models import (  # noqa: F401
    EOS,
    PAD,
    build,
    greedy_reply,
    left_pad,
    one_torch_thread,
    poison_free_blocks,
    shared,
    store_for,
    tokens,
)

pytestmark = pytest.mark.skipif(
    not ragged_decode.available(), reason="numba is not installed (the demo extra)"
)

MODEL = "llama-sdpa"
DOC = tokens(37, 1)  # 9 blocks of 4 and a token


def cache_doc(model, store) -> None:
    """The document in the store, as an earlier request leaves it."""
    with torch.no_grad():
        model.generate(
            torch.tensor([DOC]), past_key_values=hf_patch.RadixCache(store=store), max_new_tokens=1,
            do_sample=False, pad_token_id=PAD,
        )  # fmt: skip


def drive(model, store, schedule, steps: int, pooled: bool, join: str = "seat", between=None):
    """Join each (prompt, new tokens) of ``schedule[k]`` before step k (``join``: "seat", or
    "admit" after a prefill generate() as the engine admits), decode greedily, each row removed
    (committed) at its length, the batch compacted. ``between(batch)`` runs after each step.
    Returns ({prompt: (tokens, cached)}, per step {prompt: logits}, max KV columns, the batch)."""
    batch = RunningBatch(model, store, PAD, [EOS], pooled=pooled)
    running: dict[int, list] = {}  # slot -> [prompt, new, out, cached]
    done, seen, widest = {}, [], 0

    def retire():
        nonlocal running
        ended = [i for i, r in running.items() if len(r[2]) >= r[1] or (r[2] and r[2][-1] == EOS)]
        batch.remove(ended)
        for i in ended:
            p, _, out, hit = running.pop(i)
            done[tuple(p)] = (out, hit)
        moved = batch.compact()
        if moved is not None:
            old = dict(running)
            running = {j: old[i] for j, i in enumerate(moved) if i in old}

    for k in range(steps):
        rows = schedule.get(k, [])
        if rows and join == "seat":
            keys = prefill_keys(model, hf_patch.RadixCache(store=store), len(rows))
            slots, cached = batch.seat([p for p, _ in rows], keys)
            firsts = [[] for _ in rows]
        elif rows:
            ids, mask = left_pad([p for p, _ in rows])
            cache = hf_patch.RadixCache(store=store)
            with torch.no_grad():
                out = model.generate(
                    ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, do_sample=False,
                    pad_token_id=PAD, eos_token_id=EOS,
                )  # fmt: skip
            first = out[:, -1].tolist()
            kv, _ = prefill_tensors(model, cache, mask)
            slots = batch.admit(kv, ids, mask, first, prefill_keys(model, cache, len(rows)))
            cached, firsts = cache.cached_tokens, [[f] for f in first]
        for slot, (p, new), hit, f in zip(
            slots if rows else [], rows, cached if rows else [], firsts if rows else []
        ):
            running[slot] = [p, new, f, hit]
        retire()
        if not running:
            continue
        widest = max(widest, batch.kv_width)
        logits = batch.step()
        seen.append({tuple(r[0]): logits[i].clone() for i, r in running.items()})
        picks = logits.argmax(dim=-1).tolist()
        batch.set_next([picks[i] if i in running else PAD for i in range(batch.size)])
        for i, r in running.items():
            r[2].append(picks[i])
        if between is not None:
            between(batch)
        retire()
    assert not running and batch.size == 0
    return done, seen, widest, batch


def questions():
    """Three rows over the document (two join together, one later) and a row of its own."""
    a, b, c = DOC + tokens(5, 2), DOC + tokens(3, 3), DOC[:21] + tokens(6, 4)
    plain = tokens(20, 5)
    return {0: [(a, 7), (plain, 4)], 2: [(b, 9), (c, 5)]}


@pytest.mark.parametrize("join", ["seat", "admit"])
def test_rows_over_a_cached_document_read_it_in_place_exactly(join):
    model = shared(MODEL)
    schedule = questions()
    runs = {}
    for pooled in (False, True):
        store = store_for(model)
        cache_doc(model, store)
        runs[pooled] = drive(model, store, schedule, 14, pooled, join)
        store.check_invariants()
        assert store.stats()["pinned_blocks"] == 0  # every row's lease released as it left
    (copy, copy_logits, copy_width, _), (pool, pool_logits, pool_width, _) = runs[False], runs[True]
    assert pool == copy  # tokens and cached tokens
    for rows in schedule.values():
        for prompt, new in rows:
            assert pool[tuple(prompt)][0] == greedy_reply(model, prompt, new), len(prompt)
    # the same sums in the same order as the copy's: bit for bit, at every step
    assert len(pool_logits) == len(copy_logits)
    for a, b in zip(pool_logits, copy_logits):
        assert a.keys() == b.keys() and all(torch.equal(a[p], b[p]) for p in a)
    # the slots held the rows' own columns (the widest: the plain row and its reply), the copies
    # the document and more
    assert pool_width < len(DOC) < copy_width


def test_each_row_holds_only_its_own_columns_and_pins_the_document_while_it_runs():
    model = shared(MODEL)
    store = store_for(model)
    cache_doc(model, store)
    batch = RunningBatch(model, store, PAD, [EOS])
    assert batch.pools
    keys = prefill_keys(model, hf_patch.RadixCache(store=store), 3)
    prompts = [DOC + tokens(5, 6), DOC + tokens(2, 7), DOC[:25] + tokens(4, 8)]
    slots, cached = batch.seat(prompts, keys)
    assert cached == [36, 36, 24] and batch.prefix == [36, 36, 24]
    assert batch.kv_width == 5 and batch.width == 41  # own columns before the fed token; all its tokens
    assert batch.kv_start(0) == 0 and batch.kv_start(1) == 3  # (rows right-aligned in both)
    assert store.stats()["pinned_blocks"] == 9
    batch.step()
    assert batch.tokens(0) == prompts[0][:-1] + [prompts[0][-1]]  # ids hold the pool tokens too
    batch.remove([0, 1, 2], commit=False)
    assert store.stats()["pinned_blocks"] == 0


def test_a_finished_row_commits_only_its_own_columns_and_is_read_back():
    model = shared(MODEL)
    store = store_for(model)
    cache_doc(model, store)
    question = DOC + tokens(6, 9)
    done, _, _, _ = drive(model, store, {0: [(question, 8)]}, 9, True)
    reply, cached = done[tuple(question)]
    assert cached == 36
    # its prompt and fed reply (all but its last, unfed token) were committed after the pool's
    # 36 tokens: a follow-up reads them all
    follow = question + reply + tokens(3, 10)
    batch = RunningBatch(model, store, PAD, [EOS])
    (slot,), (hit,) = batch.seat([follow], prefill_keys(model, hf_patch.RadixCache(store=store), 1))
    assert hit == (len(question) + len(reply) - 1) // 4 * 4 and batch.prefix[slot] == hit
    out = []
    for _ in range(4):
        token = int(batch.step()[slot].argmax())
        out.append(token)
        batch.set_next([token])
    assert out == greedy_reply(model, follow, 4)
    batch.remove([slot], commit=False)
    store.check_invariants()


def test_the_document_stays_pinned_through_a_flush_and_nan_in_every_free_block():
    model = shared(MODEL)
    store = store_for(model)
    cache_doc(model, store)
    pinned = []

    def squeeze(batch):  # between steps: the store flushed, every free block taken and poisoned
        pinned.append(store.stats()["pinned_blocks"])
        store.flush()
        poison_free_blocks(store)

    schedule = {0: [(DOC + tokens(4, 11), 6), (DOC[:30] + tokens(3, 12), 6)]}
    done, _, _, _ = drive(model, store, schedule, 7, True, between=squeeze)
    for prompt, new in schedule[0]:
        assert done[tuple(prompt)] == (greedy_reply(model, prompt, new), 36 if len(prompt) > 37 else 28)
    # the first step's commits (their prompts, after their pool tokens) pinned the document's
    # nodes and theirs; after the flush nothing more is committed (the rows' KV predates it)
    assert pinned[0] >= 9
    assert store.stats()["pinned_blocks"] == 0 and store.stats()["cached_blocks"] == 0
    store.check_invariants()


def test_a_host_tier_prefix_is_copied_into_the_slot():
    model = shared(MODEL)
    store = hf_patch.build_store(model, block_size=4, budget_tokens=64, host_cache_tokens=1024)
    cache_doc(model, store)
    with torch.no_grad():  # another prompt: the document's blocks are demoted to the host
        model.generate(torch.tensor([tokens(44, 13)]), past_key_values=hf_patch.RadixCache(store=store),
                       max_new_tokens=1, do_sample=False, pad_token_id=PAD)  # fmt: skip
    assert store.stats()["demoted_blocks"] > 0
    prompt = DOC + tokens(4, 14)
    done, _, _, _ = drive(model, store, {0: [(prompt, 5)]}, 6, True)
    assert done[tuple(prompt)] == (greedy_reply(model, prompt, 5), 36)
    assert store.stats()["host_hit_tokens"] > 0


def test_switched_off_or_where_the_kernel_stops_applying_rows_copy_their_prefixes(monkeypatch, caplog):
    model = shared(MODEL)
    store = store_for(model)
    cache_doc(model, store)
    prompt = DOC + tokens(5, 15)
    monkeypatch.setenv("RADIXKV_STEP_POOL", "0")
    assert pool_reason(model, store) == running_batch.POOL_OFF
    batch = RunningBatch(model, store, PAD, [EOS])
    batch.seat([prompt], prefill_keys(model, hf_patch.RadixCache(store=store), 1))
    assert batch.prefix == [0] and batch.kv_width == len(prompt) - 1
    batch.clear()
    monkeypatch.setenv("RADIXKV_STEP_POOL", "1")
    # the kernel stops applying while a row reads the pool: its prefix is copied into its slot
    # first (one log line), and its tokens are still stock's
    batch = RunningBatch(model, store, PAD, [EOS])
    (slot,), _ = batch.seat([prompt], prefill_keys(model, hf_patch.RadixCache(store=store), 1))
    out = [int(batch.step()[slot].argmax())]
    batch.set_next(out)
    assert batch.prefix == [36]
    monkeypatch.setattr(ragged_attention, "verify", lambda m: False)
    with caplog.at_level(logging.WARNING, logger="hf_patch.running_batch"):
        for _ in range(3):
            out.append(int(batch.step()[slot].argmax()))
            batch.set_next([out[-1]])
    assert out == greedy_reply(model, prompt, 4)
    assert batch.prefix == [0] and store.stats()["pinned_blocks"] == 0
    assert [r.message for r in caplog.records].count(
        "radixkv: the step's ragged kernel no longer applies: running rows copy their prefixes into their slots"
    ) == 1
    batch.remove([slot])
    monkeypatch.setenv("RADIXKV_STEP_POOL", "maybe")
    with pytest.raises(ValueError, match="RADIXKV_STEP_POOL must be 0, 1 or auto"):
        pool_reason(model, store)


def test_a_recurrent_model_and_a_failing_probe_keep_the_copy(monkeypatch, caplog):
    from tests.hybrid_models import build_hybrid

    hybrid = build_hybrid("qwen3_5_text")
    assert "recurrent state" in pool_reason(hybrid, store_for(hybrid))
    model = build(MODEL)
    assert pool_reason(model, store_for(model)) is None  # the real probe passes
    model = build(MODEL)
    monkeypatch.setattr(running_batch, "_probe_pool", lambda m: (False, "simulated"))
    with caplog.at_level(logging.WARNING, logger="hf_patch.running_batch"):
        assert "probe" in pool_reason(model, store_for(model))
        assert "probe" in pool_reason(model, store_for(model))  # (asked once per model)
    assert caplog.text.count("running rows copy their cached prefixes: simulated") == 1


def test_the_demo_runs_many_requests_over_one_cached_document_at_once_holding_it_once(monkeypatch):
    """The engine's step loop: four requests over one cached document join together under a
    --max-batch-tokens that holds four rows' own columns but not four copies of the document
    (the budget counts what each row holds: its uncached part); their rows read the document
    from the pool in place; every reply equals stock generate() alone, the document is
    reported cached, and no pin outlives them."""
    from demo.api.app import build_engine
    from demo.config import Config
    from demo.engine.engine import Params
    from tests.test_step_loop import engine_stock, settle, spy_steps, wait_for

    engine = build_engine(
        Config(model="builtin-tiny", cache_tokens=1 << 14, max_batch_size=8, max_batch_tokens=256)
    )
    cfg = engine.model.generation_config
    cfg.suppress_tokens = [*(cfg.suppress_tokens or []), *engine.runner.eos]  # rows end only where we say
    assert engine.loop.batch.pools
    doc = engine.text_ids(" ".join(f"the harbour of town {i} has {i + 3} boats" for i in range(6)))
    assert 100 < len(doc) < 256 < 4 * len(doc)
    engine.submit(doc, Params(1, temperature=0.0)).collect()  # cached now
    steps = spy_steps(engine, monkeypatch)
    prompts = [doc + engine.text_ids(f" question {i}: how many boats?") for i in range(4)]
    params = Params(12, temperature=0.0)
    seen = []
    gens = [engine.submit(p, params) for p in prompts]
    wait_for(lambda: any(g.generated >= 2 for g in gens))
    seen.append((list(engine.loop.batch.prefix), engine.loop.batch.kv_width))
    results = [g.collect() for g in gens]
    assert any(all(id(g) in s for g in gens) for s in steps)  # a step of all four
    held = len(doc) // engine.store.block_size * engine.store.block_size
    prefixes, kv_width = seen[0]
    assert held in prefixes and kv_width < len(doc)
    for p, r in zip(prompts, results):
        assert r.text == engine_stock(engine, p, params)
        assert r.cached_tokens >= held
    settle(engine)
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0
    engine.shutdown(0.5)


def _random_run(model, seed: int, pooled: bool) -> tuple[list, int]:
    """A seeded sequence over a small store (evictions) holding three documents: rows of random
    cuts of them plus random tails join by seat or by admission prefill at random steps, leave
    at random lengths, the batch compacted; store invariants after every step. Returns each
    step's (prompt, logits) per row and the pool tokens read over all steps."""
    import random

    rnd = random.Random(seed)
    store = store_for(model, budget_tokens=512)
    docs = [tokens(rnd.randint(5, 70), 100 + i) for i in range(3)]
    for doc in docs:
        with torch.no_grad():
            model.generate(torch.tensor([doc]), past_key_values=hf_patch.RadixCache(store=store),
                           max_new_tokens=1, do_sample=False, pad_token_id=PAD)  # fmt: skip
    schedule, k = {}, 0
    for k in range(30):
        if rnd.random() < 0.35:
            rows = [rnd.choice(docs) for _ in range(rnd.randint(1, 3))]
            rows = [
                (
                    d[: rnd.randint(1, len(d))] + tokens(rnd.randint(1, 12), rnd.randrange(10**6)),
                    rnd.randint(1, 12),
                )
                for d in rows
            ]
            schedule[k] = rows
    join = "seat" if seed % 2 else "admit"
    read = []
    done, seen, _, _ = drive(
        model,
        store,
        schedule,
        40,
        pooled,
        join,
        between=lambda b: (read.append(sum(b.prefix)), store.check_invariants()),
    )
    assert store.stats()["pinned_blocks"] == 0
    return sorted(done.items()), seen, sum(read)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_joins_leaves_and_evictions_give_the_copys_logits(seed):
    model = shared(MODEL)
    # the once-per-model probes first, as the demo runs them at start: run lazily inside the
    # first compared run's steps they part its last bits from the second's (~1e-7, tokens equal)
    assert pool_reason(model, store_for(model)) is None and running_batch.packs(model)
    copy_done, copy_seen, _ = _random_run(model, seed, False)
    pool_done, pool_seen, read = _random_run(model, seed, True)
    assert read > 0 and pool_done == copy_done
    assert len(pool_seen) == len(copy_seen)
    for a, b in zip(pool_seen, copy_seen):
        assert a.keys() == b.keys() and all(torch.equal(a[p], b[p]) for p in a)


def test_an_admit_that_fails_copying_a_later_layer_leaves_no_block_pinned():
    """admit checks layer 0's KV shape; a later layer of another shape fails while rows are
    copied into their slots, after their prefixes were leased: those leases are released (they
    stayed pinned for good: no slot held them, so clear() never saw them)."""
    model = shared(MODEL)
    store = store_for(model)
    cache_doc(model, store)
    ids, mask = left_pad([DOC + tokens(5, 2)])
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=PAD,
        )
    kv, _ = prefill_tensors(model, cache, mask)
    keys = prefill_keys(model, cache, 1)
    batch = RunningBatch(model, store, PAD, [EOS], pooled=True)
    batch.admit(kv, ids, mask, out[:, -1].tolist(), keys)
    assert batch.prefix[0] > 0 and store.stats()["pinned_blocks"] > 0  # it reads the pool
    bad = [kv[0], *((k[..., :8], v[..., :8]) for k, v in kv[1:])]
    with pytest.raises(RuntimeError):
        batch.admit(bad, ids, mask, out[:, -1].tolist(), keys)
    batch.clear()
    assert store.stats()["pinned_blocks"] == 0


def test_a_step_under_another_threads_paged_switch_still_reads_its_pool(monkeypatch):
    """A RunningBatch step whose forward runs while another thread's paged generate() has
    switched the model's attention to "radixkv_paged" (paged_attention.activate) still attends
    its rows' prefixes in the pool: the paged function hands its arguments to the ragged one
    (it ran plain SDPA, which drops them: logits 0.38 off, nothing raised)."""
    import contextlib

    from hf_patch import paged_attention

    model = shared(MODEL)
    store = store_for(model)
    cache_doc(model, store)
    prompt = DOC + tokens(5, 2)

    def one_step():
        b = RunningBatch(model, store, PAD, [EOS], pooled=True)
        (slot,), _ = b.seat([prompt], prefill_keys(model, hf_patch.RadixCache(store=store), 1))
        b.step()
        b.set_next([7])
        out, pre = b.step()[slot], b.prefix[slot]
        b.clear()
        return out, pre

    alone, read = one_step()
    assert read > 0  # it reads the pool
    columns = ragged_attention.columns

    class OtherCall:  # another thread's paged call: its own cache, not the batch's layers
        cache = type("C", (), {"layers": []})()

    @contextlib.contextmanager
    def interleaved(model_, *a, **k):
        with columns(model_, *a, **k) as kw, paged_attention.activate(model_, OtherCall()):
            yield kw

    monkeypatch.setattr(running_batch.ragged_attention, "columns", interleaved)
    under, _ = one_step()
    assert (under - alone).abs().max() < 1e-5  # (another mask path: ~1e-7; without the prefix: 0.38)
