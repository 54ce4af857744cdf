"""DeepSeek-V4 against stock generate(): compressed sparse (CSA) and heavily compressed (HCA) layers
reused at window boundaries (docs/models.md#deepseek-v4).

The tiny config of tests/hybrid_models.py: layers HCA, CSA, HCA, CSA, compress rates 16 and 4, a
sliding window of 8, index_topk 4. The snapshot grain is lcm(16, 4) = 16, so the store's blocks
are 16 tokens and every reuse ends on a multiple of 16. The same checks as the family matrix of
tests/test_hf_recurrent.py (tokens equal, logits within 1e-4), and the padded batch against
stock's padded batch, whose padded rows depend on their padding.
"""

from __future__ import annotations

import pytest
import torch

import hf_patch
from tests.hf_models import ids, left_pad, one_torch_thread, stock  # noqa: F401
from tests.hybrid_models import PATTERNS, build_hybrid, layer_pattern, tokens
from tests.test_hf_recurrent import ATOL, DOC, GEN, same_as_stock

GRAIN = 16  # lcm of the compress rates: every window closed, every buffer empty


@pytest.fixture(scope="module")
def model():
    return build_hybrid("deepseek_v4")


def test_deepseek_v4_matches_stock_and_reuses_at_window_boundaries(model):
    assert layer_pattern(model) == PATTERNS["deepseek_v4"]
    layout = hf_patch.model_spec.model_layout(model)
    assert layout.kinds == ("compressed",) * 4 and layout.snapshot_grain == GRAIN and layout.padding_dependent
    store = hf_patch.build_store(model, budget_tokens=4096, snapshot_interval=GRAIN)
    assert store.block_size == GRAIN  # the default block size, rounded up to the grain

    # A document and three questions: reuse up to the last window boundary before the question.
    cached = [same_as_stock(model, ids(DOC + tokens(n, seed=s)), store)[0].cached_tokens[0]
              for n, s in ((9, 2), (11, 3), (7, 4))]  # fmt: skip
    assert cached == [0, 64, 64]

    # A chat turn reuses the history to its last window boundary (a snapshot the decode took).
    _, out = same_as_stock(model, ids(DOC[:40] + tokens(5, seed=9)), store, max_new_tokens=10)
    history = out.sequences[0].tolist()
    cache, _ = same_as_stock(model, ids(history + tokens(6, seed=10)), store)
    assert cache.cached_tokens == [(len(history) - 1) // GRAIN * GRAIN]

    # A left-padded batch equals stock's padded batch: the unpadded row reuses its prefix, the
    # padded rows are computed as stock computes them, pads included, and not committed.
    rows = [DOC + tokens(3, seed=20), DOC[:42] + tokens(8, seed=21), tokens(30, seed=22)]
    input_ids, mask = left_pad(rows)
    cache, out = same_as_stock(model, input_ids, store, attention_mask=mask)
    assert cache.cached_tokens == [64, 0, 0]
    alone = stock(model, ids(rows[1]), **GEN)  # stock's padded row is not the prompt alone
    assert (out.logits[0][1] - alone.logits[0][0]).abs().max() > 1e-2
    # Had the padded row been committed, this would read its padding-dependent states at 48.
    assert same_as_stock(model, ids(rows[1]), store)[0].cached_tokens == [32]

    # Seeded sampling, and n sampled sequences of one prompt.
    same_as_stock(model, ids(DOC + tokens(9, seed=2)), store, seed=5, do_sample=True)
    cache, _ = same_as_stock(
        model, ids(DOC + tokens(9, seed=2)), store, seed=6, do_sample=True, num_return_sequences=3
    )
    assert cache.cached_tokens == [64] * 3

    # Scores (rows of different lengths: a padded batch) equal an uncached forward of each row.
    pairs = [(DOC + tokens(5, seed=30), tokens(4, seed=31)), (tokens(20, seed=34), tokens(3, seed=35))]
    for expected in ([64, 0], [64, 16]):
        scores = hf_patch.score(model, pairs, store=store)
        assert [s.cached_tokens for s in scores] == expected
        for (context, continuation), score in zip(pairs, scores):
            with torch.no_grad():
                logits = model(torch.tensor([context + continuation])).logits[0, len(context) - 1 : -1]
            want = logits.log_softmax(-1).gather(1, torch.tensor(continuation).unsqueeze(1)).sum().item()
            assert abs(score.logprob - want) < ATOL, (score.logprob, want)
    store.check_invariants()


def test_a_block_that_would_split_a_compression_window_is_refused(model):
    """A window straddling two blocks would leave parts of its entry, which depends on the later
    block's tokens, in the earlier block, where another prompt sharing only that block reads them."""
    with pytest.raises(ValueError, match="multiple of 16"):
        hf_patch.build_store(model, block_size=8, budget_tokens=512)
    from radixkv import BlockPool, KVStore, StatePool

    layout = hf_patch.model_spec.model_layout(model)
    store = KVStore(BlockPool(layout.specs, 64, 8), states=StatePool.from_budget(layout.state_specs, 1 << 16))
    with pytest.raises(ValueError, match="not a multiple of 16"):
        model.generate(ids(DOC[:20]), max_new_tokens=2, past_key_values=hf_patch.RadixCache(store=store))


# Layer mixes beside the matrix's: HCA only (each layer's state is its window alone), and sliding-only
# layers (no compressor, so no per-token part in the block pool) among compressed ones.
VARIANTS = {
    "hca-only": ["heavily_compressed_attention"] * 4,
    "with-sliding": [
        "sliding_attention", "compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention",
    ],
}  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANTS))
def test_deepseek_v4_layer_mixes_match_stock(name):
    from transformers import AutoModelForCausalLM

    from tests.hybrid_models import HYBRID_CONFIGS

    config = HYBRID_CONFIGS["deepseek_v4"][0]()
    config.layer_types = VARIANTS[name]
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    layout = hf_patch.model_spec.model_layout(model)
    assert layout.kv_layers == tuple(i for i, t in enumerate(VARIANTS[name]) if t != "sliding_attention")
    store = hf_patch.build_store(model, budget_tokens=2048, snapshot_interval=GRAIN)
    assert same_as_stock(model, ids(DOC + tokens(8, seed=2)), store)[0].cached_tokens == [0]
    assert same_as_stock(model, ids(DOC + tokens(8, seed=3)), store)[0].cached_tokens == [64]
    input_ids, mask = left_pad([DOC + tokens(3, seed=5), tokens(20, seed=6)])
    assert same_as_stock(model, input_ids, store, attention_mask=mask)[0].cached_tokens == [64, 0]
