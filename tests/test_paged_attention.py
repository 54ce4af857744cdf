"""Attention reading the cached prefix from the pool in place (hf_patch.paged_attention, issue 41).

Against stock generate() (sequences equal, fp32 logits within 1e-5) and the uncached forward
(scores): left-padded rows of different cached lengths (one block list shared by rows of other
lengths, a fragmented list read by index), beams, num_return_sequences; cached_tokens as the copy
path counts them; the prefix pinned while the call reads it; where it does not apply, the copy
path with one log line; the kernel's parts against one plain softmax.
"""

from __future__ import annotations

import logging

import pytest
import torch

import hf_patch
from cuda_ext import cascade_attention
from hf_patch import RadixCache, paged_attention
from hf_patch.keys.weights import model_scope
from hf_patch.model_spec import model_layout
from radixkv import BlockPool, KVStore
from tests.hf_models import (
    LOGITS_ATOL,
    left_pad,
    one_torch_thread,  # noqa: F401  (autouse)
    poison_free_blocks,
    shared,
    store_for,
    tokens,
)

DOC = tokens(41, seed=1)


@pytest.fixture(autouse=True)
def paged_on(monkeypatch):
    """The paged path on (off by default: the copy path is the bit-exact one on the CPU)."""
    monkeypatch.setenv("RADIXKV_PAGED_ATTENTION", "1")


# -- the kernel ------------------------------------------------------------------------------------
def _full_softmax(q, k, v, mask, scale):
    scores = (q @ k.transpose(-1, -2)) * scale + mask
    return torch.softmax(scores, -1) @ v


def test_attend_and_merge_equal_one_softmax():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 5, 8, generator=g)
    k = torch.randn(3, 2, 13, 8, generator=g)
    v = torch.randn(3, 2, 13, 8, generator=g)
    hide = torch.rand(3, 1, 5, 13, generator=g) > 0.6
    hide[..., 0] = hide[..., 9] = False  # every query sees a key on both sides of the split
    mask = torch.zeros(hide.shape).masked_fill(hide, float("-inf"))
    want = _full_softmax(q, k, v, mask, 0.3)
    for fn in (cascade_attention.attend, cascade_attention.attend_reference):
        a, la = fn(q, k[:, :, :9], v[:, :, :9], mask[..., :9], 0.3)
        b, lb = fn(q, k[:, :, 9:], v[:, :, 9:], mask[..., 9:], 0.3)
        out, lse = cascade_attention.merge(a, la, b, lb)
        assert (out - want).abs().max() < 1e-5, fn.__name__
        full = torch.logsumexp((q @ k.transpose(-1, -2)) * 0.3 + mask, -1)
        assert (lse - full).abs().max() < 1e-5


def test_strided_prefix_is_read_in_place():
    """A pool's [blocks, bs, H, D] run viewed as [1, H, T, D] gives what a contiguous copy gives."""
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(6, 4, 2, 8, generator=g)
    view = pool[1:4].reshape(12, 2, 8)[:10].unsqueeze(0).transpose(1, 2)
    q = torch.randn(1, 2, 3, 8, generator=g)
    a = cascade_attention.attend(q, view, view, None, 0.5)
    b = cascade_attention.attend(q, view.contiguous(), view.contiguous(), None, 0.5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# -- generate() and scoring -------------------------------------------------------------------------
def _generate(model, input_ids, mask, cache=None, **kw):
    torch.manual_seed(0)
    kw.setdefault("do_sample", False)
    return model.generate(
        input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5,
        output_logits=True, return_dict_in_generate=True, **kw,
    )  # fmt: skip


def _assert_same(out, ref):
    """Same tokens, logits within 1e-5 (the families' tolerance); a near-tie parted by another
    summation order is reported with its gap."""
    steps = min(len(out.logits), len(ref.logits))
    gap = max((a - b).abs().max().item() for a, b in zip(out.logits[:steps], ref.logits[:steps]))
    if not torch.equal(out.sequences, ref.sequences):
        top2 = [torch.topk(lg, 2, dim=-1).values for lg in ref.logits]
        margin = min((t[:, 0] - t[:, 1]).min().item() for t in top2)
        raise AssertionError(
            f"tokens differ: logits {gap:.3g} from stock, stock's closest top-2 margin {margin:.3g}"
        )
    assert gap <= LOGITS_ATOL, f"logits {gap:.3g} from stock"


@pytest.fixture
def counted(monkeypatch):
    """Counts of the paged route's prefix merges (one per group and layer of a forward)."""
    seen = {"merges": 0}
    merge = paged_attention.merge

    def counting(*args):
        seen["merges"] += 1
        return merge(*args)

    monkeypatch.setattr(paged_attention, "merge", counting)
    return seen


def _warm(model, store):
    """DOC (41 tokens) and 2 generated ones committed: 40 tokens (10 blocks of 4) served."""
    cache = RadixCache(store=store)
    model.generate(torch.tensor([DOC]), past_key_values=cache, max_new_tokens=3, do_sample=False)


def test_rows_of_different_cached_lengths_equal_stock(counted):
    """Pads 0, 8, 14, 35; matches 40, 28, 12, 0: common = min(pad + match) = 26 columns, so rows
    read 26, 18, 12 and 0 tokens of one block list (one group, three lengths)."""
    model = shared("llama-sdpa")
    rows = [DOC + tokens(6, 7), DOC[:30] + tokens(9, 8), DOC[:13] + tokens(20, 9), tokens(12, 10)]
    input_ids, mask = left_pad(rows)
    results = {}
    for paged in (False, True):
        store = store_for(model)
        _warm(model, store)
        before = store.stats()["hit_tokens"]
        cache = RadixCache(store=store, paged=paged)
        results[paged] = _generate(model, input_ids, mask, cache)
        assert cache.cached_tokens == [26, 18, 12, 0]
        assert store.stats()["hit_tokens"] - before == 56
        assert store.stats()["pinned_blocks"] == 0
        store.check_invariants()
        assert (counted["merges"] > 0) == paged, "the paged route did (not) run"
        # the rows' sequences were committed: a second call reads whole prompts
        again = RadixCache(store=store, paged=False)
        _assert_same(_generate(model, input_ids, mask, again), _generate(model, input_ids, mask))
        assert again.cached_tokens == [43, 35, 29, 8]  # common 43: min(0 + 44, 35 + 8)
    ref = _generate(model, input_ids, mask)
    _assert_same(results[True], ref)
    _assert_same(results[False], ref)
    gap = max((a - b).abs().max().item() for a, b in zip(results[True].logits, results[False].logits))
    assert gap <= LOGITS_ATOL


def test_fragmented_block_list_equals_stock(counted):
    model = shared("llama-sdpa")
    store = KVStore(BlockPool(model_layout(model).specs, 64, 4))
    for prompt in (DOC[:20], tokens(20, 20), DOC):  # DOC's blocks: 0-4, then 10-14
        model.generate(
            torch.tensor([prompt]), past_key_values=RadixCache(store=store), max_new_tokens=1, do_sample=False
        )
    with store.acquire(DOC, (model_scope(model), None)) as lease:
        blocks = list(lease.block_ids)
    assert blocks != list(range(blocks[0], blocks[0] + len(blocks))), f"not fragmented: {blocks}"
    input_ids, mask = left_pad([DOC + tokens(4, 11), DOC + tokens(3, 12)])
    cache = RadixCache(store=store)
    out = _generate(model, input_ids, mask, cache)
    assert counted["merges"] > 0
    _assert_same(out, _generate(model, input_ids, mask))
    assert cache.cached_tokens == [40, 39]  # pads 0, 1: common 40


@pytest.mark.parametrize(
    "kw", [dict(num_beams=3, num_return_sequences=2), dict(do_sample=True, num_return_sequences=3)]
)
def test_beams_and_returned_sequences_equal_stock(kw, counted):
    model = shared("llama-sdpa")
    store = store_for(model)
    _warm(model, store)
    input_ids, mask = left_pad([DOC + tokens(5, 13), DOC[:24] + tokens(7, 14)])
    cache = RadixCache(store=store)
    out = _generate(model, input_ids, mask, cache, **kw)
    assert counted["merges"] > 0
    ref = _generate(model, input_ids, mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    # pads 0 and 15, matches 40 and 24: common 39 columns
    assert cache.cached_tokens == [39] * kw["num_return_sequences"] + [24] * kw["num_return_sequences"]


def test_scores_equal_an_uncached_forward(monkeypatch, counted):
    model = shared("llama-sdpa")
    pairs = [(DOC + tokens(3, 15), tokens(2, 16)), (DOC[:20] + tokens(6, 17), tokens(3, 18))]
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("RADIXKV_PAGED_ATTENTION", setting)
        store = store_for(model)
        _warm(model, store)
        runs[setting] = hf_patch.score(model, pairs, store=store)
        assert (counted["merges"] > 0) == (setting == "1")
    for (context, continuation), s in zip(pairs, runs["1"]):
        with torch.no_grad():
            logits = model(torch.tensor([(context + continuation)[:-1]])).logits[0, -len(continuation) :]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(continuation)[:, None])[:, 0]
        assert (torch.tensor(s.token_logprobs) - want).abs().max() <= 1e-5
    assert [s.cached_tokens for s in runs["1"]] == [s.cached_tokens for s in runs["0"]]
    assert runs["1"][0].cached_tokens == 40 and runs["1"][1].cached_tokens == 20


def test_prefix_stays_pinned_while_rows_read_it():
    """The call's leases hold the prefix to the end: after a flush mid-decode, every free block
    is taken and overwritten with NaN, and the output is still stock's (nothing it reads was
    free); the call commits nothing (its KV predates the flush)."""
    model = shared("llama-sdpa")
    store = store_for(model)
    _warm(model, store)
    pinned = []

    class Squeeze:  # a logits processor: runs between decode steps
        def __call__(self, input_ids, scores):
            pinned.append(store.stats()["pinned_blocks"])
            store.flush()
            poison_free_blocks(store)
            return scores

    from transformers import LogitsProcessorList

    input_ids, mask = left_pad([DOC + tokens(5, 19), DOC[:21] + tokens(2, 25)])
    ref = _generate(model, input_ids, mask)
    cache = RadixCache(store=store)
    out = _generate(model, input_ids, mask, cache, logits_processor=LogitsProcessorList([Squeeze()]))
    _assert_same(out, ref)
    assert cache.cached_tokens == [40, 17] and pinned[0] == 10  # pads 0, 23; common 40
    assert store.stats()["pinned_blocks"] == 0 and store.stats()["cached_blocks"] == 0
    store.check_invariants()


def test_fallback_inside_a_forward_is_exact(monkeypatch, caplog):
    """A call the paged route cannot take reads a transient full copy: still stock's output."""
    model = shared("llama-sdpa")
    store = store_for(model)
    _warm(model, store)
    monkeypatch.setattr(paged_attention, "_plain", lambda *a: False)
    monkeypatch.setattr(paged_attention, "_logged", set())
    input_ids, mask = left_pad([DOC + tokens(5, 21), DOC[:17] + tokens(3, 22)])
    with caplog.at_level(logging.WARNING, logger="hf_patch.paged_attention"):
        out = _generate(model, input_ids, mask, RadixCache(store=store))
    _assert_same(out, _generate(model, input_ids, mask))
    assert any("full copy of its prefix" in r.message for r in caplog.records)


# Families the paged path takes (tests/hf_models.py); the others keep the copy path for a logged
# reason (eager or sliding attention, or a failed probe: Falcon, DeepSeek-V3's MLA, DiffLlama).
PAGED_FAMILIES = (
    "llama-sdpa", "gpt2", "phi3", "qwen3", "cohere", "stablelm", "granite", "olmo2", "gpt-neox", "phi",
    "glm4", "smollm3-norope", "gpt-bigcode-mqa", "gemma", "biogpt", "lfm2-attention-only",
)  # fmt: skip


@pytest.mark.parametrize("family", PAGED_FAMILIES)
def test_family_equals_stock(family):
    model = shared(family)
    assert paged_attention.unusable_reason(model, model_layout(model), True) is None
    store = store_for(model)
    _warm(model, store)
    input_ids, mask = left_pad([DOC + tokens(6, 7), DOC[:30] + tokens(9, 8), DOC[:13] + tokens(20, 9)])
    cache = RadixCache(store=store)
    _assert_same(_generate(model, input_ids, mask, cache), _generate(model, input_ids, mask))
    assert cache.cached_tokens == [26, 18, 12]  # pads 0, 8, 14; common = 14 + 12


def test_other_families_keep_the_copy_path():
    from tests.hf_models import FAMILIES

    for family in sorted(set(FAMILIES) - set(PAGED_FAMILIES)):
        model = shared(family)
        assert paged_attention.unusable_reason(model, model_layout(model), True) is not None, family


# -- where it does not apply -------------------------------------------------------------------------
def test_copy_path_where_it_does_not_apply(monkeypatch, caplog, counted):
    monkeypatch.setattr(paged_attention, "_logged", set())
    model = shared("llama-eager")
    store = store_for(model)
    _warm(model, store)
    input_ids, mask = left_pad([DOC + tokens(5, 23)])
    with caplog.at_level(logging.WARNING, logger="hf_patch.paged_attention"):
        cache = RadixCache(store=store)
        _assert_same(_generate(model, input_ids, mask, cache), _generate(model, input_ids, mask))
        _generate(model, input_ids, mask, RadixCache(store=store))
    assert counted["merges"] == 0 and cache.cached_tokens == [40]
    said = [r.message for r in caplog.records if "not 'sdpa'" in r.message]
    assert len(said) == 1, said  # once per reason
    monkeypatch.setenv("RADIXKV_PAGED_ATTENTION", "0")
    sdpa = shared("llama-sdpa")
    store = store_for(sdpa)
    _warm(sdpa, store)
    cache = RadixCache(store=store)
    _generate(sdpa, input_ids, mask, cache)
    assert counted["merges"] == 0 and cache.cached_tokens == [40]
    cache = RadixCache(store=store, paged=True)  # the option wins over the setting
    _generate(sdpa, input_ids, mask, cache)
    assert counted["merges"] > 0 and cache.cached_tokens == [44]  # (the last call committed 51)
    monkeypatch.delenv("RADIXKV_PAGED_ATTENTION")  # the default: the copy path
    merges = counted["merges"]
    cache = RadixCache(store=store)
    _generate(sdpa, input_ids, mask, cache)
    assert counted["merges"] == merges and cache.cached_tokens == [44]


def test_host_tier_prefix_takes_the_copy_path(counted):
    model = shared("llama-sdpa")
    store = hf_patch.build_store(model, block_size=4, budget_tokens=64, host_cache_tokens=1024)
    _warm(model, store)
    model.generate(torch.tensor([tokens(44, 26)]), past_key_values=RadixCache(store=store), max_new_tokens=3)
    assert store.stats()["demoted_blocks"] > 0
    input_ids, mask = left_pad([DOC + tokens(5, 24)])
    cache = RadixCache(store=store)
    _assert_same(_generate(model, input_ids, mask, cache), _generate(model, input_ids, mask))
    assert counted["merges"] == 0 and cache.cached_tokens == [40]
    assert store.stats()["host_hit_tokens"] > 0


def test_bad_settings_are_named(monkeypatch):
    with pytest.raises(TypeError, match="paged must be None, True or False"):
        RadixCache(paged="yes")
    monkeypatch.setenv("RADIXKV_PAGED_ATTENTION", "maybe")
    with pytest.raises(ValueError, match="RADIXKV_PAGED_ATTENTION must be 0, 1 or auto"):
        paged_attention.setting()


def test_probe_refuses_a_model_computing_attention_twice():
    model = shared("diffllama")
    assert paged_attention.unusable_reason(model, model_layout(model), None) is not None


# -- the store's side ------------------------------------------------------------------------------
def test_read_in_place_and_commit_from_an_offset():
    model = shared("llama-sdpa")
    store = store_for(model)
    specs = model_layout(model).specs
    g = torch.Generator().manual_seed(2)
    k = [torch.randn(1, s.num_kv_heads, 24, s.k_head_dim, generator=g) for s in specs]
    v = [torch.randn(1, s.num_kv_heads, 24, s.v_head_dim, generator=g) for s in specs]
    toks = tokens(24, 30)
    assert store.commit(toks[:12], k, v) == 12
    # the rest from token 12 on only: the store holds the first 12 already
    assert store.commit(toks, [t[:, :, 12:] for t in k], [t[:, :, 12:] for t in v], offset=12) == 12
    with store.acquire(toks) as lease:
        rows = store.read_in_place([lease], [22])
        assert rows == [list(lease.block_ids[:6])]
        got = torch.cat([store.pool.k[0][b] for b in rows[0]])[:22].transpose(0, 1)
        assert torch.equal(got, k[0][0, :, :22])
        with pytest.raises(ValueError, match="lease holds 24 tokens, 25 requested"):
            store.read_in_place([lease], [25])
        with pytest.raises(ValueError, match="1 token counts for 2 leases"):
            store.read_in_place([lease, lease], [1])
    other = tokens(24, 31)  # nothing of it cached: a source from token 8 cannot be committed
    assert store.commit(other, [t[:, :, 8:] for t in k], [t[:, :, 8:] for t in v], offset=8) == 0
    store.check_invariants()


def test_rows_parting_after_a_shared_start_equal_stock(counted, monkeypatch):
    """Two cached branches after DOC[:20]: the rows' block lists share 5 blocks (attended once
    for both), then each reads its own tail of the pool."""
    plans = []
    build = paged_attention.build_plan
    monkeypatch.setattr(paged_attention, "build_plan", lambda *a: plans.append(build(*a)) or plans[-1])
    model = shared("llama-sdpa")
    store = store_for(model)
    branches = [DOC[:20] + tokens(20, 40), DOC[:20] + tokens(20, 41)]
    for b in branches:
        model.generate(torch.tensor([b]), past_key_values=RadixCache(store=store), max_new_tokens=1)
    input_ids, mask = left_pad([b + tokens(3, 42 + i) for i, b in enumerate(branches)])
    cache = RadixCache(store=store)
    out = _generate(model, input_ids, mask, cache)
    assert counted["merges"] > 0
    _assert_same(out, _generate(model, input_ids, mask))
    assert cache.cached_tokens == [40, 40]
    plan = plans[-1]  # (the second branch's call read the first 20 tokens too)
    assert [c.length for c in plan.clusters] == [20] and [t.length for t in plan.tails] == [20, 20]


def test_batch_select_indices_moves_the_plans_rows():
    """RadixCache.batch_select_indices with a live plan keeps the selected rows' clusters (it
    read a field the plan does not have: AttributeError)."""
    model = shared("llama-sdpa")
    layout = model_layout(model)
    pool = [torch.zeros(4, 4, 2, 16) for _ in layout.kv_layers]
    cache = RadixCache(paged=True)
    cache.paged_plan = paged_attention.build_plan(layout, cache, pool, pool, 4, [(1, 2), (1, 3)], [0, 0], 8)
    before = cache.paged_plan.row_cluster.clone()
    cache.layers = []
    cache.batch_select_indices(torch.tensor([1]))
    assert cache.paged_plan.row_cluster.tolist() == before[[1]].tolist()
