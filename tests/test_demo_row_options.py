"""Issue 27: every request joins the running batch, whatever its options. Each row of one
generate() call samples with its own options (demo.engine.sampling.RowSampler): a greedy row
equals the request alone and stock generate(); a seeded row equals the same seeded request alone
and stock sampled generate() after torch.manual_seed(seed), whatever shares its batch and
across pauses (its generator, penalty counts and hooks carried by the request); logprobs are the
request's own distribution."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from demo.api.app import build_engine, create_app
from demo.config import Config
from demo.engine.engine import Params
from demo.engine.generation import Generation
from tests.engine_gate import Held, collect_all, generate_path, spy_batches

TEXT = "\n".join(f"| Ines {i} | {40 + i} | Porto | pilot |" for i in range(6))

# One of each option, greedy and sampled; seeds on every sampled request (else nothing to compare).
OPTIONS = [
    dict(temperature=0.0),
    dict(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.4, top_logprobs=3),
    dict(temperature=0.0, logit_bias=((5, 8.0), (7, -100.0))),
    dict(temperature=0.0, repetition_penalty=1.3, n=2),
    dict(temperature=0.9, seed=3),
    dict(temperature=0.7, top_p=0.8, seed=-5, top_logprobs=2),
    dict(temperature=1.2, top_k=12, min_p=0.05, seed=2**63 - 1),
    dict(temperature=1.0, seed=11, n=3, repetition_penalty=1.2),
    dict(temperature=0.8, seed=7, frequency_penalty=0.5, logit_bias=((9, 3.0),)),
]


@pytest.fixture(scope="module")
def engine():
    # no admission budget: the requests queued while the worker is held join in one prefill
    # (the budget is tests/test_admission_budget.py's)
    e = build_engine(
        Config(model="builtin-tiny", cache_tokens=1 << 15, max_batch_size=16, max_prefill_tokens=0)
    )
    cfg = e.model.generation_config
    cfg.suppress_tokens = [*(cfg.suppress_tokens or []), *e.runner.eos]  # rows end only where we say
    return e


def prompts(engine, k: int) -> list[list[int]]:
    return [engine.text_ids(f"request {i} of {k}: " + TEXT[: 30 + 25 * i]) for i in range(k)]


def stock(engine, ids: list[int], p: Params) -> list[str]:
    """Stock generate() alone, no cache: greedy, or sampled after torch.manual_seed(seed)
    (repetition_penalty, top_k, min_p through the generation config)."""
    cfg = engine.runner.config(p)
    cfg.repetition_penalty = p.repetition_penalty
    if p.sampled:
        cfg.top_k, cfg.min_p = p.top_k, p.min_p or None  # top_k 0: off (None would mean 50)
        torch.manual_seed(p.seed % 2**64)
    t = torch.tensor([ids])
    out = engine.model.generate(t, attention_mask=torch.ones_like(t), generation_config=cfg)
    texts = [engine.decode(row[len(ids) :].tolist()) for row in out]
    return texts * (p.n // len(texts))


def params(i: int, max_new: int = 10, **extra) -> Params:
    kw = {k: v for k, v in OPTIONS[i].items()}
    return Params(max_new, **{**kw, **extra})


def check_logprobs(got, want) -> None:
    assert (got is None) == (want is None)
    if got is None:
        return
    assert [t.token for t in got] == [t.token for t in want]
    assert [[i for i, _ in t.top] for t in got] == [[i for i, _ in t.top] for t in want]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want)) < 1e-4


def run_mixed(engine, monkeypatch, pause_every: int | None):
    ids = prompts(engine, len(OPTIONS))
    ps = [params(i, 6 + 2 * i) for i in range(len(OPTIONS))]
    sizes = spy_batches(monkeypatch)
    if pause_every:  # every batch pauses each `pause_every` steps: each request resumes many times
        generate_path(engine, monkeypatch)  # (the step loop never pauses)
        monkeypatch.setattr(
            engine.scheduler, "pause_for", lambda batch: lambda generated: generated >= pause_every
        )
    held = Held(engine, monkeypatch)
    gens = [engine.submit(p, q) for p, q in zip(ids, ps)]
    held.go()
    return ids, ps, collect_all(gens), sizes


@pytest.mark.parametrize("pause_every", [None, 3])
def test_every_option_in_one_batch_equals_alone_and_stock(engine, monkeypatch, pause_every):
    pauses = engine.scheduler.pauses
    ids, ps, batched, sizes = run_mixed(engine, monkeypatch, pause_every)
    assert sizes[1] == len(OPTIONS)  # all of them rows of one generate() call (after the blocker)
    if pause_every:
        assert engine.scheduler.pauses - pauses >= 2 * len(OPTIONS)
    monkeypatch.undo()
    for p, q, r in zip(ids, ps, batched):
        alone = engine.submit(p, q).collect()
        assert [c.text for c in r.choices] == [c.text for c in alone.choices], q
        assert [c.completion_tokens for c in r.choices] == [q.max_new_tokens] * q.n
        for a, b in zip(r.choices, alone.choices):
            check_logprobs(a.logprobs, b.logprobs)
        if not (q.frequency_penalty or q.presence_penalty or q.logit_bias):  # stock has no such options
            assert [c.text for c in r.choices] == stock(engine, p, q), q
    sampled = [r for r, q in zip(batched, ps) if q.n == 3]
    assert len({c.text for c in sampled[0].choices}) > 1  # the n rows really sample independently
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_unseeded_rows_sample_and_logprobs_are_before_temperature(engine, monkeypatch):
    """Unseeded rows draw from their own random generators (two equal requests differ), and a
    sampled row's logprobs equal the greedy request's: the distribution before temperature."""
    ids = prompts(engine, 1)[0]
    held = Held(engine, monkeypatch)
    gens = [engine.submit(ids, Params(12, temperature=1.5, top_logprobs=1)) for _ in range(3)]
    gens.append(engine.submit(ids, Params(1, temperature=0.0, top_logprobs=1)))
    held.go()
    out = collect_all(gens)
    assert len({r.text for r in out[:3]}) > 1
    greedy_first = out[3].choices[0].logprobs[0]
    for r in out[:3]:
        first = r.choices[0].logprobs[0]
        assert first.top[0] == greedy_first.top[0] or abs(first.top[0][1] - greedy_first.top[0][1]) < 1e-5


class BanToken:
    """A RowHook: bans one token from its row, counting the steps it saw (its state)."""

    def __init__(self, token: int):
        self.token, self.steps, self.lengths = token, 0, []

    def __call__(self, ids, scores):
        self.steps += 1
        self.lengths.append(int(ids.shape[0]))
        scores[self.token] = -float("inf")
        return scores


def test_a_row_hook_changes_its_own_row_only_and_keeps_its_state_across_pauses(engine, monkeypatch):
    ids = prompts(engine, 2)
    free = [engine.submit(p, Params(9, temperature=0.0)).collect() for p in ids]
    banned = engine.tokenizer(free[0].text)["input_ids"][2]
    hook = BanToken(banned)
    monkeypatch.setattr(engine.scheduler, "pause_for", lambda batch: lambda generated: generated >= 2)
    held = Held(engine, monkeypatch)
    gens = [
        engine.submit(ids[0], Params(9, temperature=0.0), hooks=[hook]),
        engine.submit(ids[1], Params(9, temperature=0.0)),
    ]
    held.go()
    hooked, other = collect_all(gens)
    assert other.text == free[1].text  # the other row is untouched
    assert banned not in engine.tokenizer(hooked.text)["input_ids"] and hooked.text != free[0].text
    # one call per step of its row, over its own tokens (prompt + reply so far), across pauses
    assert hook.steps == 9 and hook.lengths == list(range(len(ids[0]), len(ids[0]) + 9))
    with pytest.raises(ValueError, match="hooks"):
        engine.submit(ids[0], Params(2, temperature=1.0, n=2), hooks=[hook])


@pytest.mark.parametrize("path", ["step loop", "generate"])
def test_a_newcomer_with_other_options_joins_a_running_batch(engine, monkeypatch, path):
    """Fails on the main branch of before: a request differing in one option (temperature,
    seed) waited for the running generation's end."""
    if path == "generate":
        generate_path(engine, monkeypatch)
    monkeypatch.setattr(engine.scheduler, "decode_chunk", 4)
    sizes = spy_batches(monkeypatch)
    admissions = engine.scheduler.admissions
    long_prompt = engine.text_ids("a long answer: " + TEXT)
    long_params = Params(150, temperature=0.0, logit_bias=((5, 2.0),))
    long_gen = engine.submit(long_prompt, long_params)
    deadline = time.monotonic() + 30
    while engine.running == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    short_params = Params(3, temperature=0.8, seed=42, top_p=0.9)
    short = engine.submit(engine.text_ids("a quick one"), short_params).collect()
    still_running = not long_gen.finished.is_set()
    long_result = long_gen.collect()
    # generate(): it ran as a row of a re-formed batch beside the long one; step loop: it was
    # admitted into the running batch between two of the long one's steps
    assert still_running and (2 in sizes if path == "generate" else engine.scheduler.admissions > admissions)
    assert short.text == stock(engine, engine.text_ids("a quick one"), short_params)[0]
    assert long_result.text == engine.submit(long_prompt, long_params).collect().text


def test_cache_prompt_false_pauses_resumes_and_leaves_the_store_untouched(engine, monkeypatch):
    generate_path(engine, monkeypatch)  # pauses: the path of adapter and image requests
    ids = prompts(engine, 2)
    ps = [
        Params(8, temperature=0.0, cache_prompt=False),
        Params(8, temperature=0.9, seed=1, cache_prompt=False),
    ]
    want = [stock(engine, p, q)[0] for p, q in zip(ids, ps)]
    monkeypatch.setattr(engine.scheduler, "pause_for", lambda batch: lambda generated: generated >= 3)
    before = engine.stats()["inserted_tokens"], engine.stats()["query_tokens"]
    pauses = engine.scheduler.pauses
    held = Held(engine, monkeypatch)
    gens = [engine.submit(p, q) for p, q in zip(ids, ps)]
    held.go()
    out = collect_all(gens)
    assert [r.text for r in out] == want and [r.cached_tokens for r in out] == [0, 0]
    assert engine.scheduler.pauses - pauses >= 4
    stats = engine.stats()
    blocker = len(engine.text_ids("blocker")) + 1  # the Held blocker's own request did use the cache
    assert stats["query_tokens"] - before[1] <= blocker and stats["inserted_tokens"] - before[0] <= blocker


def test_over_http_the_openai_client_gets_per_row_options_in_one_batch(engine, monkeypatch):
    """Mixed options sent at once through the real server and the openai client: each reply
    equals the same request alone; the requests shared generate() calls."""
    import openai

    from demo.api.server import serving

    app = create_app(Config(model="builtin-tiny"), engine)
    bodies = [
        dict(temperature=0),
        dict(temperature=0, logprobs=True, top_logprobs=2, frequency_penalty=1.0),
        dict(temperature=0.9, seed=5, top_p=0.9, logit_bias={"5": 4}),
        dict(
            temperature=1.0, seed=9, n=2, extra_body={"top_k": 20, "min_p": 0.02, "repetition_penalty": 1.1}
        ),
        dict(temperature=0.7, seed=-3, stop=["e"], logprobs=True),
    ]
    texts = [f"http row {i}: " + TEXT[: 40 + 20 * i] for i in range(len(bodies))]
    sizes = spy_batches(monkeypatch)
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def ask(i):
            r = client.chat.completions.create(
                model="builtin-tiny",
                messages=[{"role": "user", "content": texts[i]}],
                max_tokens=8,
                **bodies[i],
            )
            return [
                (c.message.content, [t.logprob for t in c.logprobs.content] if c.logprobs else None)
                for c in r.choices
            ]

        held = Held(engine, monkeypatch)
        out = [None] * len(bodies)
        threads = [
            threading.Thread(target=lambda i=i: out.__setitem__(i, ask(i))) for i in range(len(bodies))
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while engine.queued < len(bodies) and time.monotonic() < deadline:
            time.sleep(0.01)
        held.go()
        for t in threads:
            t.join(120)
        assert max(sizes) == len(bodies)  # all five rows of one generate() call
        monkeypatch.undo()
        for i in range(len(bodies)):
            alone = ask(i)
            assert [c[0] for c in out[i]] == [c[0] for c in alone], bodies[i]
            for (_, a), (_, b) in zip(out[i], alone):
                assert (a is None) == (b is None) and (
                    a is None or max(abs(x - y) for x, y in zip(a, b)) < 1e-4
                )


@pytest.mark.parametrize("path", ["step loop", "generate"])
def test_a_long_prompt_the_store_holds_is_not_sliced_again(engine, monkeypatch, path):
    """A long document asked a second question while rows decode: what the store holds of its
    prompt needs no slices (it was sliced one per step, through the whole cached document); a
    prompt that extends it by more than a slice is sliced from the end of what the store
    holds. The replies equal stock generate()."""
    if path == "generate":
        generate_path(engine, monkeypatch)
    monkeypatch.setattr(engine.scheduler, "decode_chunk", 3)
    monkeypatch.setattr(engine.scheduler, "prefill_chunk", 32)
    ends, prefill = [], engine.runner.prefill

    def spy(gen):
        ends.append(gen.slice_to)
        return prefill(gen)

    monkeypatch.setattr(engine.runner, "prefill", spy)

    def beside_a_running_row(ids, params):
        running = engine.submit(engine.text_ids(f"r{len(ids)}: " + TEXT[:30]), Params(60, temperature=0.0))
        deadline = time.monotonic() + 30
        while running.generated == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        return collect_all([running, engine.submit(ids, params)])[1]

    doc = engine.text_ids(f"a document ({path}) " + TEXT * 3)
    assert len(doc) > 4 * 32
    beside_a_running_row(doc, Params(2, temperature=0.0))
    assert len(ends) >= 4  # cold: sliced
    held = engine.runner.held(Generation(doc, Params(1), None, lambda ids: "", set()), doc)
    assert held >= len(doc) - 2 * engine.store.block_size
    ends.clear()
    question = doc + engine.text_ids(" Who wrote it?")
    answer = beside_a_running_row(question, Params(5, temperature=0.0))
    assert ends == [] and answer.cached_tokens >= held  # read from the store, no slice
    assert answer.text == stock(engine, question, Params(5, temperature=0.0))[0]
    longer = doc + engine.text_ids(" And then: " + TEXT[:300])
    assert len(longer) - held > 32
    answer = beside_a_running_row(longer, Params(3, temperature=0.0))
    assert ends and ends[0] == min(held + 32, len(longer) - 1) and ends[-1] == len(longer) - 1
    assert answer.text == stock(engine, longer, Params(3, temperature=0.0))[0]


@pytest.mark.parametrize("path", ["step loop", "generate"])
def test_a_long_prompt_is_prefilled_in_slices_between_decode_chunks(engine, monkeypatch, path):
    """Issue 27 item 4: a long prompt arriving while rows decode is computed in slices of
    prefill_chunk tokens that take turns with decode chunks (the running rows make tokens
    between its slices), then joins the batch reading its prompt from the store; every reply
    equals stock generate(), and /metrics counts the slices, pauses and resumes. In the step
    loop the slices take turns with single steps, and the prompt is admitted into the running
    batch (no pause)."""
    if path == "generate":
        generate_path(engine, monkeypatch)
    admissions0 = engine.scheduler.admissions
    monkeypatch.setattr(engine.scheduler, "decode_chunk", 3)
    monkeypatch.setattr(engine.scheduler, "prefill_chunk", 32)
    slices0, pauses0 = engine.scheduler.prefill_slices, engine.scheduler.pauses
    events, prefill = [], engine.runner.prefill

    def spy(gen):  # records when each slice ran, against the running rows' progress
        events.append(("slice", gen.slice_to, runner_gen.generated))
        return prefill(gen)

    monkeypatch.setattr(engine.runner, "prefill", spy)
    short = engine.text_ids(f"running row ({path}): " + TEXT[:40])
    long_ = engine.text_ids(f"a long prompt ({path}) " + TEXT * 3)
    assert len(long_) > 4 * 32
    runner_gen = engine.submit(short, Params(60, temperature=0.0))
    deadline = time.monotonic() + 30
    while runner_gen.generated == 0 and time.monotonic() < deadline:
        time.sleep(0.002)
    long_gen = engine.submit(long_, Params(5, temperature=0.7, seed=4))
    results = collect_all([runner_gen, long_gen])
    slices = [e for e in events if e[0] == "slice"]
    ends = [s[1] for s in slices]  # slices of 32 up to the prompt's last token
    assert ends == [*range(32, len(long_) - 1, 32), len(long_) - 1]
    progress = [s[2] for s in slices]
    assert progress == sorted(progress) and progress[-1] > progress[0]  # decoding went on between slices
    assert engine.scheduler.prefill_slices - slices0 == len(slices)
    assert results[0].text == stock(engine, short, Params(60, temperature=0.0))[0]
    assert results[1].text == stock(engine, long_, Params(5, temperature=0.7, seed=4))[0]
    assert results[1].cached_tokens == 0  # a cold prompt: its own slices are no prompt reuse
    if path == "generate":
        assert engine.scheduler.pauses > pauses0
    else:
        assert engine.scheduler.pauses == pauses0 and engine.scheduler.admissions == admissions0 + 1
    text = (
        create_app(Config(model="builtin-tiny"), engine).test_client().get("/metrics").get_data(as_text=True)
    )
    for name in (
        "radixkv_pauses_total",
        "radixkv_resumes_total",
        "radixkv_prefill_slices_total",
        "radixkv_admissions_total",
    ):
        assert f"# TYPE {name} counter" in text
    assert (
        "# TYPE radixkv_rows_per_step histogram" in text
        and "# TYPE radixkv_resume_wait_seconds histogram" in text
    )
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", 1.5),
        ("min_p", "x"),
        ("repetition_penalty", 0),
    ]
    + [("repetition_penalty", 2.5), ("repetition_penalty", -1)],
)
def test_bad_vllm_sampling_fields_are_a_400_naming_the_field(engine, field, value):
    client = create_app(Config(model="builtin-tiny"), engine).test_client()
    r = client.post(
        "/v1/completions", json={"model": "builtin-tiny", "prompt": "hi", "max_tokens": 2, field: value}
    )
    assert r.status_code == 400 and r.get_json()["error"]["param"] == field, r.get_json()


def test_top_k_one_is_greedy_and_off_values_change_nothing(engine):
    """top_k 1 keeps only the most likely token: a sampled request equals greedy; -1 and 0 are off."""
    client = create_app(Config(model="builtin-tiny"), engine).test_client()

    def text(**body):
        r = client.post(
            "/v1/completions", json={"model": "builtin-tiny", "prompt": TEXT, "max_tokens": 8, **body}
        )
        assert r.status_code == 200, r.get_json()
        return r.get_json()["choices"][0]["text"]

    assert text(temperature=1.5, top_k=1, seed=3) == text(temperature=0)
    assert (
        text(temperature=1.0, seed=3, top_k=-1)
        == text(temperature=1.0, seed=3, top_k=0)
        == text(temperature=1.0, seed=3)
    )


def test_newcomers_start_at_the_next_boundary_and_paused_replies_keep_half_the_rows():
    """Scheduler order at a chunk boundary (no model): the oldest first, then requests not
    started yet up to half the rows, then the rest oldest first; the others stay queued in order."""
    from demo.engine.generation import Generation
    from demo.engine.scheduler import Scheduler

    sched = Scheduler(max_queue=32, max_batch_size=4)

    def gen(name, started):
        g = Generation([1, 2, 3], Params(4, temperature=0.0), None, lambda ids: "", set())
        g.name, g.started = name, (1.0 if started else None)
        return g

    queue = [gen(f"P{i}", True) for i in range(5)] + [gen(f"N{i}", False) for i in range(3)]
    for g in queue:
        sched.submit(g, sched.reserve())
    assert [g.name for g in sched.next_batch()] == ["P0", "N0", "N1", "P1"]
    assert [g.name for g in sched._waiting] == ["P2", "P3", "P4", "N2"]
    sched.finished()
    assert [g.name for g in sched.next_batch()] == ["P2", "N2", "P3", "P4"]


def test_a_client_gone_while_its_request_is_paused_is_answered_and_never_resumed(engine, monkeypatch):
    generate_path(engine, monkeypatch)  # pauses: the path of adapter and image requests
    monkeypatch.setattr(engine.scheduler, "pause_for", lambda batch: lambda generated: generated >= 2)
    run, seen = engine.runner.run, []

    def spy(batch, *args):
        seen.append([g.params.seed for g in batch])
        paused = run(batch, *args)
        for g in paused:
            if g.params.seed == 99:
                g.cancel()  # its client hangs up while it waits in the queue, paused
        return paused

    monkeypatch.setattr(engine.runner, "run", spy)
    gone = engine.submit(engine.text_ids("gone soon"), Params(30, temperature=0.9, seed=99))
    stays = engine.submit(engine.text_ids("stays"), Params(8, temperature=0.9, seed=98))
    assert gone.finished.wait(60) and stays.finished.wait(60)
    assert gone.generated == 2  # its first chunk only
    assert sum(99 in s for s in seen) == 1  # never taken into a batch again
    monkeypatch.undo()
    assert (
        stays.collect().text
        == stock(engine, engine.text_ids("stays"), Params(8, temperature=0.9, seed=98))[0]
    )


def test_a_hook_that_raises_fails_its_own_request_only(engine, monkeypatch):
    class Broken:
        def __init__(self):
            self.calls = 0

        def __call__(self, ids, scores):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("grammar exploded")
            return scores

    ids = prompts(engine, 2)
    held = Held(engine, monkeypatch)
    broken = engine.submit(ids[0], Params(8, temperature=0.0), hooks=[Broken()])
    fine = engine.submit(ids[1], Params(8, temperature=0.0))
    held.go()
    with pytest.raises(RuntimeError, match="grammar exploded"):
        broken.collect()
    assert fine.collect().text == stock(engine, ids[1], Params(8, temperature=0.0))[0]
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


@pytest.mark.parametrize(
    "bad", [dict(top_k=-1), dict(min_p=1.5), dict(repetition_penalty=0.0), dict(top_p=0.0), dict(n=0)]
)
def test_engine_params_refuse_values_that_would_fail_a_whole_batch(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Params(4, **bad)


def test_newcomers_fill_free_slots_of_the_step_loop_beyond_rows_times_width():
    """take_newcomers: a newcomer that takes a free slot of the step loop at its width adds no KV
    (the slot's columns are allocated and computed anyway) and joins beyond rows x padded
    width; one that needs a new slot or wider columns joins only if rows x width stays within
    max_batch_tokens; FIFO stops at the first that does not fit."""
    from demo.engine.generation import Generation
    from demo.engine.scheduler import Scheduler

    def gen(name, length):
        g = Generation(list(range(1, length + 1)), Params(4, temperature=0.0), None, lambda ids: "", set())
        g.name = name
        return g

    def take(sched, rows, width, slots, gens):
        for g in gens:
            sched.submit(g, sched.reserve())
        taken, sliced, aside = sched.take_newcomers(rows, width, False, lambda g: True, slots)
        assert sliced is None and aside is None
        left = [g.name for g in sched._waiting]
        sched._waiting.clear()
        return [g.name for g in taken], left

    # 4 rows in 6 slots of 20 columns, cap 100: two free slots take two newcomers at no cost
    # (rows x width alone would refuse the second: 6 x 20 > 100); a third needs a 7th slot
    sched = Scheduler(max_queue=32, max_batch_size=8, max_batch_tokens=100)
    assert take(sched, 4, 20, 6, [gen("A", 3), gen("B", 5), gen("C", 3), gen("D", 3)]) == (
        ["A", "B"],
        ["C", "D"],
    )
    # without slots (None: as many as rows) the cap is rows x width
    assert take(sched, 4, 20, None, [gen("A", 3), gen("B", 5)]) == (["A"], ["B"])
    # a wider newcomer widens every slot: it joins if rows x width fits (5 x 30 = 150 within
    # 200); then a free slot at the new width costs nothing; a 7th slot: 7 x 30 > 200
    sched = Scheduler(max_queue=32, max_batch_size=8, max_batch_tokens=200)
    assert take(sched, 4, 20, 6, [gen("W", 30), gen("A", 3), gen("B", 3)]) == (["W", "A"], ["B"])
    # too wide for rows x width (5 x 41 > 200) although a slot is free: it waits for a chunk
    # aside (none due here), and the one behind it takes the free slot
    assert take(sched, 4, 20, 6, [gen("X", 41), gen("A", 3)]) == (["A"], ["X"])
    # a slot is free but a newcomer needs two rows (n=2 sampled): a 7th slot, 6 x 20 > 100
    sched = Scheduler(max_queue=32, max_batch_size=8, max_batch_tokens=100)
    two = Generation([1, 2, 3], Params(4, temperature=0.7, n=2), None, lambda ids: "", set())
    two.name = "N2"
    assert take(sched, 4, 20, 5, [two, gen("A", 3)]) == ([], ["N2", "A"])
    # max_batch_size still bounds the rows, free slots or not
    sched = Scheduler(max_queue=32, max_batch_size=5, max_batch_tokens=1000)
    assert take(sched, 4, 20, 8, [gen("A", 3), gen("B", 3)]) == (["A"], ["B"])
    with pytest.raises(ValueError, match="5 rows in 4 slots"):
        sched.take_newcomers(5, 20, False, lambda g: True, 4)
