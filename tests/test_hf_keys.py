"""The cache key beyond token ids: extra ids, prompt embeddings, per-row namespaces, a prefix
shared across namespaces, and the allowlist of generate() inputs. Every output equals stock
generate(); every case that expects reuse checks cached_tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import hf_patch
from hf_patch import RadixCache, SharedPrefix
from hf_patch.keys import fold
from radixkv import KeyedNamespace
from radixkv.persist.manifest import decode_namespace, encode_namespace
from tests.hf_models import (
    VOCAB,
    assert_same_as_stock,
    block_floor,
    build,
    expected_full_hit,
    ids,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    stock,
    store_for,
    tokens,
)

BS = 4
PROMPT = tokens(30, seed=1601)


def extra(length: int, spans: dict[tuple[int, int], int]) -> torch.Tensor:
    """[1, length] extra ids: ``value`` over each ``(start, end)`` span, 0 elsewhere."""
    out = torch.zeros(1, length, dtype=torch.int64)
    for (start, end), value in spans.items():
        out[0, start:end] = value
    return out


# -- folding --------------------------------------------------------------------------------
def test_fold_keys_plain_tokens_as_themselves_and_extra_pairs_apart():
    row = np.array([5, 6, 7, 5], dtype=np.int64)
    assert fold(row, np.zeros(4, dtype=np.uint64)).tolist() == row.tolist()
    a = fold(row, np.array([0, 9, 9, 9], dtype=np.uint64))
    b = fold(row, np.array([0, 9, 8, 9], dtype=np.uint64))
    assert a[0] == 5 and (a[1:] < 0).all()  # never equal to a real token id
    assert a[1] == b[1] and a[2] != b[2] and a[3] == b[3]  # per (token, extra id) pair
    assert a[1] != a[3] or row[1] == row[3]
    big = fold(row, np.array([0, 2**64 - 1, 0, 0], dtype=np.uint64))  # the whole uint64 range
    assert big[1] < 0 and big[1] != a[1]


def test_an_adapter_root_has_a_file_form_no_plain_tuple_can_take():
    keyed = KeyedNamespace("tenant", ("adapter", "x", "0" * 32))
    assert decode_namespace(encode_namespace(keyed)) == keyed
    plain = ("tenant", ("adapter", "x", "0" * 32))
    assert decode_namespace(encode_namespace(plain)) == plain != keyed
    assert hash(keyed) != hash(plain) or keyed != plain


# -- extra ids ------------------------------------------------------------------------------
def test_equal_extra_ids_reuse_and_different_ones_stop_the_match():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    prompt = ids(PROMPT)
    table = extra(len(PROMPT), {(10, 18): 7})
    ref = stock(model, prompt)
    cache, _ = assert_same_as_stock(model, prompt, cache=RadixCache(store, extra_ids=table), reference=ref)
    assert cache.cached_tokens == [0]
    cache, _ = assert_same_as_stock(model, prompt, cache=RadixCache(store, extra_ids=table), reference=ref)
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]
    # Another table from token 13 on: the match ends in the block holding 13.
    other = extra(len(PROMPT), {(10, 13): 7, (13, 18): 8})
    cache, _ = assert_same_as_stock(model, prompt, cache=RadixCache(store, extra_ids=other), reference=ref)
    assert cache.cached_tokens == [block_floor(13, BS)]
    # Plain ids (no extra ids) never read the KV keyed by a table: reuse ends where it starts.
    cache, _ = assert_same_as_stock(model, prompt, store, reference=ref)
    assert cache.cached_tokens == [block_floor(10, BS)]


def test_extra_ids_of_a_left_padded_batch_and_num_return_sequences():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    rows = [PROMPT[:26], PROMPT[:18]]
    input_ids, mask = left_pad(rows)
    table = torch.zeros_like(input_ids)
    table[0, 12:20] = 3  # row 0 has no pads: real tokens 12..20 carry a table
    table[1, 12:14] = 3  # row 1 has 8 pads: real tokens 4..6
    kwargs = dict(attention_mask=mask, pad_token_id=0, num_return_sequences=2, do_sample=True, seed=5)
    ref = stock(model, input_ids, **kwargs)
    cache, _ = assert_same_as_stock(
        model, input_ids, cache=RadixCache(store, extra_ids=table), reference=ref, **kwargs
    )
    cache, _ = assert_same_as_stock(
        model, input_ids, cache=RadixCache(store, extra_ids=table), reference=ref, **kwargs
    )
    # Row 0: 25 reusable tokens floor to 24; row 1: 17 floor to 16, from pad 8 -> column 24.
    # The batch preloads min(pad + match) = 24 columns; each prompt's two rows count alike.
    assert cache.cached_tokens == [24, 24, 16, 16]
    with pytest.raises(ValueError, match="extra_ids"):
        model.generate(input_ids, attention_mask=mask, pad_token_id=0, max_new_tokens=2,
                       past_key_values=RadixCache(store, extra_ids=table[:, :-1]))  # fmt: skip


def test_prompt_embeddings_reuse_through_extra_ids():
    """p-tuning / soft prompts: virtual tokens (ids beyond the vocabulary) whose embeddings come
    from a prompt table; TensorRT-LLM's extra id names the table."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    embed = model.get_input_embeddings()
    virtual = list(range(VOCAB, VOCAB + 8))  # fake ids beyond the vocabulary
    text = tokens(14, seed=1602)
    prompt = ids(text[:6] + virtual + text[6:])
    g = torch.Generator().manual_seed(3)
    table_a, table_b = (torch.randn(8, embed.embedding_dim, generator=g) for _ in range(2))

    def embeds(table):
        with torch.no_grad():
            plain = embed(ids(text))[0]
        return torch.cat([plain[:6], table, plain[6:]]).unsqueeze(0)

    spans = extra(prompt.shape[1], {(6, 14): 11})
    for table, extra_id, expect in ((table_a, spans, 0), (table_a, spans, expected_full_hit(22, BS)),
                                    (table_b, spans * 2, block_floor(6, BS))):  # fmt: skip
        ref = stock(model, prompt, inputs_embeds=embeds(table))
        cache, _ = assert_same_as_stock(
            model,
            prompt,
            cache=RadixCache(store, extra_ids=extra_id),
            inputs_embeds=embeds(table),
            reference=ref,
        )
        assert cache.cached_tokens == [expect]
    # Without extra ids, embeddings cannot be keyed: correct, no reuse, nothing committed.
    cached = store.stats()["cached_blocks"]
    ref = stock(model, prompt, inputs_embeds=embeds(table_b))
    cache, _ = assert_same_as_stock(model, prompt, store, inputs_embeds=embeds(table_b), reference=ref)
    assert cache.cached_tokens == [0] and store.stats()["cached_blocks"] == cached


# -- namespaces -----------------------------------------------------------------------------
def test_per_row_namespaces_in_one_batch():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    prompt = ids(PROMPT)
    assert_same_as_stock(model, prompt, store, namespace="a")
    both = ids(PROMPT, PROMPT)
    ref = stock(model, both)
    cache, _ = assert_same_as_stock(model, both, cache=RadixCache(store, namespace=["a", "b"]), reference=ref)
    full = expected_full_hit(len(PROMPT), BS)
    assert cache.cached_tokens == [full, 0]  # b never reads a's KV, even computed in this batch
    cache, _ = assert_same_as_stock(model, both, cache=RadixCache(store, namespace=["b", "a"]), reference=ref)
    assert cache.cached_tokens == [full, full]  # b's row was committed under b
    cache, _ = assert_same_as_stock(model, prompt, store, namespace="c")
    assert cache.cached_tokens == [0]
    with pytest.raises(ValueError, match="namespace has 3 entries"):
        model.generate(both, max_new_tokens=2, past_key_values=RadixCache(store, namespace=["a", "b", "c"]))


def test_per_row_namespaces_share_a_document_only_within_a_namespace():
    """In-batch sharing computes a shared document once per namespace, never across."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    doc = tokens(24, seed=1603)
    rows = [doc + tokens(5, seed=1604 + i) for i in range(4)]
    input_ids = ids(*rows)
    ref = stock(model, input_ids)
    cache, _ = assert_same_as_stock(
        model, input_ids, cache=RadixCache(store, namespace=["a", "b", "a", "b"]), reference=ref
    )
    # One row per namespace computed the document; the other row of that namespace read it.
    assert cache.cached_tokens == [0, 0, 24, 24]
    for ns in ("a", "b", "c"):
        cache, _ = assert_same_as_stock(model, ids(doc + [7, 8, 9, 10, 11]), store, namespace=ns)
        assert cache.cached_tokens == [24 if ns != "c" else 0]


def test_a_shared_prefix_is_pinned_once_and_what_follows_stays_private():
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    task = tokens(16, seed=1605)
    hf_patch.pin_prompts(model, {"support": task}, store=store, namespace="tasks")
    pinned = store.stats()["task_pinned_blocks"]
    assert pinned == 4
    public = SharedPrefix("tasks", len(task))
    question = tokens(10, seed=1606)
    prompt = ids(task + question)
    ref = stock(model, prompt)

    def same_as_stock(input_ids, cache, reference):
        assert_same_as_stock(model, input_ids, cache=cache, reference=reference, check_invariants=False)
        store.check_invariants()
        assert store.stats()["pinned_blocks"] == pinned, "only the task prompt stays pinned"
        return cache.cached_tokens

    def ask(tenant):
        return same_as_stock(prompt, RadixCache(store, namespace=tenant, shared_prefix=public), ref)[0]

    assert ask("alice") == 16  # the public task prompt, pinned by the operator
    assert ask("alice") == expected_full_hit(26, BS)  # her own question, cached under her
    assert ask("bob") == 16  # bob sends alice's exact prompt: he reads only the public part
    assert ask("bob") == expected_full_hit(26, BS)
    assert store.stats()["task_pinned_blocks"] == pinned  # one copy, whatever the tenants
    # Tenants in one batch, each with the shared prefix; a third without one keys privately.
    rows = ids(task + question, task + question, task + question)
    ref = stock(model, rows)
    cached = same_as_stock(
        rows,
        RadixCache(store, namespace=["alice", "carol", "tasks"], shared_prefix=[public, public, None]),
        ref,
    )
    # "tasks" without a shared prefix is the plain namespace the task prompt was pinned in. The
    # batch preloads one column count: alice's full hit is cut to the others' 16.
    assert cached == [16, 16, 16]


# -- the allowlist --------------------------------------------------------------------------
def test_inputs_the_key_cannot_see_turn_the_store_off_for_the_call(caplog):
    """GPT-2 adds token-type embeddings: same ids, other KV. Output equals stock; nothing is
    read or committed; the call is counted; one log line names the argument."""
    model = shared("gpt2")
    store = store_for(model, BS)
    prompt = ids(PROMPT)
    assert_same_as_stock(model, prompt, store)
    cached = store.stats()["cached_blocks"]
    types = torch.ones_like(prompt)
    with caplog.at_level("WARNING", logger="hf_patch.keys.inputs"):
        for _ in range(2):
            cache, _ = assert_same_as_stock(model, prompt, store, token_type_ids=types)
            assert cache.cached_tokens == [0]
    assert [r.getMessage() for r in caplog.records if "token_type_ids" in r.getMessage()] != []
    assert len([r for r in caplog.records if "token_type_ids" in r.getMessage()]) == 1
    stats = store.stats()
    assert stats["uncacheable_requests"] == 2 and stats["cached_blocks"] == cached
    cache, _ = assert_same_as_stock(model, prompt, store)  # the plain KV is intact
    assert cache.cached_tokens == [expected_full_hit(len(PROMPT), BS)]


def test_every_key_part_saves_and_restores(tmp_path):
    """Extra-id keys, per-row namespaces and a shared prefix's salted tails survive a cache file."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    task = tokens(8, seed=1607)
    public = SharedPrefix("tasks", len(task))
    rows = ids(task + PROMPT[:16], task + PROMPT[:16])
    table = torch.zeros_like(rows)
    table[:, 12:16] = 5
    ref = stock(model, rows)

    def call(s, expect):
        cache = RadixCache(s, namespace=["alice", "bob"], shared_prefix=[public, public], extra_ids=table)
        assert_same_as_stock(model, rows, cache=cache, reference=ref)
        assert cache.cached_tokens == expect

    call(store, [0, 8])  # in-batch sharing: alice's row computed the public part bob reads
    path = tmp_path / "keys.safetensors"
    hf_patch.save_cache(model, path, store=store)
    fresh = store_for(model, BS)
    assert hf_patch.restore_cache(model, path, store=fresh).restored_tokens > 0
    call(fresh, [expected_full_hit(24, BS)] * 2)
    # Carol, with the same prompt, reads only the public part.
    cache = RadixCache(fresh, namespace="carol", shared_prefix=public, extra_ids=table[:1])
    assert_same_as_stock(model, rows[:1], cache=cache, reference=stock(model, rows[:1]))
    assert cache.cached_tokens == [8]


def test_a_cache_file_written_before_the_key_parts_still_restores_and_hits():
    """tests/data/format1_llama_sdpa.safetensors was saved by radixkv before this change (commit
    e306630) from build("llama-sdpa"): a 30-token prompt + 4 greedy tokens under namespace
    "tenant". Plain rows key as before, so it restores and serves the same prompt."""
    model = build("llama-sdpa")
    store = store_for(model, BS)
    path = Path(__file__).parent / "data" / "format1_llama_sdpa.safetensors"
    result = hf_patch.restore_cache(model, path, store=store)
    assert result.restored_tokens == 32 and result.dropped_tokens == 0
    prompt = ids(tokens(30, seed=1901))
    cache, _ = assert_same_as_stock(model, prompt, store, namespace="tenant")
    assert cache.cached_tokens == [expected_full_hit(30, BS)]
