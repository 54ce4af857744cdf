"""hf_patch.running_batch: newcomers seated for a packed step (RunningBatch.seat). Their prompts
are computed inside the next step beside the running rows' tokens, one packed sequence through
the ragged kernel, and each row's tokens equal stock generate() of it alone, over families of
several attention layouts. The packed probe refuses a kernel that computes wrong; bad calls are
refused by name and change nothing."""

from __future__ import annotations

import logging

import pytest
import torch

import hf_patch
from cuda_ext import ragged_decode
from hf_patch import running_batch
from hf_patch.running_batch import RunningBatch, packs, prefill_keys
from tests.hf_models import EOS, PAD, build, greedy_reply, one_torch_thread, shared, store_for, tokens  # noqa: F401

pytestmark = pytest.mark.skipif(
    not ragged_decode.available(), reason="numba is not installed (the demo extra)"
)


def prompt_tokens(query, slots) -> int:
    """Query tokens of a packed kernel call beyond one per row: the prompt tokens it computes."""
    return query.shape[0] - len(set(slots.tolist()))


def fail_prompt_steps(monkeypatch) -> None:
    """The packed kernel raises MemoryError("simulated") in a step that computes prompt tokens
    (memory on a big prompt, say); plain decode steps run."""
    real = ragged_decode.ragged_packed

    def failing(query, key, value, slots, starts, ends, scale):
        if prompt_tokens(query, slots):
            raise MemoryError("simulated")
        return real(query, key, value, slots, starts, ends, scale)

    monkeypatch.setattr(ragged_decode, "ragged_packed", failing)


@pytest.fixture
def packed_calls(monkeypatch):
    """Prompt tokens of each packed kernel call (0: a plain decode step)."""
    calls = []
    real = ragged_decode.ragged_packed

    def counted(query, key, value, slots, starts, ends, scale):
        calls.append(prompt_tokens(query, slots))
        return real(query, key, value, slots, starts, ends, scale)

    monkeypatch.setattr(ragged_decode, "ragged_packed", counted)
    return calls


def greedy_rows(model, store, schedule: dict[int, list[tuple[list[int], int]]], steps: int) -> dict:
    """Seat each (prompt, new tokens) of ``schedule[k]`` before step k; decode greedily, each row
    removed (committed) at its length. Returns {prompt tuple: (tokens, cached)}."""
    batch = RunningBatch(model, store, PAD, [EOS])
    running: dict[int, list] = {}  # slot -> [prompt, new, out, cached]
    done = {}
    for k in range(steps):
        if k in schedule:
            keys = prefill_keys(model, hf_patch.RadixCache(store=store), len(schedule[k])) if store else None
            slots, cached = batch.seat([p for p, _ in schedule[k]], keys)
            for slot, (p, new), hit in zip(slots, schedule[k], cached):
                running[slot] = [p, new, [], hit]
        if not running:
            continue
        logits = batch.step()
        picks = logits.argmax(dim=-1).tolist()
        batch.set_next([picks[i] if i in running else PAD for i in range(batch.size)])
        ended = []
        for i, row in running.items():
            row[2].append(picks[i])
            if len(row[2]) >= row[1] or picks[i] == EOS:  # as stock generate() stops
                ended.append(i)
        batch.remove(ended)
        for i in ended:
            p, _, out, hit = running.pop(i)
            done[tuple(p)] = (out, hit)
        moved = batch.compact()
        if moved is not None:
            old = dict(running)
            running = {j: old[i] for j, i in enumerate(moved) if i in old}
    assert not running and batch.size == 0
    return done


# MQA, MLA (another value head size), granite's own attention scale, partial rotary, q/k norms
@pytest.mark.parametrize(
    "family", ["llama-sdpa", "qwen3", "gpt-bigcode-mqa", "deepseek-v3-mla", "granite", "gpt-neox"]
)
def test_rows_seated_at_different_steps_equal_stock_alone(family, packed_calls):
    model = build(family)
    assert packs(model)
    packed_calls.clear()  # the probe's
    a, b, c, d = tokens(9, 1), tokens(5, 2), tokens(30, 3), tokens(1, 4)
    # b joins a decoding row; c is wider than the batch (a re-layout); d (one token) and a
    # second b join later, after a's slot was freed
    schedule = {0: [(a, 6)], 2: [(b, 9), (c, 5)], 7: [(d, 4), (b + tokens(3, 5), 3)]}
    done = greedy_rows(model, None, schedule, 20)
    for rows in schedule.values():
        for prompt, new in rows:
            assert done[tuple(prompt)][0] == greedy_reply(model, prompt, new), (family, len(prompt))
    # the prompts were computed inside steps 0, 2 and 7 (d alone would need none: one token),
    # in every layer; the other steps were plain decode steps through the kernel
    layers = model.config.num_hidden_layers
    assert len([c for c in packed_calls if c > 0]) == 3 * layers
    assert len(packed_calls) > 3 * layers


def test_a_seated_row_reads_its_cached_prefix_and_its_prompt_is_committed_after_its_step():
    model = shared("llama-sdpa")
    store = store_for(model)
    prompt = tokens(21, 7)
    first = greedy_rows(model, store, {0: [(prompt, 4)]}, 6)
    assert first[tuple(prompt)] == (greedy_reply(model, prompt, 4), 0)
    # the same prompt again: read from the store up to its last token (whole blocks of 4)
    again = greedy_rows(model, store, {0: [(prompt, 4)]}, 6)
    assert again[tuple(prompt)] == (greedy_reply(model, prompt, 4), 20)
    # a longer prompt beside a decoding row: prompt + reply were committed at removal
    follow = prompt + first[tuple(prompt)][0][:3] + tokens(6, 8)
    other = tokens(12, 9)
    both = greedy_rows(model, store, {0: [(other, 8)], 3: [(follow, 5)]}, 12)
    assert both[tuple(follow)] == (greedy_reply(model, follow, 5), 24)
    assert both[tuple(other)][0] == greedy_reply(model, other, 8)
    # the seated prompt was committed right after its step, before the row ended
    batch = RunningBatch(model, store, PAD, [EOS])
    fresh = tokens(17, 10)
    keys = prefill_keys(model, hf_patch.RadixCache(store=store), 1)
    batch.seat([fresh], keys)
    batch.step()
    key = keys.keys.row(0, torch.tensor(fresh), 0)
    lease = store.acquire(key.tokens, key.namespace)
    assert lease.num_tokens == 16
    lease.release()
    batch.remove(batch.rows)
    assert store.stats()["pinned_blocks"] == 0


def test_a_packed_step_that_computes_wrong_is_refused_by_the_probe(monkeypatch, caplog):
    model = build("llama-sdpa")
    real = ragged_decode.ragged_packed

    def off(query, key, value, slots, starts, ends, scale):
        out = real(query, key, value, slots, starts, ends, scale)
        return out + (prompt_tokens(query, slots) > 0)  # wrong only in steps with prompt tokens

    monkeypatch.setattr(ragged_decode, "ragged_packed", off)
    with caplog.at_level(logging.WARNING, logger="hf_patch.running_batch"):
        assert packs(model) is False
    assert "prefill calls" in caplog.text and "differ" in caplog.text
    assert packs(model) is False  # remembered on the model
    with pytest.raises(ValueError, match="cannot join inside a step"):
        RunningBatch(model, None, PAD, [EOS]).seat([tokens(4, 1)])


def test_models_without_the_kernel_do_not_pack(monkeypatch):
    monkeypatch.setenv("RADIXKV_RAGGED_ATTENTION", "0")
    assert packs(build("llama-sdpa")) is False
    monkeypatch.delenv("RADIXKV_RAGGED_ATTENTION")
    assert packs(build("llama-eager")) is False  # eager attention keeps eager


def test_bad_seats_are_refused_by_name_and_change_nothing():
    model = shared("llama-sdpa")
    batch = RunningBatch(model, None, PAD, [EOS])
    (slot,), _ = batch.seat([tokens(6, 11)])
    before = (batch.size, batch.width, batch.ids.clone(), batch.mask.clone(), list(batch.pending))
    with pytest.raises(ValueError, match="non-empty"):
        batch.seat([[]])
    with pytest.raises(ValueError, match="key rows"):
        batch.seat([tokens(3, 12)], None, [0, 1])
    after = (batch.size, batch.width, batch.ids, batch.mask, batch.pending)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])
    assert before[4] == after[4]
    assert batch.step().argmax(dim=-1)[slot].item() == greedy_reply(model, tokens(6, 11), 1)[0]


def test_the_packed_probe_runs_once_per_model(monkeypatch):
    model = build("llama-sdpa")
    probes = []
    real = running_batch._probe_packed
    monkeypatch.setattr(running_batch, "_probe_packed", lambda m: probes.append(1) or real(m))
    assert packs(model) and packs(model) and RunningBatch(model).packed
    assert probes == [1]


def test_a_store_read_that_fails_leaves_no_row_seated_and_the_running_row_exact(monkeypatch):
    model = shared("llama-sdpa")
    store = store_for(model)
    prompt = tokens(21, 7)
    greedy_rows(model, store, {0: [(prompt, 2)]}, 3)  # its prompt is in the store now
    batch = RunningBatch(model, store, PAD, [EOS])
    other = tokens(9, 3)
    (slot,), _ = batch.seat([other])  # no keys: nothing read
    out = [int(batch.step()[slot].argmax())]

    def failing(*args, **kwargs):
        raise RuntimeError("store read failed (simulated)")

    monkeypatch.setattr(store, "read", failing)
    monkeypatch.setattr(store, "read_in_place", failing)  # (a prefix read in place: RunningBatch.pools)
    keys = prefill_keys(model, hf_patch.RadixCache(store=store), 2)
    batch.set_next([out[-1] if i == slot else PAD for i in range(batch.size)])
    # the first newcomer needs no read and is seated; the second's read fails: neither stays
    with pytest.raises(RuntimeError, match="simulated"):
        batch.seat([tokens(5, 12), prompt], keys)
    assert batch.rows == [slot] and not any(batch.pending) and store.stats()["pinned_blocks"] == 0
    for _ in range(5):
        logits = batch.step()
        out.append(int(logits[slot].argmax()))
        batch.set_next([out[-1] if i == slot else PAD for i in range(batch.size)])
    assert out == greedy_reply(model, other, 6)


def test_a_seated_row_before_its_step_commits_nothing():
    model = shared("llama-sdpa")
    store = store_for(model)
    batch = RunningBatch(model, store, PAD, [EOS])
    keys = prefill_keys(model, hf_patch.RadixCache(store=store), 1)
    (slot,), _ = batch.seat([tokens(20, 14)], keys)
    assert batch.commit(slot) == 0 and batch.remove([slot]) == 0  # its columns have no KV yet
    assert store.stats()["inserted_tokens"] == 0


def test_a_weights_change_flushes_the_store_before_a_seat_reads_it():
    """As generate() does: KV cached under other weights is never read (nor built upon)."""
    model = build("llama-sdpa")
    store = store_for(model)
    prompt = tokens(21, 15)
    assert greedy_rows(model, store, {0: [(prompt, 3)]}, 4)[tuple(prompt)][1] == 0
    assert greedy_rows(model, store, {0: [(prompt, 3)]}, 4)[tuple(prompt)][1] == 20
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.05)
    out, hit = greedy_rows(model, store, {0: [(prompt, 3)]}, 4)[tuple(prompt)]
    assert hit == 0 and out == greedy_reply(model, prompt, 3)
    # what that seat computed belongs to the store's new epoch: it was kept
    assert greedy_rows(model, store, {0: [(prompt, 3)]}, 4)[tuple(prompt)] == (out, 20)


def test_a_failing_packed_step_drops_only_the_joining_rows(monkeypatch):
    model = shared("llama-sdpa")
    batch = RunningBatch(model, None, PAD, [EOS])
    other = tokens(9, 16)
    (slot,), _ = batch.seat([other])
    out = [int(batch.step()[slot].argmax())]
    batch.set_next([out[-1] if i == slot else PAD for i in range(batch.size)])
    fail_prompt_steps(monkeypatch)
    (joining,), _ = batch.seat([tokens(12, 17)])
    with pytest.raises(running_batch.JoinFailed) as info:
        batch.step()
    assert info.value.slots == [joining] and isinstance(info.value.__cause__, MemoryError)
    assert batch.rows == [slot] and not any(batch.pending)
    for _ in range(5):
        out.append(int(batch.step()[slot].argmax()))
        batch.set_next([out[-1] if i == slot else PAD for i in range(batch.size)])
    assert out == greedy_reply(model, other, 6)
