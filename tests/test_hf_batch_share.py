"""In-batch prefix sharing (hf_patch/batch_share.py): a cold batch whose rows share a prefix
computes it once, and every variant (left padding, several groups, beams, num_return_sequences,
chunked prefill, a store too small for the prefix) still equals stock generate()."""

from __future__ import annotations

import pytest
import torch

from hf_patch.batch_share import common_prefix_tokens, shared_prefixes
from radixkv import pack_tokens
from tests.hf_models import (
    FAMILIES as FAMILIES_ALL,
)
from tests.hf_models import (
    assert_same_as_stock,
    block_floor,
    ids,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    store_for,
    tokens,
)

BS = 4
DOC = tokens(41, seed=70)
OTHER_DOC = tokens(29, seed=71)
QUESTIONS = [tokens(n, seed=72 + n) for n in (5, 9, 3, 7)]
FAMILIES = ["llama-sdpa", "qwen2-sliding", "gpt2", "gemma2-sliding"]
# assert_same_as_stock runs stock generate() first: one prefill + 5 decode steps (6 new tokens).
STOCK_FORWARDS = 6


class TokenCounter:
    """Counts the token positions every forward of ``model`` embeds (pads included)."""

    def __init__(self, model) -> None:
        self.forwards: list[tuple[int, int]] = []
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.forwards.append(tuple(args[0].shape))

    def __enter__(self) -> TokenCounter:
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def test_shared_prefixes_are_whole_blocks_shortest_first():
    rows = [
        pack_tokens(DOC + QUESTIONS[0]),
        pack_tokens(tokens(12, seed=1)),
        pack_tokens(DOC + QUESTIONS[1]),
        pack_tokens(DOC[:10] + tokens(6, seed=2)),
    ]
    prefixes, deepest = shared_prefixes(rows, BS)
    assert [p.num_tokens for p in prefixes] == [8, block_floor(len(DOC), BS)]
    assert prefixes[1] == pack_tokens(DOC[: block_floor(len(DOC), BS)])
    assert deepest == [1, -1, 1, 0]
    assert common_prefix_tokens(rows[0], rows[2]) == len(DOC) + (QUESTIONS[0][0] == QUESTIONS[1][0])
    assert shared_prefixes([rows[1]], BS) == ([], [-1])


@pytest.mark.parametrize("family", FAMILIES)
def test_cold_left_padded_batch_computes_the_document_once(family):
    model = shared(family)
    store = store_for(model, BS)
    input_ids, mask = left_pad([DOC + q for q in QUESTIONS])
    with TokenCounter(model) as counter:
        cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    radix = counter.forwards[STOCK_FORWARDS:]
    width = input_ids.shape[1]
    assert radix[0] == (1, block_floor(len(DOC), BS))  # the shared document, once
    # The batch prefill then only covers what is left after the longest common preload.
    assert radix[1][0] == len(QUESTIONS) and radix[1][1] < width - block_floor(len(DOC), BS) + BS
    pads = [width - len(DOC) - len(q) for q in QUESTIONS]
    common = min(p + block_floor(len(DOC), BS) for p in pads)
    preloaded = [common - p for p in pads]
    # Row 0 computed the document (for every row): not cached for it; cached for the others.
    assert cache.cached_tokens == [max(0, preloaded[0] - block_floor(len(DOC), BS))] + preloaded[1:]
    stats = store.stats()
    assert stats["pinned_blocks"] == 0
    # The store counts the rows' lookups only (the document's own lookup is no prompt), and as
    # hits exactly what the rows report as cached: the row that computed the document for the
    # batch read it from the pool, but that saved no work, so it is no hit (hit rate stays honest).
    assert stats["requests"] == len(QUESTIONS) and stats["query_tokens"] == mask.sum().item()
    assert stats["hit_tokens"] == sum(cache.cached_tokens)  # the list checked exactly above


@pytest.mark.parametrize("family", ["llama-sdpa", "gpt2"])
def test_two_groups_and_an_identical_pair_in_one_batch(family):
    model = shared(family)
    store = store_for(model, BS)
    rows = [DOC + QUESTIONS[0], OTHER_DOC + QUESTIONS[1], DOC + QUESTIONS[2], OTHER_DOC + QUESTIONS[3]]
    rows.append(rows[1])  # an identical row shares its whole reusable length
    input_ids, mask = left_pad(rows)
    cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    # Rows 0 and 1 computed the two documents; the others reused them.
    assert all(c >= block_floor(len(OTHER_DOC), BS) - BS for c in cache.cached_tokens[2:]), (
        cache.cached_tokens
    )


@pytest.mark.parametrize(
    "mode",
    [
        dict(num_beams=3, num_return_sequences=2, output_scores=True),
        dict(num_return_sequences=3, do_sample=True, seed=9),
        dict(prefill_chunk_size=8),
    ],
    ids=["beams", "return-sequences", "chunked-prefill"],
)
def test_expansion_and_chunked_prefill_on_a_cold_store(mode):
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    input_ids, mask = left_pad([DOC + QUESTIONS[0], DOC + QUESTIONS[1]])
    cache, out = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0, **mode)
    assert min(cache.cached_tokens[-1:]) >= block_floor(len(DOC), BS) - BS  # the 2nd prompt reused it
    assert len(cache.cached_tokens) == out.sequences.shape[0]


def test_single_prompt_with_num_return_sequences_is_prefilled_once():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    prompt = DOC + QUESTIONS[0]
    with TokenCounter(model) as counter:
        cache, _ = assert_same_as_stock(
            model, ids(prompt), store, do_sample=True, seed=5, num_return_sequences=3
        )
    radix = counter.forwards[STOCK_FORWARDS:]
    assert radix[0] == (1, block_floor(len(prompt) - 1, BS)) and radix[1] == (3, len(prompt) % BS or BS)
    assert cache.cached_tokens == [0] * 3  # the prompt computed its prefix itself (once, for 3 rows)


def test_store_too_small_for_the_shared_prefix_still_generates_correctly():
    model = shared("llama-sdpa")
    store = store_for(model, BS, budget_tokens=16)  # 4 blocks: less than the document
    input_ids, mask = left_pad([DOC + q for q in QUESTIONS])
    cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    assert max(cache.cached_tokens) <= 16


def test_warm_store_is_not_recomputed():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(DOC + QUESTIONS[3]), store)
    input_ids, mask = left_pad([DOC + q for q in QUESTIONS[:3]])
    with TokenCounter(model) as counter:
        assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    radix = counter.forwards[STOCK_FORWARDS:]
    assert radix[0][0] == 3  # no one-row forward: the document was in the store already
    assert torch.equal(torch.tensor(store.stats()["pinned_blocks"]), torch.tensor(0))


@pytest.mark.parametrize("family", FAMILIES_ALL)
def test_every_family_shares_a_cold_prefix_and_matches_stock(family):
    """fp32 logits within 1e-5 of stock for every supported family, with the prefix really shared."""
    model = shared(family)
    store = store_for(model, BS)
    input_ids, mask = left_pad([DOC + QUESTIONS[0], DOC + QUESTIONS[1]])
    cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    assert cache.cached_tokens[0] == 0 and cache.cached_tokens[1] >= block_floor(len(DOC), BS) - BS


def test_a_row_that_shares_nothing_does_not_widen_the_batch():
    """Without its own prefix computed alone, the unrelated row (uncached) would make the batch's
    first forward as wide as its whole prompt, for every row."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    loner = tokens(30, seed=130)
    input_ids, mask = left_pad([DOC + QUESTIONS[0], loner, DOC + QUESTIONS[1]])
    with TokenCounter(model) as counter:
        cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    radix = counter.forwards[STOCK_FORWARDS:]
    assert radix[:2] == [(1, block_floor(len(DOC), BS)), (1, block_floor(len(loner) - 1, BS))]
    assert radix[2][0] == 3 and radix[2][1] <= max(map(len, QUESTIONS)) + 2 * BS
    assert cache.cached_tokens[1] == 0 and cache.cached_tokens[2] >= block_floor(len(DOC), BS) - BS


@pytest.mark.parametrize("family", ["llama-sdpa", "gpt2"])
def test_a_cached_row_keeps_its_hit_beside_an_uncached_row_it_shares_nothing_with(family):
    """No prefix is shared, but one row's document is cached (a task prompt, a previous turn):
    the uncached row's prefix is computed alone first, so the batch's common preload no longer
    drops the cached row to zero."""
    model = shared(family)
    store = store_for(model, BS)
    assert_same_as_stock(model, ids(DOC + QUESTIONS[3]), store)  # the document is cached
    loner = tokens(30, seed=131)
    input_ids, mask = left_pad([DOC + QUESTIONS[0], loner])
    with TokenCounter(model) as counter:
        cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    radix = counter.forwards[STOCK_FORWARDS:]
    row0 = block_floor(len(DOC + QUESTIONS[0]) - 1, BS)  # its reusable whole blocks
    # Each row's own prefix, alone: row 0 only the blocks past the cached document, then the loner.
    assert radix[:2] == [(1, row0 - block_floor(len(DOC), BS)), (1, block_floor(len(loner) - 1, BS))]
    assert radix[2][0] == 2 and radix[2][1] <= 2 * BS  # the batch computes only the rows' tails
    assert cache.cached_tokens == [block_floor(len(DOC), BS), 0]  # what each row did not compute


def test_a_cold_batch_that_shares_nothing_is_one_batched_prefill():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    input_ids, mask = left_pad([tokens(30, seed=132), tokens(22, seed=133)])
    with TokenCounter(model) as counter:
        cache, _ = assert_same_as_stock(model, input_ids, store, attention_mask=mask, pad_token_id=0)
    assert counter.forwards[STOCK_FORWARDS][0] == 2  # no one-row forwards first
    assert cache.cached_tokens == [0, 0]
