"""hf_patch.running_batch over models with recurrent state (hf_patch.slot_states): Qwen3.5-style
Gated DeltaNet + attention and Mamba-2 rows admitted at different steps, of different prompt
lengths, greedy and seeded, decode one forward per step from per-slot states and equal stock
generate() of each row alone (tokens exactly, logits within 1e-4); a finished row commits a
snapshot at its last whole block, so the next turn of its chat reads all of it."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_patch
from hf_patch.running_batch import RunningBatch, prefill_keys, prefill_tensors, unsupported_reason
from tests.hf_models import one_torch_thread  # noqa: F401
from tests.hybrid_models import EOS, PAD, build_hybrid, layer_pattern, tokens
from tests.test_step_loop import Row

FAMILIES = ["qwen3_5_text", "mamba2"]
ATOL = 1e-4
BS = 4


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    m = build_hybrid(request.param)
    print(request.param, layer_pattern(m))  # the mix under test (L: state, A: attention)
    return m


def store_for(model):
    return hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=16)


class Logged(Row):
    """A Row that keeps the logits each of its tokens was picked from."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits: list[torch.Tensor] = []

    def pick(self, logits):
        self.logits.append(logits.clone())
        return super().pick(logits)


def stock_alone(model, row: Row) -> tuple[list[int], list[torch.Tensor]]:
    kwargs = dict(max_new_tokens=row.new, pad_token_id=PAD, eos_token_id=EOS)
    kwargs.update(output_logits=True, return_dict_in_generate=True)
    if row.seed is None:
        kwargs.update(do_sample=False)
    else:
        torch.manual_seed(row.seed)
        kwargs.update(do_sample=True, temperature=row.temperature, top_k=None, top_p=None)
    with torch.no_grad():
        out = model.generate(torch.tensor([row.prompt]), **kwargs)
    return out.sequences[0, len(row.prompt) :].tolist(), [step[0].float() for step in out.logits]


def assert_stock(model, row: Logged) -> None:
    want, logits = stock_alone(model, row)
    assert row.out == want, row.prompt
    for step, (got, ref) in enumerate(zip(row.logits, logits)):
        diff = (got - ref).abs().max().item()
        assert diff < ATOL, f"step {step}: logits differ by {diff:.3g}"


def admit(batch, model, store, rows, running, cache_prompt=True):
    """The step loop's admission: a prefill generate() of one token (a RadixCache catches each
    row up alone; a plain cache only for rows of one length), its KV and states spliced in."""
    ids = torch.tensor([[PAD] * (max(len(r.prompt) for r in rows) - len(r.prompt)) + r.prompt for r in rows])
    mask = (ids != PAD).long()
    if cache_prompt:
        cache = hf_patch.RadixCache(store=store)
    else:
        cache = DynamicCache(config=model.config)
    arg = batch.layout.cache_arg if not cache_prompt else "past_key_values"
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, **{arg: cache}, max_new_tokens=1, do_sample=False,
            pad_token_id=PAD, eos_token_id=EOS, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    first = [r.pick(out.logits[0][i].float()) for i, r in enumerate(rows)]
    for i, r in enumerate(rows):
        r.out.append(first[i])
        r.cached = cache.cached_tokens[i] if cache_prompt else 0
    kv, states = prefill_tensors(model, cache, mask)
    keys = prefill_keys(model, cache, len(rows)) if cache_prompt else None
    slots = batch.admit(kv, ids, mask, first, keys, states=states)
    running.update(zip(slots, rows))


def run(batch, running, steps):
    for _ in range(steps):
        retire(batch, running)
        if not running:
            return
        logits = batch.step()
        picks = [running[i].pick(logits[i]) if i in running else PAD for i in range(batch.size)]
        batch.set_next(picks)
        for i, r in running.items():
            r.out.append(picks[i])
    retire(batch, running)


def retire(batch, running):
    done = [i for i, r in running.items() if len(r.out) >= r.new or r.out[-1] == EOS]
    batch.remove(done)
    for i in done:
        del running[i]
    moved = batch.compact()
    if moved is not None:
        old = dict(running)
        running.clear()
        running.update({j: old[i] for j, i in enumerate(moved)})


def test_rows_joining_and_leaving_at_different_steps_equal_stock_alone(model):
    assert unsupported_reason(model) is None
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    a = Logged(tokens(20, 1), 10)
    b = Logged(tokens(7, 2), 7, seed=5)
    c = Logged(tokens(31, 3), 5)  # wider than the batch: a re-layout moves every row's states
    d = Logged(tokens(5, 4), 6, seed=11, temperature=1.3)
    running: dict = {}
    admit(batch, model, store, [a], running)
    run(batch, running, 3)
    admit(batch, model, store, [b, c], running)  # one padded prefill, each row caught up alone
    run(batch, running, 2)
    admit(batch, model, store, [d], running)  # into a slot freed or added
    run(batch, running, 20)
    assert batch.size == 0 and not running
    for r in (a, b, c, d):
        assert_stock(model, r)
    store.check_invariants()


def test_a_prompt_prefilled_in_slices_continues_from_the_last_slices_state(model):
    """demo's Runner.prefill: a long prompt's slices (block multiples) are generate() calls of
    one token on a RadixCache, each committing a snapshot at its end; the admission reads the
    last one and computes only the rest."""
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    row = Logged(tokens(45, 12), 6, seed=2)
    for end in (16, 32):
        with torch.no_grad():
            model.generate(torch.tensor([row.prompt[:end]]), past_key_values=hf_patch.RadixCache(store=store),
                           max_new_tokens=1, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)  # fmt: skip
    running: dict = {}
    admit(batch, model, store, [row], running)
    assert row.cached == 32
    run(batch, running, 10)
    assert_stock(model, row)


def test_a_chats_second_turn_reads_the_whole_first_turn(model):
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    first, beside = Logged(tokens(30, 5), 11), Logged(tokens(13, 6), 15)
    running: dict = {}
    admit(batch, model, store, [first, beside], running)
    run(batch, running, 12)  # the first leaves (committed) while the other decodes on
    assert list(running.values()) == [beside]
    fed = len(first.prompt) + len(first.out) - 1  # its last token was never fed
    assert fed % BS == 0  # so the state after exactly its fed tokens is a snapshot
    second = Logged(first.prompt + first.out + tokens(5, 7), 6)
    admit(batch, model, store, [second], running)
    # the whole first turn (prompt + reply) is read; without the decode's snapshot only its prompt
    assert second.cached == fed
    run(batch, running, 20)
    for r in (first, beside, second):
        assert_stock(model, r)
    store.check_invariants()


def test_a_plain_cache_prefill_of_one_length_joins_and_padded_rows_are_refused(model):
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    rows = [Logged(tokens(9, 8), 5), Logged(tokens(9, 9), 5, seed=3)]
    running: dict = {}
    admit(batch, model, store, rows, running, cache_prompt=False)  # no padding: each row as alone
    run(batch, running, 10)
    for r in rows:
        assert_stock(model, r)
    assert store.stats()["inserted_tokens"] == 0  # never committed
    ids = torch.tensor([[PAD, PAD, *tokens(4, 10)], tokens(6, 11)])
    mask = (ids != PAD).long()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{batch.layout.cache_arg: cache})
    with pytest.raises(ValueError, match="include the padding"):
        prefill_tensors(model, cache, mask)


@pytest.mark.parametrize("name", ["falcon_h1", "mamba"])
def test_a_kv_and_state_layer_and_a_mamba1_mixer_decode_exactly(name):
    """Falcon-H1: KV and states in one layer; Mamba-1: a mixer whose multi-token forward takes no
    initial state (its prefill continues from a snapshot a token at a time, in generate())."""
    model = build_hybrid(name)
    print(name, layer_pattern(model))
    assert unsupported_reason(model) is None
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    a, b = Logged(tokens(17, 13), 8), Logged(tokens(6, 14), 5, seed=4)
    running: dict = {}
    admit(batch, model, store, [a], running)
    run(batch, running, 2)
    admit(batch, model, store, [b], running)
    run(batch, running, 10)
    follow = Logged(a.prompt + a.out + tokens(3, 15), 4)
    admit(batch, model, store, [follow], running)
    assert follow.cached == (len(a.prompt) + len(a.out) - 1) // BS * BS
    run(batch, running, 10)
    for r in (a, b, follow):
        assert_stock(model, r)


@pytest.mark.parametrize("name, why", [("bamba", "differ"), ("deepseek_v32", "indexed"), ("zaya", "sliding")])
def test_layouts_the_step_cannot_serve_are_refused_with_a_reason(name, why):
    # bamba: its decode step over a padded batch reads the mask its own way (the probe sees it)
    reason = unsupported_reason(build_hybrid(name))
    assert reason is not None and why in reason, reason
