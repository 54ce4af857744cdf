"""hf_patch.generate_many: every result equals stock generate() on that prompt alone, in input
order, for token ids, strings and chat messages; prompts sharing a prefix reuse it."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_patch
from hf_patch.planning.batches import plan_batches
from radixkv import pack_tokens
from tests.hf_models import (
    EOS,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    store_for,
    tokenizer,
    tokens,
)

BS = 4
DOCS = [tokens(37, seed=80 + d) for d in range(3)]


def job(num_per_doc: int = 4) -> list[list[int]]:
    """Prompts of three documents, interleaved (as a dataset would list them), plus two loners."""
    prompts = [
        DOCS[d] + tokens(3 + (q * 5 + d) % 7, seed=100 + 10 * d + q)
        for q in range(num_per_doc)
        for d in range(3)
    ]
    return prompts + [tokens(9, seed=150), tokens(23, seed=151)]


def stock_new_tokens(model, prompt: list[int], **kwargs) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, **kwargs)
    new = out[0, len(prompt) :].tolist()
    return new[: new.index(EOS)] if EOS in new else new


@pytest.mark.parametrize("family", ["llama-sdpa", "gpt2"])
def test_token_prompts_equal_stock_generate_one_by_one(family):
    model = shared(family)
    store = store_for(model, BS)
    prompts = job()
    results = hf_patch.generate_many(
        model, prompts, store=store, max_new_tokens=6, do_sample=False, max_batch_size=5, progress=False
    )
    assert [r.prompt_ids for r in results] == prompts  # input order
    for prompt, result in zip(prompts, results):
        assert result.token_ids == stock_new_tokens(model, prompt, max_new_tokens=6), prompt
        assert result.finish_reason == ("length" if len(result.token_ids) == 6 else "stop")
        assert result.text is None
    # One prompt per document computes it; the others compute at most their question (3-9
    # tokens), the block the document ends in, and the padding up to their batch's longest question.
    for d in range(3):
        computed = [len(p) - r.cached_tokens for p, r in zip(prompts[d:12:3], results[d:12:3])]
        assert sorted(computed)[-2] <= 9 + 1 + BS, computed
    stats = store.stats()
    assert stats["pinned_blocks"] == 0
    # The store's hits are exactly the prompts' cached tokens: each document computed once (by
    # the first prompt that starts with it, no hit for it), then read by the three others.
    assert stats["hit_tokens"] == sum(r.cached_tokens for r in results)
    assert stats["hit_rate"] > 0.5
    store.check_invariants()


def test_strings_and_chat_messages_with_a_tokenizer(capsys):
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    tok = copy.deepcopy(tokenizer())
    tok.chat_template = "{% for m in messages %}w{{ 3 + loop.index }} {{ m['content'] }} {% endfor %}w9"
    words = [" ".join(f"w{t}" for t in p) for p in job(2)]
    chats = [[{"role": "system", "content": words[0]}, {"role": "user", "content": w}] for w in words[1:4]]
    results = hf_patch.generate_many(model, words + chats, tokenizer=tok, store=store, max_new_tokens=5)
    assert "hit=" in capsys.readouterr().err  # the progress bar, on by default
    for prompt, result in zip(words + chats, results):
        if isinstance(prompt, str):
            ids = tok(prompt)["input_ids"]
        else:
            ids = list(
                tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
            )
        assert result.prompt_ids == ids
        assert result.token_ids == stock_new_tokens(model, ids, max_new_tokens=5)
        assert result.text == tok.decode(result.token_ids, skip_special_tokens=True)
    assert results[-1].cached_tokens >= 36  # the chats share the first document as system prompt


def test_per_prompt_arguments_batch_separately():
    model = shared("llama-sdpa")
    prompts = job(2)
    lengths = [{"max_new_tokens": 2 + i % 3} for i in range(len(prompts))]
    results = hf_patch.generate_many(
        model, prompts, store=store_for(model, BS), per_prompt_kwargs=lengths, do_sample=False, progress=False
    )
    for prompt, kw, result in zip(prompts, lengths, results):
        assert result.token_ids == stock_new_tokens(model, prompt, **kw)


def test_plan_keeps_groups_together_and_respects_the_budget():
    rows = [DOCS[0] + [5, 6], DOCS[1] + [7], DOCS[0] + [8, 9], tokens(40, seed=3), DOCS[1] + [4]]
    packed = [pack_tokens(r) for r in rows]
    keys = [""] * len(rows)
    batches = plan_batches(packed, keys, BS, 10_000, 8, [4] * len(rows))
    assert sorted(i for b in batches for i in b) == list(range(len(rows)))
    batch_of = {i: n for n, b in enumerate(batches) for i in b}
    # Prompts of one document run together (their document is computed once, in-batch); the
    # 40-token loner, 20x wider uncached than their 2-token questions, runs alone.
    assert batch_of[0] == batch_of[2] and batch_of[1] == batch_of[4]
    assert batches[batch_of[3]] == [3]
    small = plan_batches(packed, keys, BS, 2 * 45, 8, [4] * len(rows))
    assert all(len(b) * max(len(rows[i]) + 4 for i in b) <= 90 for b in small)


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        (["w5 w6"], {}, "prompt 0: a string prompt needs tokenizer="),
        ([[3, 4], torch.tensor([3, 4])], {}, "prompt 1: pass token ids as a list"),
        ([[3, 4], []], {}, "prompt 1: a prompt must be a non-empty list"),
        ([[3, 4]], {"num_return_sequences": 2, "do_sample": True}, "one result per prompt"),
    ],
)
def test_bad_input_is_refused_before_generating(prompts, kwargs, message):
    model = shared("llama-sdpa")
    with pytest.raises(ValueError, match=message):
        hf_patch.generate_many(model, prompts, progress=False, **kwargs)


def test_a_list_of_namespaces_is_refused_not_applied_to_reordered_prompts():
    """RadixCache's per-row namespace list is positional; generate_many sorts its prompts into
    batches, so a list would key one prompt's row by another's namespace."""
    model = shared("llama-sdpa")
    store = store_for(model, BS)
    alice, bob = DOCS[0] + [10, 11], DOCS[0] + [20, 21]
    hf_patch.generate_many(model, [alice], store=store, namespace="alice", max_new_tokens=1, progress=False)
    before = store.stats()["hit_tokens"]
    with pytest.raises(ValueError, match="one namespace for every prompt"):
        hf_patch.generate_many(
            model, [bob, alice], store=store, namespace=["bob", "alice"], max_new_tokens=1, progress=False
        )
    assert store.stats()["hit_tokens"] == before, "a refused call read the store"
