"""Batched generation of queued requests (demo.engine.batching): each row's greedy output equals
what the request gets alone and what stock generate() gives; rows stop on their own
(max_tokens, stop string, EOS, a client gone) and cached_tokens is exact per request.

The worker is held inside a first generate() (a gate) while the requests under test queue
up, so they are taken together as one batch.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from demo.api.app import build_engine, create_app
from demo.config import Config
from demo.engine import batching
from demo.engine.engine import Engine, Params
from tests.engine_gate import Held, collect_all, generate_path
from tests.engine_gate import spy_batches as spy

TABLE = "\n".join(f"| Chen {i} | {20 + i} | Osaka | nurse |" for i in range(12))


@pytest.fixture(scope="module")
def engine():
    # no admission budget: the requests queued while the worker is held join in one prefill
    # (the budget is tests/test_admission_budget.py's)
    e = build_engine(
        Config(model="builtin-tiny", cache_tokens=1 << 15, max_batch_size=8, max_prefill_tokens=0)
    )
    cfg = e.model.generation_config
    cfg.suppress_tokens = [*(cfg.suppress_tokens or []), *e.runner.eos]  # rows end only where we say
    return e


def spy_batches(monkeypatch) -> list[int]:
    """Sizes of the batches of two or more requests (a lone request: no batch)."""
    return spy(monkeypatch, least=2)


def stock(engine, ids: list[int], max_new: int) -> str:
    """Stock generate(), no cache, greedy: the oracle."""
    cfg = engine.runner.config(Params(max_new, temperature=0.0))
    out = engine.model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), generation_config=cfg
    )
    return engine.decode(out[0, len(ids) :].tolist())


def greedy_ids(engine, ids: list[int], max_new: int) -> list[int]:
    cfg = engine.runner.config(Params(max_new, temperature=0.0))
    return engine.model.generate(torch.tensor([ids]), generation_config=cfg)[0, len(ids) :].tolist()


def test_batched_rows_equal_alone_and_stock_with_exact_cached_tokens(engine, monkeypatch):
    shared = engine.chat_ids([{"role": "user", "content": TABLE + "\nwarm the prefix"}])
    engine.submit(shared, Params(2, temperature=0.0)).collect()  # the table is now cached
    prompts = [
        engine.chat_ids([{"role": "user", "content": TABLE + f"\nQuestion {i}: who is {i}?"}])
        for i in range(3)
    ] + [
        engine.text_ids("an unrelated short prompt"),
        engine.text_ids("another one, a little longer than that"),
    ]
    maxes = [6, 14, 9, 3, 11]
    sizes = spy_batches(monkeypatch)
    hits_before = engine.stats()["hit_tokens"]
    held = Held(engine, monkeypatch)
    gens = [engine.submit(p, Params(m, temperature=0.0)) for p, m in zip(prompts, maxes)]
    held.go()
    batched = collect_all(gens)
    assert sizes == [5]
    assert [r.completion_tokens for r in batched] == maxes
    assert [r.finish_reason for r in batched] == ["length"] * 5
    # exact per request: what each row read is what the store counted as hits
    assert sum(r.cached_tokens for r in batched) == engine.stats()["hit_tokens"] - hits_before - 0
    assert all(r.cached_tokens > 0 for r in batched[:3])
    for p, m, r in zip(prompts, maxes, batched):
        assert r.text == stock(engine, p, m)
        alone = engine.submit(p, Params(m, temperature=0.0)).collect()
        assert r.text == alone.text
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_rows_of_different_tenants_share_a_batch_but_never_a_prefix(engine, monkeypatch):
    """Issue 17: tenants (and cache_salts) are rows of one generate(); each row reads what its
    own namespace holds and nothing else, even beside a row of another tenant with the same
    prompt, and its cached_tokens does not depend on what the other rows' tenants had cached."""
    bs = engine.store.block_size

    def question(i):
        return engine.chat_ids([{"role": "user", "content": TABLE + f"\nTenant question {i}: who?"}])

    warm = engine.chat_ids([{"role": "user", "content": TABLE + "\nwarm it for tenant a"}])
    engine.submit(warm, Params(2, temperature=0.0), namespace="tenant-a").collect()
    common = next(i for i, (x, y) in enumerate(zip(warm, question(0))) if x != y)
    prompts = [question(0), question(0), question(1), question(2)]  # one length: no padding
    namespaces = ["tenant-a", "tenant-b", ("tenant-b", "salt"), "tenant-a"]
    maxes = [5, 7, 4, 6]
    sizes = spy_batches(monkeypatch)
    hits_before = engine.stats()["hit_tokens"]
    held = Held(engine, monkeypatch)
    gens = [
        engine.submit(p, Params(m, temperature=0.0), namespace=ns)
        for p, m, ns in zip(prompts, maxes, namespaces)
    ]
    held.go()
    batched = collect_all(gens)
    assert sizes == [4]
    for p, m, r in zip(prompts, maxes, batched):
        assert r.text == stock(engine, p, m)
    cached = [r.cached_tokens for r in batched]
    # tenant b's rows read nothing of the table tenant a cached, nor of row 0's equal prompt;
    # row 3 also reads what row 0 computed for the batch (in-batch sharing within tenant a)
    assert cached[:3] == [common // bs * bs, 0, 0] and cached[3] >= cached[0]
    assert sum(r.cached_tokens for r in batched) == engine.stats()["hit_tokens"] - hits_before
    # each row committed under its own namespace: tenant b reads its own copy now, tenant c nothing
    again = engine.submit(question(0), Params(3, temperature=0.0), namespace="tenant-b").collect()
    assert again.cached_tokens >= len(question(0)) // bs * bs - bs
    other = engine.submit(question(0), Params(3, temperature=0.0), namespace="tenant-c").collect()
    assert other.cached_tokens == 0
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_rows_stop_at_their_own_stop_string_eos_and_hang_up(engine, monkeypatch):
    prompts = [engine.text_ids(f"row {i} of the batch: {TABLE[: 40 * (i + 1)]}") for i in range(4)]
    ref = [stock(engine, p, 12) for p in prompts]
    # a stop string inside row 0's reply; as EOS, a token of row 1's reply that no other
    # reply (nor row 1's before it) contains, so only row 1 ends early, at that step
    stop = ref[0][3:6]
    replies = [greedy_ids(engine, p, 12) for p in prompts]
    others = {t for i, r in enumerate(replies) if i != 1 for t in r}
    step = next(
        k for k in range(2, 10) if replies[1][k] not in others and replies[1][k] not in replies[1][:k]
    )
    eos, row1_ids = replies[1][step], replies[1]
    monkeypatch.setattr(engine.runner, "eos", {eos})
    monkeypatch.setattr(engine.model.generation_config, "eos_token_id", eos)
    sizes = spy_batches(monkeypatch)
    held = Held(engine, monkeypatch)
    params = [Params(12, temperature=0.0, stop=(stop,))] + [Params(12, temperature=0.0)] * 3
    gens = [engine.submit(p, q) for p, q in zip(prompts, params)]
    held.go()
    # row 2's client hangs up after its first delta; the others must not notice
    out, errors = [None] * 4, []

    def run(i):
        try:
            if i == 2:
                for _ in gens[2]:
                    gens[2].cancel()
                    break
                return
            out[i] = gens[i].collect()
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and sizes == [4]
    assert out[0].text == ref[0][: ref[0].index(stop)] and out[0].finish_reason == "stop"
    assert out[1].completion_tokens == step + 1 and out[1].finish_reason == "stop"
    assert out[1].text == engine.decode(row1_ids[: step + 1])
    assert out[3].text == ref[3] and out[3].completion_tokens == 12
    assert gens[2].finished.wait(30) and gens[2].generated < 12
    engine.check_invariants()


def test_batch_size_one_never_batches(engine, monkeypatch):
    sizes = spy_batches(monkeypatch)
    one = Engine(engine.model, engine.tokenizer, engine.context, reuse=False, max_batch_size=1)
    held2 = Held(one, monkeypatch)
    gens = [one.submit(one.text_ids(f"q {i}"), Params(3, temperature=0.0)) for i in range(3)]
    held2.go()
    collect_all(gens)
    assert (
        sizes == []
        and one.scheduler.batch_sizes.counts[0] == 4
        and sum(one.scheduler.batch_sizes.counts) == 4
    )


def test_metrics_show_batch_size_and_queue_wait_histograms(engine, monkeypatch):
    app = create_app(Config(model="builtin-tiny"), engine)
    held = Held(engine, monkeypatch)
    gens = [engine.submit(engine.text_ids(f"metrics {i}"), Params(2, temperature=0.0)) for i in range(3)]
    time.sleep(0.05)
    held.go()
    collect_all(gens)
    text = app.test_client().get("/metrics").get_data(as_text=True)
    assert "# TYPE radixkv_batch_size histogram" in text
    assert "# TYPE radixkv_queue_wait_seconds histogram" in text
    buckets = [line for line in text.splitlines() if line.startswith("radixkv_batch_size_bucket")]
    assert buckets[0].startswith('radixkv_batch_size_bucket{le="1"}') and buckets[-1].startswith(
        'radixkv_batch_size_bucket{le="+Inf"}'
    )
    counts = [int(line.rsplit(" ", 1)[1]) for line in buckets]
    assert counts == sorted(counts)  # cumulative
    total = int(
        next(line for line in text.splitlines() if line.startswith("radixkv_batch_size_count ")).split()[1]
    )
    assert total == counts[-1] == sum(engine.scheduler.batch_sizes.counts)
    assert (
        f'radixkv_batch_size_bucket{{le="2"}} {counts[1]}' in text and counts[2] - counts[1] >= 1
    )  # the 3-row batch
    assert any(line.startswith("radixkv_queue_wait_seconds_sum ") for line in text.splitlines())


def test_batched_penalties_and_logprobs_equal_alone(engine, monkeypatch):
    prompts = [engine.text_ids(f"penalised row {i}: " + "la " * (3 + 4 * i)) for i in range(3)]
    params = Params(8, temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3, top_logprobs=2)
    sizes = spy_batches(monkeypatch)
    held = Held(engine, monkeypatch)
    gens = [engine.submit(p, params) for p in prompts]
    held.go()
    batched = collect_all(gens)
    assert sizes == [3]
    for p, r in zip(prompts, batched):
        alone = engine.submit(p, params).collect()
        assert r.text == alone.text and r.completion_tokens == alone.completion_tokens == 8
        got, want = r.choices[0].logprobs, alone.choices[0].logprobs
        assert [t.token for t in got] == [t.token for t in want]
        assert [[i for i, _ in t.top] for t in got] == [[i for i, _ in t.top] for t in want]
        assert max(abs(a.logprob - b.logprob) for a, b in zip(got, want)) < 1e-4


def test_a_row_that_ends_early_caches_no_padding(engine, monkeypatch):
    """A row that stops before its batch ends is fed pad tokens until the batch ends. They are
    no part of its reply and must not be committed as if they were (each batch would fill the
    pool with up to rows x max_tokens tokens that no prompt will ever match)."""
    short, long_ = (engine.text_ids(f"padding check {i}: " + TABLE[: 150 + 100 * i]) for i in range(2))
    sizes = spy_batches(monkeypatch)
    held = Held(engine, monkeypatch)
    before = engine.stats()["inserted_tokens"]
    gens = [
        engine.submit(short, Params(2, temperature=0.0)),
        engine.submit(long_, Params(40, temperature=0.0)),
    ]
    held.go()
    out = collect_all(gens)
    assert sizes == [2] and [r.completion_tokens for r in out] == [2, 40]
    inserted = engine.stats()["inserted_tokens"] - before
    bs = engine.store.block_size
    # short row: prompt + its 2 tokens (+ 1 end marker at most); long row: prompt + 39 fed tokens
    most = (len(short) + 3) // bs * bs + (len(long_) + 39) // bs * bs
    assert inserted <= most, (inserted, most)
    engine.check_invariants()


def test_a_short_request_joins_a_running_batch_between_decode_chunks(engine, monkeypatch):
    """Issue 17, continuous batching: a request that arrives while a long one generates starts
    at the next chunk boundary and is answered while the long one goes on; the long one pauses,
    resumes from its committed KV (whole blocks hit, a partial block recomputed) and its reply,
    stop string included, equals stock generate() of it alone. cached_tokens is the prompt's.
    (The generate() path, which adapter and image requests take; the step loop's admission is
    tested in tests/test_step_loop.py.)"""
    generate_path(engine, monkeypatch)
    monkeypatch.setattr(engine.scheduler, "decode_chunk", 4)
    long_prompt = engine.text_ids("a long answer about " + TABLE[:300])
    ref = stock(engine, long_prompt, 120)
    stop = ref[len(ref) // 2 : len(ref) // 2 + 4]  # found only after several chunks
    assert ref.index(stop) > 20
    short_prompt = engine.text_ids("a short question")
    sizes = spy_batches(monkeypatch)
    long_gen = engine.submit(long_prompt, Params(120, temperature=0.0, stop=(stop,)))
    deadline = time.monotonic() + 30
    while engine.running == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    short = engine.submit(short_prompt, Params(2, temperature=0.0)).collect()
    long_was_running = not long_gen.finished.is_set()
    long_result = long_gen.collect()
    assert long_was_running  # the short one did not wait for the long one's end
    assert 2 in sizes  # it ran as a row beside the long one
    assert short.text == stock(engine, short_prompt, 2)
    assert long_result.text == ref[: ref.index(stop)] and long_result.finish_reason == "stop"
    assert long_result.cached_tokens == 0  # its prompt was cold; resumed chunks are not prompt reuse
    engine.check_invariants()
    assert engine.stats()["pinned_blocks"] == 0


def test_without_a_waiting_request_or_with_decode_chunk_0_a_batch_never_pauses(engine, monkeypatch):
    generate_path(engine, monkeypatch)  # the path whose batches pause (adapter and image requests)
    sizes = spy_batches(monkeypatch)
    calls = []
    run = batching.run_batch
    monkeypatch.setattr(
        batching, "run_batch", lambda e, gens, *a: calls.append(len(gens)) or run(e, gens, *a)
    )
    monkeypatch.setattr(engine.scheduler, "decode_chunk", 2)
    prompt = engine.text_ids("nobody else is waiting")
    alone = engine.submit(prompt, Params(30, temperature=0.0)).collect()
    assert calls == [1] and sizes == []  # one generate() call for the whole reply
    assert alone.text == stock(engine, prompt, 30)
    monkeypatch.setattr(engine.scheduler, "decode_chunk", 0)
    calls.clear()
    pauses = engine.scheduler.pauses
    held = Held(engine, monkeypatch)
    gens = [engine.submit(prompt, Params(12, temperature=0.0))]
    held.go()
    gens.append(engine.submit(engine.text_ids("waiting behind it"), Params(2, temperature=0.0)))
    collect_all(gens)
    assert engine.scheduler.pauses == pauses  # decode_chunk 0: a batch runs to its end


def test_over_http_a_short_request_is_answered_while_a_long_stream_runs(engine, monkeypatch):
    """The head-of-line case where a user meets it: the real server (waitress) and the openai
    client. A 4-token request sent while a 300-token stream runs is answered before that
    stream ends; both replies equal stock generate()."""
    import openai

    from demo.api.server import serving

    monkeypatch.setattr(engine.scheduler, "decode_chunk", 8)
    app = create_app(Config(model="builtin-tiny"), engine)
    long_text, short_text = "tell me everything about " + TABLE[:200], "and briefly?"
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        pieces, started, done = [], threading.Event(), threading.Event()

        def stream_long():
            stream = client.completions.create(
                model="builtin-tiny", prompt=long_text, max_tokens=300, temperature=0, stream=True
            )
            for chunk in stream:
                pieces.append(chunk.choices[0].text)
                started.set()
            done.set()

        thread = threading.Thread(target=stream_long)
        thread.start()
        assert started.wait(60)
        short = client.completions.create(
            model="builtin-tiny", prompt=short_text, max_tokens=4, temperature=0
        )
        long_still_running = not done.is_set()
        thread.join(120)
    assert long_still_running
    assert short.choices[0].text == stock(engine, engine.text_ids(short_text), 4)
    assert "".join(pieces) == stock(engine, engine.text_ids(long_text), 300)
