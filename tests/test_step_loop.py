"""hf_patch.running_batch: rows admitted at different steps, decoded one forward per step over a
persistent left-padded KV batch, equal stock generate() of each row alone; removal, commit and
rows that are never committed."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper

import hf_patch
from hf_patch.running_batch import RunningBatch, prefill_keys, prefill_tensors, unsupported_reason
from tests.hf_models import EOS, PAD, build, left_pad, one_torch_thread, shared, store_for, tokens  # noqa: F401

MODEL = "llama-sdpa"


class Row:
    """One request of the test: its prompt, its sampler, and what it generated."""

    def __init__(self, prompt, new, seed=None, temperature=0.7, namespace=None):
        self.prompt, self.new, self.seed, self.temperature = prompt, new, seed, temperature
        self.namespace = namespace
        self.rng = torch.Generator().manual_seed(seed) if seed is not None else None
        self.out: list[int] = []
        self.cached = None

    def pick(self, logits: torch.Tensor) -> int:
        """logits: [vocab] float32 -> the token stock generate() picks (greedy, or one draw of
        torch.multinomial after manual_seed(seed): the same generator stream)."""
        if self.rng is None:
            return int(logits.argmax())
        x = TemperatureLogitsWarper(self.temperature)(None, logits.reshape(1, -1))
        return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=self.rng))


def stock_alone(model, row: Row) -> list[int]:
    kwargs = dict(max_new_tokens=row.new, pad_token_id=PAD, eos_token_id=EOS)
    if row.seed is None:
        kwargs.update(do_sample=False)
    else:
        torch.manual_seed(row.seed)
        kwargs.update(do_sample=True, temperature=row.temperature, top_k=None, top_p=None)
    with torch.no_grad():
        out = model.generate(torch.tensor([row.prompt]), **kwargs)
    return out[0, len(row.prompt) :].tolist()


def admit(batch: RunningBatch, model, store, rows: list[Row], running: dict, cache_prompt=True) -> None:
    """The engine's admission: one prefill generate() (max_new_tokens=1) over the newcomers
    left-padded, reading and committing the store; each newcomer's first token from its logits.
    ``running``: slot -> Row, updated."""
    ids, mask = left_pad([r.prompt for r in rows])
    if cache_prompt:
        cache = hf_patch.RadixCache(store=store, namespace=[r.namespace for r in rows])
    else:
        from transformers import DynamicCache

        cache = DynamicCache()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=1, do_sample=False,
            pad_token_id=PAD, eos_token_id=EOS, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    first = [r.pick(out.logits[0][i].float()) for i, r in enumerate(rows)]
    for i, r in enumerate(rows):
        r.out.append(first[i])
        r.cached = cache.cached_tokens[i] if cache_prompt else 0
    kv, states = prefill_tensors(model, cache, mask)
    keys = prefill_keys(model, cache, len(rows)) if cache_prompt else None
    slots = batch.admit(kv, ids, mask, first, keys, states=states)
    assert sorted(batch.rows) == sorted([*running, *slots])
    running.update(zip(slots, rows))


def seat(batch: RunningBatch, model, store, rows: list[Row], running: dict, cache_prompt=True) -> None:
    """The engine's admission where the batch packs: the newcomers are seated with their cached
    prefixes read from the store; the next step computes the rest of their prompts beside the
    running rows' tokens and gives their first tokens."""
    keys = None
    if cache_prompt:
        cache = hf_patch.RadixCache(store=store, namespace=[r.namespace for r in rows])
        keys = prefill_keys(model, cache, len(rows))
    slots, cached = batch.seat([r.prompt for r in rows], keys)
    for r, hit in zip(rows, cached):
        r.cached = hit
    assert sorted(batch.rows) == sorted([*running, *slots])
    running.update(zip(slots, rows))


@pytest.fixture(params=["prefill", "seat"])
def join(request):
    """How newcomers join: an admission prefill (RunningBatch.admit) or seated for the next
    step (RunningBatch.seat)."""
    return admit if request.param == "prefill" else seat


def run(batch: RunningBatch, running: dict, steps: int) -> None:
    """``steps`` decode steps; a row that reached its length or EOS is removed (committed)."""
    for _ in range(steps):
        retire(batch, running)
        if not running:
            return
        logits = batch.step()
        assert logits.shape[0] == batch.size
        picks = [running[i].pick(logits[i]) if i in running else PAD for i in range(batch.size)]
        batch.set_next(picks)
        for i, r in running.items():
            r.out.append(picks[i])
    retire(batch, running)


def retire(batch: RunningBatch, running: dict) -> None:
    done = [i for i, r in running.items() if len(r.out) >= r.new or (r.out and r.out[-1] == EOS)]
    batch.remove(done)
    for i in done:
        del running[i]
    moved = batch.compact()
    if moved is not None:  # new slot j holds old slot moved[j]
        old = dict(running)
        running.clear()
        running.update({j: old[i] for j, i in enumerate(moved)})


def test_rows_admitted_at_different_steps_equal_stock_alone_greedy_and_seeded(join):
    model = shared(MODEL)
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    a = Row(tokens(20, 1), 12)
    b = Row(tokens(7, 2), 9, seed=5)
    c = Row(tokens(31, 3), 6)  # wider than the batch: the running rows are padded further
    d = Row(tokens(5, 4), 8, seed=11, temperature=1.3)
    running: dict = {}
    join(batch, model, store, [a], running)
    run(batch, running, 3)
    join(batch, model, store, [b, c], running)
    run(batch, running, 2)
    join(batch, model, store, [d], running)
    run(batch, running, 20)
    assert batch.size == 0 and not running
    for r in (a, b, c, d):
        assert r.out == stock_alone(model, r), r.prompt


def test_a_removed_row_leaves_the_others_exact_and_its_reply_is_read_back(join):
    model = shared(MODEL)
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    long_, short = Row(tokens(9, 7), 14), Row(tokens(26, 8), 5)
    running: dict = {}
    join(batch, model, store, [long_, short], running)
    run(batch, running, 5)  # the short (wide) row leaves: its slot is freed
    assert list(running.values()) == [long_]
    # its prompt + reply (less its last, unfed token) were committed: a follow-up whose prompt
    # is that conversation reads it from the store, and takes its free slot beside the long row
    follow = Row(short.prompt + short.out + tokens(3, 9), 4)
    join(batch, model, store, [follow], running)
    assert batch.size == 2 and follow.cached == (len(short.prompt) + len(short.out) - 1) // 4 * 4
    run(batch, running, 20)
    assert batch.size == 0 and not running
    for r in (long_, short, follow):
        assert r.out == stock_alone(model, r)


def test_rows_of_other_namespaces_and_cache_prompt_false_are_never_committed_or_read(join):
    model = shared(MODEL)
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    plain = Row(tokens(24, 10), 6)
    running: dict = {}
    join(batch, model, store, [plain], running, cache_prompt=False)
    run(batch, running, 10)
    assert plain.out == stock_alone(model, plain)
    assert store.stats()["inserted_tokens"] == 0 and store.stats()["cached_blocks"] == 0
    again = Row(plain.prompt + plain.out, 3)
    join(batch, model, store, [again], running)
    assert again.cached == 0  # nothing of the cache_prompt=false row was stored
    run(batch, running, 5)
    other = Row(plain.prompt + plain.out, 3, namespace="tenant-b")
    join(batch, model, store, [other], running)
    assert other.cached == 0  # the first namespace's reply is not another tenant's
    run(batch, running, 5)
    assert other.out == again.out == stock_alone(model, again)


def test_an_eos_ends_a_row_and_nothing_after_it_is_committed():
    model = build(MODEL)
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    row = Row(tokens(12, 12), 8)
    running: dict = {}
    admit(batch, model, store, [row], running)
    logits = batch.step()
    batch.set_next([EOS])  # as if EOS was picked: the row ends before feeding it
    row.out.append(EOS)
    assert logits.shape == (1, model.config.vocab_size)
    batch.remove([0])
    assert batch.rows == [] and batch.compact() == [] and batch.size == 0
    running.clear()
    probe = Row(row.prompt + row.out[:1] + [EOS] + tokens(8, 13), 2)
    admit(batch, model, store, [probe], running)
    # the prompt and the fed reply token are stored; the EOS never was (no KV for it)
    assert probe.cached == (len(row.prompt) + 1) // 4 * 4


@pytest.mark.parametrize(
    "name, why",
    [("mistral-sliding", "sliding"), ("gemma2-sliding", "layers of types"), ("llama4-text-chunked", "types")],
)
def test_models_the_layout_cannot_hold_are_refused_with_a_reason(name, why):
    reason = unsupported_reason(build(name))
    assert reason is not None and why in reason


def test_m_rope_and_encoder_decoder_configs_are_refused():
    from types import SimpleNamespace

    from transformers import AutoConfig

    qwen_vl = SimpleNamespace(config=AutoConfig.for_model("qwen2_vl"), get_rope_index=lambda *a: None)
    mrope = AutoConfig.for_model("llama", rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12]})
    t5 = AutoConfig.for_model("t5")
    assert "M-RoPE" in unsupported_reason(qwen_vl)
    assert "M-RoPE" in unsupported_reason(SimpleNamespace(config=mrope))
    assert "encoder-decoder" in unsupported_reason(SimpleNamespace(config=t5))


def test_bad_calls_are_refused_with_the_part_named_and_change_nothing(join):
    model = shared(MODEL)
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    running: dict = {}
    row = Row(tokens(10, 20), 4)
    join(batch, model, store, [row], running)
    before = (batch.size, batch.width, batch.ids.clone(), batch.mask.clone())
    # a row as wide as the batch (its KV columns: a row's own, fewer where it reads the pool)
    kv = [
        (k.new_zeros(1, k.shape[1], batch.width, k.shape[3]),) * 2
        for k in (la.keys for la in batch.cache.layers)
    ]
    ids, mask = left_pad([tokens(batch.width, 21)])
    with pytest.raises(ValueError, match="first tokens"):
        batch.admit(kv, ids, mask, [1, 2])
    with pytest.raises(ValueError, match="layers"):
        batch.admit(kv[:1], ids, mask, [1])
    with pytest.raises(ValueError, match="left padding"):
        batch.admit(kv, ids, torch.tensor([[0] + [1] * (batch.width - 2) + [0]]), [1])
    with pytest.raises(ValueError, match="holds no row"):
        batch.remove([batch.size])  # no such slot
    with pytest.raises(ValueError, match="tokens for"):
        batch.set_next([1, 2, 3])
    after = (batch.size, batch.width, batch.ids, batch.mask)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])
    run(batch, running, 10)
    assert row.out == stock_alone(model, row)
    with pytest.raises(ValueError, match="no rows"):
        batch.step()


def test_a_row_is_not_committed_when_the_weights_changed_while_it_decoded(join):
    model = build(MODEL)
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    running: dict = {}
    row = Row(tokens(9, 30), 8)
    join(batch, model, store, [row], running)
    run(batch, running, 3)
    inserted = store.stats()["inserted_tokens"]
    with torch.no_grad():
        next(model.parameters()).mul_(1.0)  # an in-place write: a new version of the weights
    assert batch.remove(list(running)) == 0
    assert store.stats()["inserted_tokens"] == inserted


def test_the_builtin_llama_is_supported():
    assert unsupported_reason(shared(MODEL)) is None


# -- the engine's step loop (demo.engine.step_loop) ------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    from demo.api.app import build_engine
    from demo.config import Config

    e = build_engine(Config(model="builtin-tiny", cache_tokens=1 << 15, max_batch_size=8))
    cfg = e.model.generation_config
    cfg.suppress_tokens = [*(cfg.suppress_tokens or []), *e.runner.eos]  # rows end only where we say
    assert e.loop is not None
    return e


def engine_stock(engine, ids: list[int], p) -> str:
    """Stock generate() of the request alone, no cache (greedy, or sampled after manual_seed)."""
    cfg = engine.runner.config(p)
    if p.sampled:
        torch.manual_seed(p.seed % 2**64)
    t = torch.tensor([ids])
    out = engine.model.generate(t, attention_mask=torch.ones_like(t), generation_config=cfg)
    return engine.decode(out[0, len(ids) :].tolist())


def spy_steps(engine, monkeypatch) -> list[set]:
    """Per step of the loop (first tokens at admission included): the requests that made a token."""
    from demo.engine.step_loop import StepLoop

    steps, emit = [], StepLoop._emit

    def spy(loop, indices, tokens, logprobs):
        steps.append({id(loop.rows[i].gen) for i in indices})
        return emit(loop, indices, tokens, logprobs)

    monkeypatch.setattr(StepLoop, "_emit", spy)
    return steps


def wait_for(predicate, seconds: float = 60) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def settle(engine) -> None:
    """Wait until no request runs: the worker counts a batch as running until its generate()
    call or step loop has returned, a moment after the last reply reached its client (collect()
    returns then; on a busy machine the test can look in between). A request left running for
    good fails here (timed out)."""
    wait_for(lambda: engine.running == 0)


def test_a_newcomer_with_other_options_joins_the_running_rows_between_steps(engine, monkeypatch):
    """Issue 27 item 3: a request arriving while rows decode is admitted between two steps and
    makes its first token in a step the long rows share (they are still running); every reply
    equals stock generate() of it alone; no batch paused."""
    from demo.engine.engine import Params

    steps = spy_steps(engine, monkeypatch)
    pauses, admissions = engine.scheduler.pauses, engine.scheduler.admissions
    long_ids = [engine.text_ids(f"long row {i} tells a story about Porto") for i in range(2)]
    long_p = [Params(80, temperature=0.0), Params(80, temperature=0.8, seed=21, top_p=0.9)]
    longs = [engine.submit(i, p) for i, p in zip(long_ids, long_p)]
    wait_for(lambda: all(g.generated >= 3 for g in longs))
    short_ids = engine.text_ids("a quick one")
    short_p = Params(4, temperature=1.1, seed=5, top_p=0.8)
    short = engine.submit(short_ids, short_p)
    short_result = short.collect()
    results = [g.collect() for g in longs]
    together = [s for s in steps if id(short) in s and all(id(g) in s for g in longs)]
    assert len(together) >= 3  # its later tokens came in the long rows' steps
    assert engine.scheduler.admissions > admissions and engine.scheduler.pauses == pauses
    assert short_result.text == engine_stock(engine, short_ids, short_p)
    for ids, p, r in zip(long_ids, long_p, results):
        assert r.text == engine_stock(engine, ids, p) and r.completion_tokens == 80
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_a_hang_up_mid_batch_ends_that_row_only_and_its_kv_so_far_is_stored(engine, monkeypatch):
    from demo.engine.engine import Disconnected, Params
    from tests.engine_gate import Held

    ids = [engine.text_ids(f"row {i} about Lima and its long history of fish") for i in range(3)]
    ps = [Params(30, temperature=0.0), Params(40, temperature=0.9, seed=8), Params(25, temperature=0.0)]
    held = Held(engine, monkeypatch)
    gens = [engine.submit(i, p) for i, p in zip(ids, ps)]
    gens[1].alive = lambda: gens[1].generated < 6  # its client leaves after a few tokens
    held.go()
    with pytest.raises(Disconnected):
        gens[1].collect()
    others = [gens[0].collect(), gens[2].collect()]
    monkeypatch.undo()
    assert 6 <= gens[1].generated < 40 and gens[1].finished.is_set()
    assert [r.text for r in others] == [engine_stock(engine, ids[k], ps[k]) for k in (0, 2)]
    follow = engine.submit(ids[1], Params(2, temperature=0.0)).collect()
    assert follow.cached_tokens == (len(ids[1]) - 1) // 16 * 16  # its prompt was stored
    engine.check_invariants()
    settle(engine)
    assert engine.stats()["pinned_blocks"] == 0 and engine.running == 0


def test_cache_prompt_false_rows_decode_beside_cached_rows_and_never_touch_the_store(engine, monkeypatch):
    from demo.engine.engine import Params
    from tests.engine_gate import Held, collect_all

    ids = [engine.text_ids(f"private {i}: the table of Quito rows and their jobs") for i in range(2)]
    cached = engine.text_ids("a cached neighbour with its own words")
    ps = [
        Params(9, temperature=0.0, cache_prompt=False),
        Params(7, temperature=0.9, seed=1, cache_prompt=False),
    ]
    held = Held(engine, monkeypatch)
    gens = [engine.submit(i, p) for i, p in zip(ids, ps)]
    neighbour = engine.submit(cached, Params(8, temperature=0.0))
    held.go()
    out = collect_all([*gens, neighbour])
    monkeypatch.undo()
    assert [r.text for r in out[:2]] == [engine_stock(engine, i, p) for i, p in zip(ids, ps)]
    assert out[2].text == engine_stock(engine, cached, Params(8, temperature=0.0))
    for i in ids:  # nothing of theirs was stored: the same prompts read nothing back
        assert engine.submit(i, Params(1, temperature=0.0)).collect().cached_tokens == 0
    assert engine.submit(cached, Params(1, temperature=0.0)).collect().cached_tokens > 0  # its was
    engine.check_invariants()


@pytest.mark.parametrize("rows_tokens", [60, 6])
def test_a_request_too_wide_for_the_rows_runs_aside_in_chunks_between_their_steps(
    engine, monkeypatch, rows_tokens
):
    """A prompt that fits no row beside the running ones under max_batch_tokens is not made to
    wait for them to end (nor does it block the queue): it runs one decode chunk at a time on
    the generate() path between the loop's steps; once the rows are gone, it goes on in the loop
    from its reply so far. Every reply equals stock generate()."""
    import threading

    from demo.engine.engine import Params
    from demo.engine.step_loop import StepLoop

    monkeypatch.setattr(engine.scheduler, "prefill_chunk", 0)  # no slices: it is wide at once
    monkeypatch.setattr(engine.scheduler, "decode_chunk", 4)
    asides = engine.scheduler.asides
    rows = [engine.text_ids(f"narrow row {i} ({rows_tokens}) about Rome") for i in range(2)]
    wide = engine.text_ids(
        f"a wide prompt ({rows_tokens}): " + " ".join(f"Omar {i} is a baker in Tunis." for i in range(25))
    )
    monkeypatch.setattr(engine.scheduler, "max_batch_tokens", len(wide) * 2)  # it fits alone, not with 2 rows
    queued, step = threading.Event(), StepLoop._step

    def gated(loop):  # after the rows' second token, the loop waits for the wide request to queue
        if not queued.is_set() and loop._live() and loop.made[loop._live()[0]] >= 2:
            wait_for(lambda: engine.queued > 0)
            queued.set()
        return step(loop)

    monkeypatch.setattr(StepLoop, "_step", gated)
    gens = [engine.submit(i, Params(rows_tokens, temperature=0.0)) for i in rows]
    wait_for(lambda: all(g.generated >= 2 for g in gens))
    progress, run = [], engine.runner.run

    def spy(batch, *args):
        progress.append(gens[0].generated)
        return run(batch, *args)

    monkeypatch.setattr(engine.runner, "run", spy)
    wide_p = Params(40, temperature=0.8, seed=9, top_logprobs=2)
    wide_result = engine.submit(wide, wide_p).collect()
    results = [g.collect() for g in gens]
    monkeypatch.undo()
    assert queued.is_set()
    assert wide_result.text == engine_stock(engine, wide, wide_p)
    assert wide_result.completion_tokens == 40 == len(wide_result.choices[0].logprobs)
    want = [engine_stock(engine, i, Params(rows_tokens, temperature=0.0)) for i in rows]
    assert [r.text for r in results] == want
    assert engine.scheduler.asides - asides == len(progress) >= 1  # chunks of 4 tokens
    assert progress == sorted(progress)  # the rows went on between its chunks
    if rows_tokens == 60:  # all 10 chunks aside while the rows decode
        assert len(progress) == 10 and progress[-1] > progress[0]
    else:  # the rows ended after a few of its chunks: it went on in the loop, from its reply so far
        assert len(progress) < 10


def test_shutdown_returns_once_the_cut_rows_left_with_their_kv_stored():
    """Engine.shutdown: the loop lets go of the model lock between steps, so shutdown waits until
    no request runs (the cut rows removed, their prompt + reply so far committed), not merely for
    the lock: the shutdown save and the sidecar hand-over then find the reply's KV."""
    from demo.api.app import build_engine
    from demo.config import Config
    from demo.engine.engine import Params

    e = build_engine(Config(model="builtin-tiny", cache_tokens=1 << 15, max_batch_size=8))
    cfg = e.model.generation_config
    cfg.suppress_tokens = [*(cfg.suppress_tokens or []), *e.runner.eos]
    assert e.loop is not None
    ids = e.text_ids("a long reply about Lima, its rivers and its fish markets")
    gen = e.submit(ids, Params(400, temperature=0.0))
    wait_for(lambda: gen.generated >= 40)
    e.shutdown(wait=30)
    assert e.running == 0 and gen.finished.is_set()
    made = gen.generated  # tokens streamed; all but the last were fed, so have KV
    block = e.store.pool.block_size
    assert e.stats()["cached_blocks"] * block >= (len(ids) + made - 1) // block * block
    e.check_invariants()


def test_a_failure_after_the_admission_prefill_answers_the_newcomers_and_the_rows(engine, monkeypatch):
    """Splicing newcomers' prefilled KV into the batch can fail (memory, say): every request of
    the loop, the newcomers included, gets the error (none waits forever), and the next request
    is served as stock."""
    from demo.engine.engine import Params
    from hf_patch.running_batch import RunningBatch

    ids = [engine.text_ids(f"request {i} about the harbour of Lima") for i in range(2)]
    monkeypatch.setattr(RunningBatch, "packed", property(lambda self: False))  # prefill calls
    calls, admit = [], RunningBatch.admit

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return admit(self, *args, **kwargs)

    monkeypatch.setattr(RunningBatch, "admit", failing)
    first = engine.submit(ids[0], Params(200, temperature=0.0))
    wait_for(lambda: first.generated >= 3)
    newcomer = engine.submit(ids[1], Params(5, temperature=0.0))
    for gen in (first, newcomer):
        with pytest.raises(RuntimeError, match="simulated"):
            gen.collect()
    monkeypatch.undo()
    assert len(calls) == 2
    after = engine.submit(ids[1], Params(5, temperature=0.0)).collect()
    assert after.text == engine_stock(engine, ids[1], Params(5, temperature=0.0))
    engine.check_invariants()
    settle(engine)
    assert engine.stats()["pinned_blocks"] == 0 and engine.running == 0


def test_a_store_read_failing_while_seating_answers_the_newcomers_and_the_rows_go_on(engine, monkeypatch):
    """Seating newcomers for a packed step reads their cached prefixes; if a read fails (a
    remote tier gone, say) the newcomers get the error, none is left half-seated, the running
    row finishes as stock, and the next request is served as stock."""
    from demo.engine.engine import Params
    from hf_patch.running_batch import packs

    assert packs(engine.model)
    cached = engine.text_ids("a question about the harbour of Quito, asked twice")
    engine.submit(cached, Params(3, temperature=0.0)).collect()  # its prompt is in the store now
    running_ids = engine.text_ids("a long answer about the ships of Porto")
    store = engine.store
    first = engine.submit(running_ids, Params(60, temperature=0.0))
    wait_for(lambda: first.generated >= 3)

    def failing(*args, **kwargs):
        raise RuntimeError("store read failed (simulated)")

    monkeypatch.setattr(store, "read", failing)
    monkeypatch.setattr(store, "read_in_place", failing)  # (a prefix read in place: RunningBatch.pools)
    newcomer = engine.submit(cached, Params(5, temperature=0.0))
    with pytest.raises(RuntimeError, match="simulated"):
        newcomer.collect()
    monkeypatch.undo()
    assert first.collect().text == engine_stock(engine, running_ids, Params(60, temperature=0.0))
    after = engine.submit(cached, Params(5, temperature=0.0)).collect()
    assert after.text == engine_stock(engine, cached, Params(5, temperature=0.0))
    engine.check_invariants()
    settle(engine)
    assert engine.stats()["pinned_blocks"] == 0 and engine.running == 0


def test_a_failing_step_with_newcomers_answers_them_and_the_running_rows_go_on(engine, monkeypatch):
    """The step that computes newcomers' prompts beside the running rows fails (memory on a big
    prompt, say): the newcomers get the error, the running row steps again without them and
    ends as stock."""
    from demo.engine.engine import Params
    from hf_patch.running_batch import packs
    from tests.test_packed_step import fail_prompt_steps

    assert packs(engine.model)
    running_ids = engine.text_ids("a long answer about the lighthouses of Porto")
    first = engine.submit(running_ids, Params(40, temperature=0.0))
    wait_for(lambda: first.generated >= 3)
    fail_prompt_steps(monkeypatch)
    newcomer = engine.submit(engine.text_ids("a newcomer asking about Lima"), Params(5, temperature=0.0))
    with pytest.raises(MemoryError, match="simulated"):
        newcomer.collect()
    monkeypatch.undo()
    assert first.collect().text == engine_stock(engine, running_ids, Params(40, temperature=0.0))
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_a_sliced_prompt_reports_what_the_store_held_of_all_of_it(engine, monkeypatch):
    """A long prompt taken while rows decode is prefilled in slices; its cached_tokens is what
    the store held of the whole prompt when it came (a lookup), not what its first slice read."""
    from demo.engine.engine import Params

    document = engine.text_ids(" ".join(f"row {i}: Lima, Quito, Porto and Rome." for i in range(30)))
    assert len(document) > 2 * engine.scheduler.prefill_chunk
    engine.submit(document + engine.text_ids(" first?"), Params(2, temperature=0.0)).collect()
    slices, prefill = [], engine.runner.prefill
    monkeypatch.setattr(engine.runner, "prefill", lambda g: slices.append(g.slice_to) or prefill(g))
    running_ids = engine.text_ids("a long answer about the ships of Porto")
    running = engine.submit(running_ids, Params(40, temperature=0.0))
    wait_for(lambda: running.generated >= 3)
    # more than a slice past the cached document: sliced from where the store's prefix ends
    more = engine.text_ids(" ".join(f"then {i}: Oslo, Cairo and Lima." for i in range(25)) + " second?")
    assert len(more) > engine.scheduler.prefill_chunk
    ask = document + more
    r = engine.submit(ask, Params(3, temperature=0.0)).collect()
    assert slices, "it was not sliced: the test no longer covers the slice path"
    assert slices[0] > len(document)  # its first slice starts past the held document
    assert r.cached_tokens == len(document) // 16 * 16  # the whole cached document, in blocks
    assert r.text == engine_stock(engine, ask, Params(3, temperature=0.0))
    assert running.collect().text == engine_stock(engine, running_ids, Params(40, temperature=0.0))


def test_n_choices_one_ending_at_its_first_token_leaves_the_other_one_row(engine, monkeypatch):
    """n=2 sampled choices join through a prefill call; where one choice's first token is an EOS
    the other is left, and the same admission must not seat it again (it then held two slots and
    got two tokens per step). Every reply equals the same request on the generate() path."""
    from demo.engine.engine import Params
    from tests.engine_gate import generate_path

    cfg = engine.model.generation_config
    monkeypatch.setattr(
        cfg, "suppress_tokens", [t for t in cfg.suppress_tokens if t not in engine.runner.eos]
    )
    eos = min(engine.runner.eos)
    ids = engine.text_ids("tell me about the harbour of Lima")
    running_ids = engine.text_ids("a long answer about the ships of Porto")
    first_token_eos = 0
    for seed in range(20):
        p = Params(8, temperature=1.0, seed=seed, n=2, logit_bias=((eos, 6.0),))
        running = engine.submit(running_ids, Params(30, temperature=0.0, logit_bias=((eos, -100.0),)))
        wait_for(lambda r=running: r.generated >= 2)  # the n=2 request joins a running batch
        loop = engine.submit(ids, p).collect()
        running.collect()
        with pytest.MonkeyPatch.context() as m:
            generate_path(engine, m)
            ref = engine.submit(ids, p).collect()
        assert [(c.text, c.finish_reason) for c in loop.choices] == [
            (c.text, c.finish_reason) for c in ref.choices
        ], seed
        assert loop.completion_tokens == ref.completion_tokens <= 2 * 8
        ended = [c.completion_tokens == 1 and c.finish_reason == "stop" for c in ref.choices]
        first_token_eos += sum(ended) == 1  # one choice ended at its first token, one goes on
    assert first_token_eos >= 2  # the case this test is about happened
    settle(engine)
    engine.check_invariants()
    assert engine.running == 0


def test_a_seat_failing_after_widening_the_batch_leaves_the_running_rows_sampler_on_their_tokens(
    engine, monkeypatch
):
    """A newcomer wider than the batch re-lays it out (every running row's columns move) and
    then its store read fails: the running row's hook must still see its own tokens (prompt +
    reply so far, no padding), as the sampler is rebuilt over the new layout."""
    from demo.engine.engine import Params

    wide = engine.text_ids(
        "a much wider question about the harbour of Lima, its boats, its markets and streets"
    )
    engine.submit(wide, Params(2, temperature=0.0)).collect()  # cached: seating it reads the store
    running_ids = engine.text_ids("short: Porto")
    seen = []

    def hook(ids, scores):
        seen.append(ids.tolist())
        return scores

    running = engine.submit(running_ids, Params(30, temperature=0.0), hooks=[hook])
    wait_for(lambda: running.generated >= 3)

    def failing(*args, **kwargs):
        raise RuntimeError("store read failed (simulated)")

    with monkeypatch.context() as m:
        m.setattr(engine.store, "read", failing)
        m.setattr(engine.store, "read_in_place", failing)  # (a prefix read in place: RunningBatch.pools)
        with pytest.raises(RuntimeError, match="simulated"):
            engine.submit(wide, Params(3, temperature=0.0)).collect()
    assert running.collect().text == engine_stock(engine, running_ids, Params(30, temperature=0.0))
    assert len(seen) == 30 and all(ids[: len(running_ids)] == running_ids for ids in seen)
    assert [len(ids) for ids in seen] == list(range(len(running_ids), len(running_ids) + 30))
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_a_failing_commit_of_a_seated_prompt_costs_its_cache_entry_only(engine, monkeypatch, caplog):
    """The commit of a newcomer's prompt after the step that computed it fails (the store's, a
    remote tier's): the prompt is not cached and that is logged; the newcomer and the running
    row both reply as stock (it failed every running request before)."""
    from demo.engine.engine import Params
    from hf_patch.running_batch import RunningBatch

    running_ids = engine.text_ids("a long answer about the bridges of Porto")
    newcomer_ids = engine.text_ids("a newcomer asking about the bakers of Lima and their bread")
    running = engine.submit(running_ids, Params(40, temperature=0.0))
    wait_for(lambda: running.generated >= 3)
    commit = RunningBatch.commit

    def failing(batch, i):
        if batch.pending[i] == 0 and i in batch._seated_now:
            raise RuntimeError("store commit failed (simulated)")
        return commit(batch, i)

    seated = RunningBatch._commit_seated

    def spy(batch):
        batch._seated_now = set(batch._seated)
        seated(batch)
        batch._seated_now = set()

    monkeypatch.setattr(RunningBatch, "commit", failing)
    monkeypatch.setattr(RunningBatch, "_commit_seated", spy)
    monkeypatch.setattr(RunningBatch, "_seated_now", set(), raising=False)
    with caplog.at_level("ERROR", logger="hf_patch.running_batch"):
        newcomer = engine.submit(newcomer_ids, Params(5, temperature=0.0)).collect()
    monkeypatch.undo()
    assert newcomer.text == engine_stock(engine, newcomer_ids, Params(5, temperature=0.0))
    assert running.collect().text == engine_stock(engine, running_ids, Params(40, temperature=0.0))
    assert "it may not be cached" in caplog.text and "simulated" in caplog.text
    # the newcomer's reply was committed when it left: asking again hits its prompt
    again = engine.submit(newcomer_ids, Params(5, temperature=0.0)).collect()
    assert again.cached_tokens > 0
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0
