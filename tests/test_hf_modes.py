"""generate() features on a warm store: padded batches, beams, sampling, penalties, chunked prefill,
streamers, a configured cache_implementation, and in-place decode into one buffer."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TextIteratorStreamer,
    TextStreamer,
)

import hf_patch
from tests.hf_models import (
    EOS,
    assert_same_as_stock,
    block_floor,
    build,
    expected_full_hit,
    ids,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    store_for,
    tokenizer,
    tokens,
)

BS = 4
PROMPT = tokens(44, seed=11)
MODE_FAMILIES = ["llama-sdpa", "qwen2-sliding", "gpt2", "gemma2-sliding"]
families = pytest.mark.parametrize("family", MODE_FAMILIES)


def warm_store(family, *prompts):
    model = shared(family)
    store = store_for(model, BS)
    for p in prompts or (PROMPT,):
        assert_same_as_stock(model, ids(p), store)
    return model, store


@families
def test_left_padded_batch_rows_match_different_lengths(family):
    model, store = warm_store(family)
    rows = [
        PROMPT[:38],  # cached up to 36 (one token must stay uncached: 37 -> 36)
        PROMPT[:22] + tokens(10, seed=12),  # cached 20
        PROMPT + tokens(4, seed=13),  # cached 44 (everything the store has)
    ]
    input_ids, mask = left_pad(rows)
    pads = [input_ids.shape[1] - len(r) for r in rows]
    matches = [36, 20, 44]
    cache, out = assert_same_as_stock(
        model, input_ids, store, attention_mask=mask, pad_token_id=0, max_new_tokens=7, min_new_tokens=4
    )
    common = min(p + m for p, m in zip(pads, matches))
    assert cache.cached_tokens == [common - p for p in pads]
    assert len(set(cache.cached_tokens)) == 3 and min(cache.cached_tokens) > 0
    # Each row's finished sequence was committed unpadded and cut after its first EOS: row 1's
    # answer is now a cached prefix. The batch's last sampled column never got KV.
    seq = out.sequences[1].tolist()
    width = input_ids.shape[1]
    end = next((j + 1 for j in range(width, len(seq)) if seq[j] == EOS), len(seq))
    end = min(end, len(seq) - 1)
    answer = seq[pads[1] : end]
    turn2 = ids(answer + tokens(3, seed=14))
    cache, _ = assert_same_as_stock(model, turn2, store, attention_mask=torch.ones_like(turn2))
    assert cache.cached_tokens == [block_floor(len(answer), BS)]
    assert cache.cached_tokens[0] > block_floor(len(rows[1]), BS)


@families
def test_short_unrelated_row_does_not_block_a_long_cached_row(family):
    """The short row's pad columns lie under the long row's cached prefix: both fit in one preload."""
    model, store = warm_store(family)
    input_ids, mask = left_pad([tokens(10, seed=19), PROMPT + tokens(3, seed=20)])
    cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    # The short row's own prefix is computed alone first (in-batch sharing, as a row is cached),
    # so the long row reads its whole cached match, 44, not just the 37 columns of the short
    # row's padding; the short row computed its 8 itself: not cached for it.
    assert cache.cached_tokens == [0, 44]


@pytest.mark.parametrize("family", ["llama-sdpa", "gpt2"])
@pytest.mark.parametrize(
    "mode",
    [
        dict(num_beams=3, num_return_sequences=2, output_scores=True),
        dict(do_sample=True, num_return_sequences=2),
    ],
    ids=["beams", "sampling"],
)
def test_left_padded_batch_with_expansion(family, mode):
    model, store = warm_store(family)
    input_ids, mask = left_pad([PROMPT[:38], PROMPT[:22] + tokens(10, seed=12)])
    cache, _ = assert_same_as_stock(
        model, input_ids, store, attention_mask=mask, pad_token_id=0, seed=3, **mode
    )
    # One entry per returned sequence (2 per prompt), not per beam: entry i describes sequences[i].
    per_row = mode["num_return_sequences"]
    # The second prompt's copies share its 28 reusable tokens: 8 computed once in the batch (20 were
    # cached), so the common column is 34 = min(0 + 36, 6 + 28); the prompt itself computed those 8.
    assert cache.cached_tokens == [34] * per_row + [20] * per_row


def test_left_padded_batch_with_mask_inferred_from_pad_token():
    """No attention_mask: generate() infers it from pad_token_id; rows still reuse."""
    model, store = warm_store("llama-sdpa")
    input_ids, _ = left_pad([PROMPT[:30], PROMPT[:41]])
    cache, _ = assert_same_as_stock(model, input_ids, store, pad_token_id=0)
    assert cache.cached_tokens == [28, 39]  # common column 39 = min(11 + 28, 0 + 40)


def test_pad_token_equal_to_eos():
    """GPT-2 style pad == eos: finished rows are padded with EOS; rows are cut at their first EOS."""
    model = build("gpt2")
    model.generation_config.pad_token_id = EOS
    store = store_for(model, BS)
    input_ids, mask = left_pad([PROMPT[:30], PROMPT])
    input_ids[mask == 0] = EOS
    assert_same_as_stock(model, input_ids, store, attention_mask=mask, max_new_tokens=6)
    cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, max_new_tokens=6)
    assert cache.cached_tokens == [26, 40]  # common column 40 = min(14 + 28, 0 + 40)


@pytest.mark.parametrize("new_tokens", [1, 2])
def test_very_short_generations(new_tokens):
    model, store = warm_store("llama-sdpa")
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store, max_new_tokens=new_tokens)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    prompt = PROMPT + tokens(6, seed=18)
    assert_same_as_stock(model, ids(prompt), store, max_new_tokens=new_tokens)
    cache, _ = assert_same_as_stock(model, ids(prompt), store, max_new_tokens=new_tokens)
    assert cache.cached_tokens == [expected_full_hit(len(prompt), BS)]


def test_right_padded_batch_is_exact_without_reuse():
    """Not left padding: no common prefix column exists, so no reuse; output still equals stock."""
    model, store = warm_store("llama-sdpa")
    rows = [PROMPT[:40], PROMPT[:30]]
    input_ids = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros(2, 40, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    assert cache.cached_tokens == [0, 0]


@families
def test_beam_search(family):
    model, store = warm_store(family)
    cache, out = assert_same_as_stock(
        model, ids(PROMPT + tokens(3, seed=15)), store, num_beams=3, output_scores=True, max_new_tokens=5
    )
    assert out.sequences_scores is not None
    assert cache.cached_tokens == [44]  # one entry per returned sequence, not per beam


@pytest.mark.parametrize("family", ["llama-sdpa", "gpt2"])
def test_greedy_beams_with_num_return_sequences(family):
    model, store = warm_store(family)
    cache, out = assert_same_as_stock(
        model, ids(PROMPT), store, num_beams=4, num_return_sequences=2, output_scores=True
    )
    assert out.sequences.shape[0] == 2
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)] * 2


@families
def test_sampling_with_seed_and_num_return_sequences(family):
    model, store = warm_store(family)
    cache, out = assert_same_as_stock(
        model,
        ids(PROMPT),
        store,
        seed=1234,
        do_sample=True,
        top_k=20,
        temperature=0.9,
        num_return_sequences=3,
    )
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)] * 3
    assert out.sequences.shape[0] == 3
    # The three samples differ (else this test could not tell sampling from greedy).
    assert len({tuple(r) for r in out.sequences.tolist()}) > 1


@families
def test_repetition_penalty(family):
    model, store = warm_store(family)
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store, repetition_penalty=1.3, max_new_tokens=8)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]


@families
def test_prefill_chunk_size(family):
    model, store = warm_store(family)
    prompt = PROMPT[:20] + tokens(30, seed=16)  # 20 cached, 30 computed in chunks of 8
    cache, _ = assert_same_as_stock(model, ids(prompt), store, prefill_chunk_size=8)
    assert cache.cached_tokens == [20]


class CollectingStreamer(TextStreamer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.chunks: list[str] = []
        self.ended = 0

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.chunks.append(text)
        self.ended += stream_end


def test_text_streamer():
    model, store = warm_store("llama-sdpa")
    tok = tokenizer()
    prompt = ids(PROMPT)
    texts = []
    for use_radix in (False, True):
        streamer = CollectingStreamer(tok, skip_prompt=True)
        kwargs = {"past_key_values": hf_patch.RadixCache(store=store)} if use_radix else {}
        out = model.generate(prompt, max_new_tokens=10, do_sample=False, streamer=streamer, **kwargs)
        assert streamer.ended == 1
        assert "".join(streamer.chunks) == tok.decode(out[0, prompt.shape[1] :])
        texts.append("".join(streamer.chunks))
        if use_radix:
            assert kwargs["past_key_values"].cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    assert texts[0] == texts[1] and texts[0]


def test_text_iterator_streamer_in_thread():
    model, store = warm_store("llama-sdpa")
    tok = tokenizer()
    prompt = ids(PROMPT + tokens(6, seed=17))
    reference = model.generate(prompt, max_new_tokens=12, do_sample=False)
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
    cache = hf_patch.RadixCache(store=store)
    result = {}

    def run():
        result["out"] = model.generate(
            prompt, max_new_tokens=12, do_sample=False, streamer=streamer, past_key_values=cache
        )

    worker = threading.Thread(target=run)
    worker.start()
    streamed = "".join(streamer)
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert torch.equal(result["out"], reference)
    assert streamed == tok.decode(reference[0, prompt.shape[1] :])
    assert cache.cached_tokens == [44]
    store.check_invariants()


def test_cache_implementation_in_generation_config():
    """A model configured for a static cache: with a RadixCache it must still work and be exact."""
    model = copy.deepcopy(shared("llama-sdpa"))
    model.generation_config.cache_implementation = "static"
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(PROMPT), store)
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    assert model.generation_config.cache_implementation == "static", "the model's config was changed"


def test_cache_implementation_in_explicit_generation_config():
    model, store = warm_store("llama-sdpa")
    config = GenerationConfig(cache_implementation="static", max_new_tokens=6, do_sample=False)
    cache, _ = assert_same_as_stock(model, ids(PROMPT), store, generation_config=config)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    assert config.cache_implementation == "static", "the caller's GenerationConfig was changed"


class RecordBuffers(LogitsProcessor):
    """Runs once per decode step; records where layer 0's KV buffer lives."""

    def __init__(self, cache):
        self.cache = cache
        self.k_ptrs: list[int] = []
        self.v_ptrs: list[int] = []
        self.lengths: list[int] = []

    def __call__(self, input_ids, scores):
        layer = self.cache.layers[0]
        self.k_ptrs.append(layer._k_buf.data_ptr())
        self.v_ptrs.append(layer._v_buf.data_ptr())
        self.lengths.append(layer.get_seq_length())
        return scores


@pytest.mark.parametrize("warm", [False, True])
def test_decode_appends_into_one_buffer(warm):
    model = build("llama-sdpa")
    model.generation_config.eos_token_id = None
    store = store_for(model, BS)
    if warm:
        assert_same_as_stock(model, ids(PROMPT), store)
    cache = hf_patch.RadixCache(store=store)
    recorder = RecordBuffers(cache)
    new = 30
    out = model.generate(
        ids(PROMPT),
        max_new_tokens=new,
        do_sample=False,
        past_key_values=cache,
        logits_processor=LogitsProcessorList([recorder]),
    )
    assert torch.equal(out, model.generate(ids(PROMPT), max_new_tokens=new, do_sample=False))
    assert out.shape[1] == len(PROMPT) + new
    assert len(recorder.k_ptrs) == new
    assert len(set(recorder.k_ptrs)) == 1 and len(set(recorder.v_ptrs)) == 1, "the KV buffer was reallocated"
    assert recorder.lengths == list(range(len(PROMPT), len(PROMPT) + new))
    layer = cache.layers[0]  # a paged layer's first ``offset`` columns stay in the pool
    assert getattr(layer, "offset", 0) + layer._k_buf.shape[2] >= len(PROMPT) + new - 1
