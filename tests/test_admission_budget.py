"""The step loop's admission budget (--max-prefill-tokens, issue 27 item 3): between two decode
steps newcomers join only up to that many prompt tokens to compute, the first in line always
(none starves, however long), the rest at the next steps in order; every reply equals stock
generate() of the request alone."""

from __future__ import annotations

import pytest

from demo.engine.generation import Generation, Params
from demo.engine.scheduler import Scheduler
from tests.engine_gate import Held, collect_all
from tests.test_step_loop import engine, engine_stock  # noqa: F401  (the module's engine fixture)


def gen(name: str, length: int, **options) -> Generation:
    g = Generation(list(range(1, length + 1)), Params(4, **options), None, lambda ids: "", set())
    g.name = name
    return g


def take(sched: Scheduler, gens: list[Generation] = ()) -> list[str]:
    """Queue ``gens``, then one take_newcomers between two steps of 2 rows in 4 slots of 64
    columns; returns the names admitted."""
    for g in gens:
        sched.submit(g, sched.reserve())
    taken, sliced, aside = sched.take_newcomers(2, 64, False, lambda g: True, 4)
    assert sliced is None and aside is None
    return [g.name for g in taken]


def test_newcomers_join_within_the_budget_in_order_the_first_always():
    sched = Scheduler(max_queue=32, max_batch_size=32, max_batch_tokens=1 << 20, max_prefill_tokens=10)
    # 4 + 4 fit in 10; C would make 12: it and everyone behind it (E fits, but never
    # overtakes) wait for the next step
    assert take(sched, [gen("A", 4), gen("B", 4), gen("C", 4), gen("D", 12), gen("E", 3)]) == ["A", "B"]
    assert [g.name for g in sched._waiting] == ["C", "D", "E"]
    assert take(sched) == ["C"]  # D (12) would pass the budget beside it
    assert take(sched) == ["D"]  # over the budget alone: first in line, it joins
    assert take(sched) == ["E"]
    assert take(sched) == [] and sched.admissions == 5
    # 0: no budget, every newcomer that fits joins at once
    sched = Scheduler(max_queue=32, max_batch_size=32, max_batch_tokens=1 << 20)
    assert take(sched, [gen("A", 40), gen("B", 40), gen("C", 40)]) == ["A", "B", "C"]


def test_the_budget_counts_what_prefill_slices_left_and_n_rows_once():
    sched = Scheduler(max_queue=32, max_batch_size=32, max_batch_tokens=1 << 20, max_prefill_tokens=10)
    sliced = gen("S", 40)
    sliced.prefilled = 36  # its slices put 36 tokens in the store: 4 left to compute
    sampled = gen("N", 5, temperature=0.8, n=3)  # three rows over one prompt: 5 tokens
    assert Scheduler.prefill_cost(sliced) == 4 and Scheduler.prefill_cost(sampled) == 5
    assert take(sched, [sliced, sampled, gen("X", 2)]) == ["S", "N"]
    assert take(sched) == ["X"]


def test_the_first_batch_of_an_idle_step_loop_keeps_the_budget_too():
    sched = Scheduler(max_queue=32, max_batch_size=32, max_batch_tokens=1 << 20, max_prefill_tokens=10)
    sched.path = lambda g: True  # every request is the step loop's
    for g in [gen("A", 6), gen("B", 4), gen("C", 3), gen("D", 1)]:
        sched.submit(g, sched.reserve())
    assert [g.name for g in sched.next_batch()] == ["A", "B"]
    assert take(sched) == ["C", "D"]
    # a long prompt in between takes its slices first: it neither joins nor uses the budget
    sched = Scheduler(
        max_queue=32, max_batch_size=32, max_batch_tokens=1 << 20, prefill_chunk=16, max_prefill_tokens=10
    )
    sched.path = lambda g: True
    for g in [gen("A", 6), gen("L", 40), gen("B", 3), gen("C", 2)]:
        sched.submit(g, sched.reserve())
    assert [g.name for g in sched.next_batch()] == ["A", "B"]  # C: 11 > 10, next step
    assert [g.name for g in sched._waiting] == ["L", "C"]
    sched._waiting.clear()
    # the generate() path's batches are not the step loop's: no budget there
    sched.path = lambda g: False
    for g in [gen("A", 6), gen("B", 6)]:
        sched.submit(g, sched.reserve())
    assert [g.name for g in sched.next_batch()] == ["A", "B"]


@pytest.mark.parametrize("bad", [-1, -100])
def test_a_negative_budget_is_refused_with_its_name(bad):
    from demo.config import Config

    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Scheduler(max_prefill_tokens=bad)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Config(model="builtin-tiny", max_prefill_tokens=bad)


def test_the_flag_and_env_var_set_the_budget(monkeypatch):
    from demo.config import from_args

    assert (
        from_args(["--model", "builtin-tiny", "--max-prefill-tokens", "96"], env={}).max_prefill_tokens == 96
    )
    assert (
        from_args(["--model", "builtin-tiny"], env={"RADIXKV_MAX_PREFILL_TOKENS": "48"}).max_prefill_tokens
        == 48
    )
    assert from_args(["--model", "builtin-tiny", "--max-prefill-tokens", "0"], env={}).max_prefill_tokens == 0
    assert from_args(["--model", "builtin-tiny"], env={}).max_prefill_tokens is None  # the engine's default
    with pytest.raises(ValueError, match="RADIXKV_MAX_PREFILL_TOKENS"):
        from_args(["--model", "builtin-tiny"], env={"RADIXKV_MAX_PREFILL_TOKENS": "lots"})


def test_a_burst_over_the_budget_joins_over_several_steps_each_equal_to_alone(engine, monkeypatch):  # noqa: F811
    """Five newcomers queued at once while a row decodes, a budget of one prompt: they join one
    per step in the order they came (none starved), each admitted while the others decode, and
    every reply, greedy or seeded, equals stock generate() of the request alone."""
    from demo.engine.step_loop import StepLoop

    admitted: list[list[int]] = []
    ids = [engine.text_ids(f"newcomer {i} asks about Quito") for i in range(5)]
    cost = max(len(i) for i in ids)
    monkeypatch.setattr(engine.scheduler, "max_prefill_tokens", cost)

    def options(i: int) -> Params:  # greedy and seeded in turn
        return Params(6, temperature=0.0) if i % 2 == 0 else Params(6, temperature=0.9, seed=3 + i, top_p=0.9)

    long_ids = engine.text_ids("a long row about the harbour of Porto and its ships")
    held = Held(engine, monkeypatch)  # the blocker's admission is held before the spy counts
    admit = StepLoop._join

    def spy(loop, gens):
        admitted.append([id(g) for g in gens])
        return admit(loop, gens)

    monkeypatch.setattr(StepLoop, "_join", spy)
    waits, admissions = sum(engine.scheduler.queue_waits.counts), engine.scheduler.admissions
    running = engine.submit(long_ids, Params(40, temperature=0.0))
    burst = [engine.submit(x, options(i)) for i, x in enumerate(ids)]
    held.go()
    results = collect_all([running, *burst])
    assert admitted == [[id(running)], *[[id(g)] for g in burst]]  # one per step, in order
    # /metrics: each request's admission wait observed once, when it joined
    assert sum(engine.scheduler.queue_waits.counts) == waits + 6
    # with seated newcomers (RunningBatch.seat) the blocker still decodes when the running row
    # comes (its first token comes from the next step), so that row joins its loop too
    from hf_patch.running_batch import packs

    assert engine.scheduler.admissions == admissions + (6 if packs(engine.model) else 5)
    assert results[0].text == engine_stock(engine, long_ids, Params(40, temperature=0.0))
    for i, (x, r) in enumerate(zip(ids, results[1:])):
        assert r.text == engine_stock(engine, x, options(i)) and r.completion_tokens == 6
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_the_default_budget_is_set_where_newcomers_join_inside_steps(engine, monkeypatch):  # noqa: F811
    """By default (None) an engine whose rows join inside decode steps (the CPU kernel:
    RunningBatch.seat) bounds each step's newcomer prompt tokens by twice --max-batch-size, at
    least 64; one whose newcomers join through prefill calls has no budget; 0 is no budget."""
    from demo.engine.engine import Engine
    from hf_patch.running_batch import packs

    assert packs(engine.model)
    built = {}
    for name, kwargs in (
        ("default", {}),
        ("wide", {"max_batch_size": 48}),
        ("off", {"max_prefill_tokens": 0}),
    ):
        e = Engine(engine.model, engine.tokenizer, engine.context, reuse=False, **kwargs)
        built[name] = e.scheduler.max_prefill_tokens
        e.shutdown(5)
    assert built == {"default": 64, "wide": 96, "off": 0}
    monkeypatch.setattr(type(engine.loop.batch), "packed", property(lambda self: False))
    e = Engine(engine.model, engine.tokenizer, engine.context, reuse=False)
    assert e.scheduler.max_prefill_tokens == 0
    e.shutdown(5)


def test_newcomers_sharing_a_cached_document_join_one_step_within_the_default_budget(engine, monkeypatch):  # noqa: F811
    """Where rows join inside steps the budget counts what seating computes: questions about a
    document the store holds cost their own few tokens, so a burst of them joins at once, not
    one per step (the whole document would count 130+ tokens each; each question computes at
    most a block of 16 past the cached whole blocks)."""
    from demo.engine.step_loop import StepLoop
    from hf_patch.running_batch import packs

    assert packs(engine.model)
    monkeypatch.setattr(engine.scheduler, "max_prefill_tokens", 64)
    # under --prefill-chunk (256): not sliced
    document = engine.text_ids(" ".join(f"row {i}: Lima, Quito, Porto and Rome." for i in range(10)))
    assert 128 < len(document) < 240
    engine.submit(document + engine.text_ids(" first question?"), Params(2, temperature=0.0)).collect()
    asks = [document + engine.text_ids(f" question {i}?") for i in range(4)]
    held = Held(engine, monkeypatch)
    joins, join = [], StepLoop._join

    def spy(loop, gens):
        joins.append(len(gens))
        return join(loop, gens)

    monkeypatch.setattr(StepLoop, "_join", spy)
    running = engine.submit(engine.text_ids("a row decoding meanwhile"), Params(20, temperature=0.0))
    burst = [engine.submit(x, Params(3, temperature=0.0)) for x in asks]
    held.go()
    results = collect_all([running, *burst])
    # the running row and three questions in one step (a few prompt tokens each), the fourth
    # at the next; counting the whole document, each would join alone: [1, 1, 1, 1, 1]
    assert joins == [4, 1], joins
    for x, r in zip(asks, results[1:]):
        assert (
            r.text == engine_stock(engine, x, Params(3, temperature=0.0))
            and r.cached_tokens >= len(document) // 16 * 16
        )


def test_the_budget_lookup_counts_the_whole_context_when_it_fails(engine, monkeypatch):  # noqa: F811
    """The lookup runs in the scheduler (under its lock): a failure there (an adapter loading
    meanwhile, a store error) must not lose queued requests: it counts the whole context."""
    from hf_patch import running_batch

    g = Generation(engine.text_ids("a prompt of a few words"), Params(2), None, lambda ids: "", set())

    def failing(*args, **kwargs):
        raise RuntimeError("simulated")

    monkeypatch.setattr(running_batch, "prefill_keys", failing)
    assert engine.loop.uncached(g) == len(g.prompt_ids)
