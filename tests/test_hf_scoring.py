"""hf_patch.score / score_rolling against an uncached forward of the same input, every family.

The reference is the model's own forward over ``(context + continuation)[:-1]`` with no cache
(lm-eval HFLM's computation): per-token log-probabilities within 1e-5 in fp32, greedy flags
identical, on a cold store, a warm one, with in-batch sharing, deduplicated inputs, truncation,
a PEFT adapter and an uncacheable call. Cached-token counts are checked exactly.
"""

from __future__ import annotations

import pytest
import torch

import hf_patch
from hf_patch import RadixCache, score, score_rolling
from tests.hf_models import (
    FAMILIES,
    build,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    store_for,
    tokens,
)

BS = 4
ATOL = 1e-5
PREAMBLE = tokens(40, seed=1)  # a "few-shot preamble": 10 whole blocks
QUESTIONS = [tokens(5 + q, seed=10 + q) for q in range(3)]
# Three questions x four choices of 1-3 tokens, all after one preamble.
PAIRS = [
    (PREAMBLE + q, tokens(c % 3 + 1, seed=100 + 4 * i + c)) for i, q in enumerate(QUESTIONS) for c in range(4)
]


def reference(model, context, continuation):
    """(token log-probs, is_greedy) from one uncached forward of the unpadded input."""
    with torch.no_grad():
        logits = model(ids((context + continuation)[:-1])).logits[0, -len(continuation) :]
    logprobs = torch.log_softmax(logits, dim=-1)
    cont = torch.tensor(continuation)
    return logprobs.gather(1, cont[:, None])[:, 0], bool((logprobs.argmax(-1) == cont).all())


def assert_same_as_reference(model, pairs, scores):
    assert len(scores) == len(pairs)
    for i, ((context, continuation), s) in enumerate(zip(pairs, scores)):
        expected, greedy = reference(model, context, continuation)
        got = torch.tensor(s.token_logprobs)
        assert got.shape == expected.shape, f"pair {i}: {len(s.token_logprobs)} token log-probs"
        diff = (got - expected).abs().max().item()
        assert diff <= ATOL, f"pair {i}: max abs diff {diff:.3g} > {ATOL}"
        assert s.is_greedy == greedy, f"pair {i}: greedy flag differs"
        assert s.logprob == pytest.approx(float(got.sum()), abs=1e-9)


def reusable_blocks(context, continuation, block_size=BS):
    """What a fully cached input serves: every whole block before the continuation's positions."""
    return (len(context) - 1) // block_size * block_size


def greedy_pair(model, context, n=3):
    """``(context, the argmax continuation of n tokens)``: a pair whose greedy flag is True."""
    sequence = list(context)
    with torch.no_grad():
        for _ in range(n):
            sequence.append(int(model(ids(sequence)).logits[0, -1].argmax()))
    return context, sequence[len(context) :]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_equals_an_uncached_forward_cold_and_warm(family):
    model, store = shared(family), store_for(shared(family), BS)
    pairs = [*PAIRS, greedy_pair(model, PREAMBLE + QUESTIONS[1])]
    cold = score(model, pairs, store=store, batch_size=4)
    assert_same_as_reference(model, pairs, cold)
    assert cold[-1].is_greedy
    # Warm, one row per batch: each input is read from the store up to its continuation.
    warm = score(model, pairs, store=store, batch_size=1)
    assert_same_as_reference(model, pairs, warm)
    assert [s.cached_tokens for s in warm] == [reusable_blocks(c, k) for c, k in pairs]
    store.check_invariants()
    assert store.stats()["pinned_blocks"] == 0, "scoring left blocks pinned"


def forward_tokens(model):
    """A counter of the input tokens every forward of ``model`` is given (pads included)."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    return seen, handle


def test_a_batch_sharing_an_uncached_preamble_computes_it_once():
    model = build("llama-sdpa")
    store = store_for(model, BS)
    pairs = [(PREAMBLE + tokens(6, seed=20 + q), [5 + q]) for q in range(4)]  # 46-token inputs
    seen, handle = forward_tokens(model)
    try:
        scores = score(model, pairs, store=store, batch_size=4)
    finally:
        handle.remove()
    assert_same_as_reference(model, pairs, scores)
    # One forward of the 40 shared tokens, then one of the 6 tokens each row adds.
    assert seen == [40, 4 * 6]
    # The row that computed the preamble reports it as computed, the others as served.
    assert sorted(s.cached_tokens for s in scores) == [0, 40, 40, 40]
    stats = store.stats()
    assert stats["query_tokens"] == 4 * 46 and stats["hit_tokens"] == 3 * 40


def test_pairs_with_one_input_are_computed_once_and_results_come_back_in_order():
    model, store = shared("llama-sdpa"), store_for(shared("llama-sdpa"), BS)
    context = PREAMBLE + QUESTIONS[0]
    pairs = [(context, [c]) for c in (9, 17, 33, 9)] + [(PREAMBLE + QUESTIONS[1], [4, 5])]
    seen, handle = forward_tokens(model)
    try:
        scores = score(model, pairs, store=store, batch_size=8)
    finally:
        handle.remove()
    assert_same_as_reference(model, pairs, scores)
    assert scores[0] == scores[3]
    # Two distinct inputs (45 and 47 tokens): their 40 shared tokens once, then 2 rows x 7 columns.
    assert seen == [40, 2 * 7]
    plain = score(model, pairs, store=store_for(model, BS), dedupe=False)
    flat = [lp for s in scores for lp in s.token_logprobs]
    assert [lp for s in plain for lp in s.token_logprobs] == pytest.approx(flat, abs=ATOL)


def test_inputs_sharing_a_preamble_reuse_it_across_batches_in_any_input_order():
    model, store = shared("llama-sdpa"), store_for(shared("llama-sdpa"), BS)
    other = tokens(40, seed=2)
    pairs = [(pre + tokens(3, seed=30 + i), [7]) for i in range(6) for pre in (PREAMBLE, other)]
    scores = score(model, pairs, store=store, batch_size=2)
    assert_same_as_reference(model, pairs, scores)
    # Sorted by preamble: each preamble is computed once (by the first batch of its three),
    # then 40 tokens hit for the five other inputs over it.
    assert store.stats()["hit_tokens"] == 2 * 5 * 40


def test_max_length_left_truncates_as_lm_eval_does():
    model, store = shared("llama-sdpa"), store_for(shared("llama-sdpa"), BS)
    context, continuation = PREAMBLE + QUESTIONS[2], [8, 9, 10]
    s = score(model, [(context, continuation)], store=store, max_length=20)[0]
    truncated = (context + continuation)[-21:]
    assert_same_as_reference(model, [(truncated[:-3], continuation)], [s])


def test_scored_context_is_served_to_generate_and_back():
    """One store, one key: what scoring committed, generate() reads, and the reverse."""
    model, store = shared("gpt2"), store_for(shared("gpt2"), BS)
    context = PREAMBLE + QUESTIONS[0]
    score(model, [(context, [3])], store=store)
    cache = RadixCache(store=store)
    with torch.no_grad():
        model.generate(ids(context + [3, 4]), past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.cached_tokens == [44]
    prompt = tokens(33, seed=5)
    with torch.no_grad():
        model.generate(
            ids(prompt), past_key_values=RadixCache(store=store), max_new_tokens=4, do_sample=False
        )
    assert score(model, [(prompt + [6, 7], [8])], store=store)[0].cached_tokens == 32


def test_rolling_loglikelihood_sums_its_windows():
    model, store = shared("qwen3"), store_for(shared("qwen3"), BS)
    texts = [tokens(50, seed=40), tokens(7, seed=41), tokens(16, seed=42)]
    totals = score_rolling(model, texts, prefix_token=1, max_length=16, store=store, batch_size=3)
    for text, total in zip(texts, totals):
        windows = hf_patch.rolling_windows(text, 1, 16)
        assert [t for _, cont in windows for t in cont] == text, "every token scored once"
        assert all(len(ctx) + len(cont) - 1 <= 16 for ctx, cont in windows)
        expected = sum(float(reference(model, ctx, cont)[0].sum()) for ctx, cont in windows)
        assert total == pytest.approx(expected, abs=ATOL * len(text))
    assert hf_patch.rolling_windows(list(range(3, 9)), 1, 4) == [([1], [3, 4, 5, 6]), ([4, 5, 6], [7, 8])]


def test_an_uncacheable_call_is_scored_without_the_store():
    """A model whose inputs the key cannot see (a replaced prepare_inputs_for_generation, as PEFT
    prompt learning does) is scored by a plain forward: same numbers, nothing read or committed."""
    model = build("llama-sdpa")
    store = store_for(model, BS)
    model.prepare_inputs_for_generation = model.prepare_inputs_for_generation  # now in vars(model)
    scores = score(model, PAIRS[:5], store=store, batch_size=3)
    assert_same_as_reference(model, PAIRS[:5], scores)
    stats = store.stats()
    assert stats["inserted_tokens"] == 0 and stats["query_tokens"] == 0
    assert stats["uncacheable_requests"] == 2
    assert all(s.cached_tokens == 0 for s in scores)


def test_a_peft_adapter_scores_with_its_own_kv():
    peft = pytest.importorskip("peft")
    base = build("llama-sdpa")
    torch.manual_seed(3)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False
    )
    model = peft.get_peft_model(base, config, adapter_name="x")
    store = store_for(base, BS)
    pairs = PAIRS[:1]
    with_adapter = score(model, pairs, store=store)
    assert_same_as_reference(model, pairs, with_adapter)
    with model.disable_adapter():
        without = score(model, pairs, store=store)
        assert_same_as_reference(model, pairs, without)
    assert without[0].cached_tokens == 0, "the base model read the adapter's KV"
    again = score(model, pairs, store=store)
    assert again[0].cached_tokens == reusable_blocks(*pairs[0])
    assert_same_as_reference(model, pairs, again)


def test_peft_prompt_learning_is_scored_without_the_store():
    """Its wrapper's forward prepends virtual tokens: scored by its own plain forward."""
    peft = pytest.importorskip("peft")
    base = build("llama-sdpa")
    store = store_for(base, BS)
    torch.manual_seed(4)
    model = peft.get_peft_model(base, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    scores = score(model, PAIRS[:3], store=store, batch_size=2)
    for (context, continuation), s in zip(PAIRS[:3], scores):
        with torch.no_grad():
            logits = model(input_ids=ids((context + continuation)[:-1])).logits[0, -len(continuation) :]
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(continuation)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.token_logprobs), expected, atol=ATOL) and s.cached_tokens == 0
    assert store.stats()["query_tokens"] == 0


@pytest.mark.parametrize(
    "pairs, message",
    [
        ([([1, 2], [])], "pair 0: the context and the continuation"),
        ([([3], [4]), ([], [4])], "pair 1: the context and the continuation"),
        ([([3, "x"], [4])], "pair 0: expected"),
        ([(torch.tensor([3, 4]), [4])], "pair 0: expected"),
        (
            [([3, 4], [5])] * 2 + [([3], list(range(3, 40)))],
            r"pair 2: a 37-token continuation exceeds max_length=32",
        ),
    ],
)
def test_bad_pairs_are_refused_by_index_before_anything_runs(pairs, message):
    model, store = shared("llama-sdpa"), store_for(shared("llama-sdpa"), BS)
    with pytest.raises(ValueError, match=message):
        score(model, pairs, store=store, max_length=32)
    assert store.stats()["query_tokens"] == 0
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        score(model, [([3], [4])], store=store, batch_size=0)


def test_a_list_of_namespaces_is_refused_not_applied_to_reordered_rows():
    """RadixCache takes one namespace per row, but score() reorders and deduplicates its pairs:
    a list would land on other pairs' rows (a tenant reading another's prefixes)."""
    model, store = shared("llama-sdpa"), store_for(shared("llama-sdpa"), BS)
    alice, bob = (PREAMBLE + [10, 11], [5]), (PREAMBLE + [20, 21], [5])
    score(model, [alice], store=store, namespace="alice")
    before = store.stats()["hit_tokens"]
    # Sorted by token bytes, alice's input runs first: bob's namespace would key it, and
    # alice's would key bob's row, which would then read alice's preamble.
    with pytest.raises(ValueError, match="one namespace for every pair"):
        score(model, [bob, alice], store=store, namespace=["bob", "alice"])
    assert store.stats()["hit_tokens"] == before, "a refused call read the store"


def test_the_log_softmax_runs_outside_the_callers_autocast(monkeypatch):
    """lm-eval's HFLM runs the forward under ``mixed_precision_dtype``'s autocast and the
    log-softmax outside it, in the logits' dtype (or ``softmax_dtype``); evalrun calls score
    inside that autocast. CUDA autocast runs log_softmax in fp32, so a log-softmax inside it
    would differ from ``--model hf`` by bf16 rounding (CPU autocast leaves it alone: the test
    checks where it runs)."""
    import torch.nn.functional as F

    model, store = shared("llama-sdpa"), store_for(shared("llama-sdpa"), BS)
    original, autocast_on = F.log_softmax, []

    def spy(*args, **kwargs):
        autocast_on.append(torch.is_autocast_enabled("cpu"))
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "log_softmax", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        score(model, PAIRS[:2], store=store)
    assert autocast_on and not any(autocast_on)


@pytest.mark.parametrize("max_length", [True, 2.5, "128", 0])
def test_a_max_length_that_is_not_a_positive_int_is_refused_as_such(max_length):
    model, store = shared("llama-sdpa"), store_for(shared("llama-sdpa"), BS)
    with pytest.raises(ValueError, match="max_length must be a positive int or None"):
        score(model, [([3, 4], [5])], store=store, max_length=max_length)


@pytest.mark.parametrize("max_batch_tokens", [0, -5, 2.5])
def test_a_max_batch_tokens_that_is_not_a_positive_int_is_refused(max_batch_tokens):
    """0 meant no limit and a negative one a batch per row, silently (generate_many refuses both)."""
    model, store = shared("llama-sdpa"), store_for(shared("llama-sdpa"), BS)
    with pytest.raises(ValueError, match="max_batch_tokens must be a positive int or None"):
        score(model, [([3, 4], [5])], store=store, max_batch_tokens=max_batch_tokens)
