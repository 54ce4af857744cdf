"""Hybrid, recurrent, sparse-indexed and shared-KV families against stock generate(): every family
transformers 5.23 runs with a Cache object, on tiny random configs whose layer pattern mixes the
kinds (DSA indexers with 16 heads and a top-k below the prompt, so the selection matters).

Per family, on one store (block size 4, a snapshot every 16 tokens): a document and three
questions (cold; the second reuses it but at most one interval; the third all of it), a chat
turn that reuses the whole history, a 3-row left-padded batch, seeded sampling, a fully cached
prompt, scores against an uncached forward, and a restart from a cache file (a fresh process
and the sidecar: tests/test_hf_persist_states.py, tests/test_sidecar_snapshots.py). Tokens must be equal and logits within 1e-4
(a stale recurrent state moves them by 1e-2 to 1: ``test_a_wrong_snapshot_is_caught``).
"""

from __future__ import annotations

import pytest
import torch

import hf_patch
from tests.hf_models import assert_outputs_equal, ids, left_pad, one_torch_thread, stock  # noqa: F401
from tests.hybrid_models import PATTERNS, SUPPRESS, build_hybrid, layer_pattern, tokens

ATOL = 1e-4
# Zamba2 (init 0.1 so its tokens vary): stock's own continuation of a chat from the cache its
# decode filled differs from a fresh prefill by 6.7e-5 (decode recurrence vs chunked scan,
# amplified); radixkv reads the decode's snapshot too, so that error is stock's, not ours.
FAMILY_ATOL = {"zamba2": 2e-4}
INTERVAL = 16
BS = 4
# Mamba-1 mixers (transformers' selective scan takes no initial state): after a snapshot only one
# token at a time, so no periodic snapshots and the second question recomputes the document.
STEPWISE = {"mamba", "falcon_mamba", "jamba", "zamba"}
SUPPORTED = (
    "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "kimi_linear", "olmo_hybrid", "jamba",
    "bailing_hybrid", "nemotron_h", "lfm3", "mamba", "mamba2", "falcon_mamba", "bamba",
    "granitemoehybrid", "falcon_h1", "zamba", "zamba2", "zaya", "inkling_text", "gemma3n_text",
    # sparse attention's indexer keys page like KV (Qwen4-Exp: with linear attention too)
    "deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2", "dots3_note_text", "qwen4_exp_text",
)  # fmt: skip
DOC = tokens(70, seed=1)
GEN = dict(max_new_tokens=6, suppress_tokens=SUPPRESS, do_sample=False)


def same_as_stock(model, input_ids, store, seed=None, atol=ATOL, **kwargs):
    """RadixCache output equals stock's (tokens exactly, logits within ATOL); returns the cache."""
    kwargs = {**GEN, **kwargs}
    ref = stock(model, input_ids, seed=seed, **kwargs)
    cache = hf_patch.RadixCache(store=store)
    if seed is not None:
        torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids, past_key_values=cache, output_logits=True, return_dict_in_generate=True, **kwargs
        )
    assert_outputs_equal(ref, out, atol=atol)
    store.check_invariants()
    stats = store.stats()
    assert stats["pinned_blocks"] == stats["task_pinned_blocks"], "a finished call left blocks pinned"
    return cache, out


@pytest.mark.parametrize("name", SUPPORTED)
def test_family_matches_stock_and_reuses_its_prefixes(name, tmp_path):
    model = build_hybrid(name)
    pattern = layer_pattern(model)
    print(f"{name}: {pattern}")
    assert pattern == PATTERNS[name]
    layout = hf_patch.model_spec.model_layout(model)
    assert layout.continues_in_chunks == (name not in STEPWISE)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    atol = FAMILY_ATOL.get(name, ATOL)

    def same_as_stock(*args, **kwargs):
        return globals()["same_as_stock"](*args, atol=atol, **kwargs)

    # A document and three questions.
    cached = [same_as_stock(model, ids(DOC + tokens(n, seed=s)), store)[0].cached_tokens[0]
              for n, s in ((9, 2), (11, 3), (7, 4))]  # fmt: skip
    doc_blocks = len(DOC) // BS * BS
    if name in STEPWISE:
        assert cached == [0, 0, doc_blocks]
    else:
        assert cached[0] == 0 and doc_blocks - INTERVAL < cached[1] <= doc_blocks and cached[2] == doc_blocks

    # A chat turn: the whole history (to its last whole block) is reused.
    _, out = same_as_stock(model, ids(DOC[:40] + tokens(5, seed=9)), store, max_new_tokens=10)
    history = out.sequences[0].tolist()
    cache, _ = same_as_stock(model, ids(history + tokens(6, seed=10)), store)
    assert cache.cached_tokens == [(len(history) - 1) // BS * BS]

    # A fully cached prompt: everything but the last token is read.
    cache, _ = same_as_stock(model, ids(history + tokens(6, seed=10)), store)
    assert cache.cached_tokens == [(len(history) + 5) // BS * BS]

    # A left-padded batch: rows reuse what each has, one with none.
    rows = [DOC + tokens(3, seed=20), DOC[:42] + tokens(8, seed=21), tokens(30, seed=22)]
    input_ids, mask = left_pad(rows)
    cache, _ = same_as_stock(model, input_ids, store, attention_mask=mask)
    # (a stateful row reads its own snapshot; a KV-only batch preloads one column for all rows)
    assert cache.cached_tokens[0] == doc_blocks if layout.stateful else cache.cached_tokens[0] > 0
    assert cache.cached_tokens[2] == 0

    # Seeded sampling, and n sampled sequences of one prompt.
    same_as_stock(model, ids(DOC + tokens(9, seed=2)), store, seed=5, do_sample=True)
    cache, _ = same_as_stock(
        model, ids(DOC + tokens(9, seed=2)), store, seed=6, do_sample=True, num_return_sequences=3
    )
    assert len(set(cache.cached_tokens)) == 1 and cache.cached_tokens[0] >= doc_blocks

    # Scores equal an uncached forward.
    pairs = [(DOC + tokens(5, seed=30), tokens(4, seed=31)), (tokens(20, seed=34), tokens(3, seed=35))]
    for _ in range(2):
        for (context, continuation), score in zip(pairs, hf_patch.score(model, pairs, store=store)):
            with torch.no_grad():
                logits = model(torch.tensor([context + continuation])).logits[0, len(context) - 1 : -1]
            want = logits.log_softmax(-1).gather(1, torch.tensor(continuation).unsqueeze(1)).sum().item()
            assert abs(score.logprob - want) < ATOL, (score.logprob, want)
    store.check_invariants()

    # A restart from a cache file: a new store restored from the saved one reads the document.
    path = tmp_path / "cache.safetensors"
    hf_patch.save_cache(model, path, store=store)
    fresh = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    hf_patch.restore_cache(model, path, store=fresh)
    cache, _ = same_as_stock(model, ids(DOC + tokens(7, seed=99)), fresh)
    assert cache.cached_tokens == [doc_blocks]


def test_a_wrong_snapshot_is_caught():
    """The oracle can fail: a snapshot of another prefix served for this one moves the logits."""
    model = build_hybrid("qwen3_5_text")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    same_as_stock(model, ids(DOC + tokens(9, seed=2)), store)
    with store._lock:  # every snapshot slot now holds the first one's states
        first = min(store.states.used_slots())
        for slot in store.states.used_slots():
            for t in store.states.tensors:
                t[slot] = t[first]
    with pytest.raises(AssertionError, match="logits|sequences"):
        same_as_stock(model, ids(DOC + tokens(11, seed=3)), store)


def test_a_mamba_call_takes_the_cache_as_past_key_values_or_cache_params():
    model = build_hybrid("mamba2")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    same_as_stock(model, ids(DOC + tokens(9, seed=2)), store)
    ref = stock(model, ids(DOC + tokens(9, seed=3)), **GEN)
    cache = hf_patch.RadixCache(store=store)
    with torch.no_grad():
        out = model.generate(
            ids(DOC + tokens(9, seed=3)), cache_params=cache, output_logits=True, return_dict_in_generate=True,
            **GEN,
        )  # fmt: skip
    assert_outputs_equal(ref, out, atol=ATOL)
    assert cache.cached_tokens[0] > 0


@pytest.mark.parametrize("name", ["recurrent_gemma", "minimax"])
def test_families_whose_state_is_not_in_the_cache_are_refused_naming_why(name):
    model = build_hybrid(name)
    with pytest.raises(hf_patch.UnsupportedModelError, match="docs/models.md") as info:
        model.generate(ids(DOC[:12]), max_new_tokens=2, past_key_values=hf_patch.RadixCache())
    assert type(model).__name__ in str(info.value)
    if name == "recurrent_gemma":  # the modules and attributes that hold it (docs/models.md#recurrentgemma)
        assert "model.layers.0.temporal_block: conv1d_state and rg_lru.recurrent_states" in str(info.value)


# Configs the refusal tests used to build: served now (a conv layer, KV shared between layers).
FORMERLY_REFUSED = {
    "lfm2-conv": dict(layer_types=["conv", "full_attention"]),
    "gemma4_text-kv-shared": dict(
        num_hidden_layers=4, num_kv_shared_layers=2, head_dim=16, global_head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=128,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(FORMERLY_REFUSED))
def test_formerly_refused_configs_match_stock(name):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.hf_models import BASE

    config = AutoConfig.for_model(name.split("-")[0], **{**BASE, **FORMERLY_REFUSED[name]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=2048, snapshot_interval=INTERVAL)
    assert same_as_stock(model, ids(DOC + tokens(8, seed=2)), store)[0].cached_tokens == [0]
    assert same_as_stock(model, ids(DOC + tokens(8, seed=3)), store)[0].cached_tokens[0] > 0
    input_ids, mask = left_pad([DOC + tokens(3, seed=5), tokens(20, seed=6)])
    cache, _ = same_as_stock(model, input_ids, store, attention_mask=mask)
    assert cache.cached_tokens[0] > 0


@pytest.mark.parametrize("name", ["qwen3_5_text", "mamba2", "deepseek_v32"])
def test_a_pinned_task_prompt_of_a_hybrid_model_is_read_whole(name):
    """hf_patch.pin_prompts takes the snapshot at the prompt's whole-block end, so a request
    starting with it reads all of it; it stays pinned through state pressure."""
    model = build_hybrid(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    system = tokens(42, seed=40)
    assert hf_patch.pin_prompts(model, {"sys": system}, store=store) == {"sys": 40}
    for seed in (41, 42):
        cache, _ = same_as_stock(model, ids(system + tokens(6, seed=seed)), store)
        assert cache.cached_tokens == [40]
    assert store.stats()["task_prompts"] == 1


@pytest.mark.parametrize("name", ["qwen3_5_text", "falcon_h1", "mamba"])
def test_a_cold_batch_computes_its_shared_document_once(name):
    """In-batch sharing: the rows' common prefix is computed once (with its snapshots), the
    other rows read it; the first row computed it, so it reports none cached."""
    model = build_hybrid(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    rows = [DOC + tokens(5 + i, seed=50 + i) for i in range(3)]
    input_ids, mask = left_pad(rows)
    cache, _ = same_as_stock(model, input_ids, store, attention_mask=mask)
    doc_blocks = len(DOC) // BS * BS
    assert cache.cached_tokens == [0, doc_blocks, doc_blocks]
    assert store.stats()["inserted_tokens"] < 2 * doc_blocks  # the document went in once


def test_host_tier_demotes_snapshots_with_their_nodes_and_serves_them():
    """A device pool too small for two documents: the first is demoted, its snapshots to the
    host's state pool; asking about it again reads KV and states from the host, equal to stock."""
    model = build_hybrid("qwen3_5_text")
    store = hf_patch.build_store(
        model,
        block_size=BS,
        budget_tokens=96,
        snapshot_interval=INTERVAL,
        host_cache_tokens=1024,
        state_bytes=1 << 20,
    )
    other = tokens(70, seed=60)
    same_as_stock(model, ids(DOC + tokens(5, seed=61)), store)
    same_as_stock(model, ids(other + tokens(5, seed=62)), store)
    stats = store.stats()
    assert stats["demoted_blocks"] > 0 and stats["host_snapshots"] > 0
    cache, _ = same_as_stock(model, ids(DOC + tokens(5, seed=61)), store)
    assert cache.cached_tokens[0] >= len(DOC) // BS * BS - INTERVAL
    assert store.stats()["host_hit_tokens"] > 0


def test_generate_many_over_a_hybrid_model_equals_stock_per_prompt():
    model = build_hybrid("mamba2")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    prompts = [DOC + tokens(4 + i, seed=70 + i) for i in range(4)] + [tokens(25, seed=79)]
    results = hf_patch.generate_many(model, prompts, store=store, progress=False, **GEN)
    for prompt, result in zip(prompts, results):
        ref = stock(model, ids(prompt), **GEN)
        assert result.token_ids == ref.sequences[0, len(prompt) :].tolist()
    assert sum(r.cached_tokens for r in results) >= 3 * (len(DOC) // BS * BS)


@pytest.mark.parametrize("name", ["qwen3_5_text", "mamba2"])
def test_beams_and_per_token_outputs_equal_stock(name):
    """Beams reorder the cache's rows (the prompt alone is committed, with its snapshots);
    output_hidden_states wants every prompt token's output: computed whole, nothing read."""
    model = build_hybrid(name)
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    beams = dict(num_beams=3, num_return_sequences=2, max_new_tokens=5)
    assert same_as_stock(model, ids(DOC + tokens(6, seed=2)), store, **beams)[0].cached_tokens == [0, 0]
    cache, _ = same_as_stock(model, ids(DOC + tokens(6, seed=3)), store, **beams)
    assert cache.cached_tokens == [64, 64]
    cache, out = same_as_stock(model, ids(DOC + tokens(6, seed=4)), store, output_hidden_states=True)
    assert cache.cached_tokens == [0] and out.hidden_states[0][0].shape[1] == len(DOC) + 6


def test_a_kv_and_state_layer_gets_kv_buffers_of_its_own():
    """Layers whose K/V shapes differ (or off the CPU) get one buffer each from AppendLayer.allocate:
    a StateAppendLayer (Falcon-H1, Zamba) must not take that call for its state allocation."""
    from hf_patch.layer import StateAppendLayer, allocate_stacked
    from radixkv import LayerSpec

    layers = [StateAppendLayer(number_of_states=1) for _ in range(2)]
    specs = [
        LayerSpec(2, 16, 16, torch.float32, torch.device("cpu")),
        LayerSpec(1, 8, 4, torch.float32, "cpu"),
    ]
    allocate_stacked(layers, 3, specs, 10)
    assert [tuple(t.shape) for layer in layers for t in layer.buffers()] == [
        (3, 2, 10, 16), (3, 2, 10, 16), (3, 1, 10, 8), (3, 1, 10, 4),
    ]  # fmt: skip


def test_decode_snapshots_ignore_forwards_of_other_calls_on_the_same_model():
    """Two calls on one model at once (two threads, two caches): each call's decode snapshots
    count only its own forwards, so the next chat turn over either reply still equals stock."""
    import threading

    model = build_hybrid("qwen3_5_text")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
    prompts = [DOC[:30] + tokens(3, seed=80), DOC[:38] + tokens(5, seed=81)]
    outs: dict[int, torch.Tensor] = {}
    both_running = threading.Barrier(2)

    class Sync:  # a streamer whose first put (the prompt) waits for the other call to start
        def __init__(self):
            self.first = True

        def put(self, value):
            if self.first:
                self.first = False
                both_running.wait(timeout=30)

        def end(self):
            pass

    def run(i):
        with torch.no_grad():
            outs[i] = model.generate(
                ids(prompts[i]), past_key_values=hf_patch.RadixCache(store=store), max_new_tokens=14,
                streamer=Sync(), **{k: v for k, v in GEN.items() if k != "max_new_tokens"},
            )  # fmt: skip

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(2):
        history = outs[i][0].tolist()
        cache, _ = same_as_stock(model, ids(history + tokens(4, seed=90 + i)), store)
        assert cache.cached_tokens[0] > len(prompts[i]) // BS * BS  # the reply's snapshot was read


def test_one_row_leaves_its_tail_to_generates_first_forward():
    """A row whose deepest snapshot is its last cut needs no catch-up forward past it:
    generate()'s first forward computes the tail from there (one forward, not two)."""
    model = build_hybrid("qwen3_5_text")
    store = hf_patch.build_store(model, block_size=16, budget_tokens=4096, snapshot_interval=16)
    same_as_stock(model, ids(DOC[:64] + tokens(9, seed=2)), store, max_new_tokens=1)
    forwards = []
    handle = model.register_forward_pre_hook(
        lambda m, a, k: forwards.append(k["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        cache, _ = same_as_stock(model, ids(DOC[:64] + tokens(15, seed=3)), store, max_new_tokens=1)
    finally:
        handle.remove()
    assert cache.cached_tokens == [64]
    assert forwards[-1:] == [15] and len(forwards) == 2  # stock's reference, then ours: [64, 79) at once


@pytest.mark.parametrize("name", ["qwen3_5_text", "mamba2"])
def test_a_snapshot_hint_makes_the_second_request_reuse_a_whole_system_prompt(name):
    """vLLM issue 40696's case: a shared system prompt the interval does not divide. With
    RadixCache(snapshot_at=[its end]) the first request takes a snapshot there, so the second
    reuses all of it (not only the last interval multiple), and equals stock."""
    model = build_hybrid(name)
    system = tokens(42, seed=40)  # ends mid-block (block 4): the hint is floored to 40
    for hint, want in ((None, 32), ([42], 40)):
        store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, snapshot_interval=INTERVAL)
        first = hf_patch.RadixCache(store=store, snapshot_at=hint)
        with torch.no_grad():
            model.generate(ids(system + tokens(20, seed=41)), past_key_values=first, **GEN)
        cache, _ = same_as_stock(model, ids(system + tokens(20, seed=42)), store)
        assert cache.cached_tokens == [want]
    with pytest.raises(ValueError, match="snapshot_at"):
        hf_patch.RadixCache(snapshot_at=[-1])
    with pytest.raises(TypeError, match="snapshot_at"):
        hf_patch.RadixCache(snapshot_at=7)
