"""A restore into a full, warm store, replayed with generate(): with ``evict=True`` the saved
prompts hit again (exact cached_tokens, outputs equal to stock generate()), from the device
or from the host tier; by default nothing is evicted and they miss."""

from __future__ import annotations

import pytest

import hf_patch
from tests.hf_models import (
    assert_same_as_stock,
    expected_full_hit,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    stock,
    tokens,
)

BS = 4
SAVED = [tokens(44, seed=2001 + i) for i in range(2)]  # the second is the file's most recent
OLD = [tokens(44, seed=2101 + i) for i in range(3)]  # the restarted server's own traffic


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = shared("llama-sdpa")
    source = hf_patch.build_store(model, block_size=BS, budget_tokens=4096)
    for p in SAVED:
        assert_same_as_stock(model, ids(p), source)
    path = tmp_path_factory.mktemp("room") / "kv.safetensors"
    result = hf_patch.save_cache(model, path, source)
    assert result.num_nodes == 2 and result.num_blocks == 24  # 44 prompt + 5 fed reply tokens each
    return path


@pytest.mark.parametrize("host", [False, True], ids=["device only", "host tier"])
@pytest.mark.parametrize("evict", [False, True], ids=["default", "evict"])
def test_a_replay_after_restoring_into_a_full_store(saved, host, evict):
    model = shared("llama-sdpa")
    if host:  # device: one prompt; host: one more
        store = hf_patch.build_store(model, block_size=BS, budget_tokens=16 * BS, host_cache_tokens=16 * BS)
    else:  # room for two prompts and a half
        store = hf_patch.build_store(model, block_size=BS, budget_tokens=30 * BS)
    for p in OLD if host else OLD[:2]:
        assert_same_as_stock(model, ids(p), store)
    stats = store.stats()
    assert stats["free_blocks"] < 12 and stats.get("host_free_blocks", 0) < 12  # no room for a prompt

    result = hf_patch.restore_cache(model, saved, store, evict=evict)
    store.check_invariants()
    if evict:
        assert (result.restored_blocks, result.dropped_blocks) == (24, 0)
        assert result.host_blocks == (12 if host else 0)
        assert result.evicted_blocks + result.demoted_blocks >= 12
    else:
        assert (result.restored_blocks, result.dropped_blocks, result.evicted_blocks) == (0, 24, 0)

    hits = []
    for p in reversed(SAVED):  # most recent first
        cache, _ = assert_same_as_stock(model, ids(p), store, reference=stock(model, ids(p)))
        hits.append(cache.cached_tokens[0])
    full = expected_full_hit(44, BS)
    assert hits == ([full, full] if evict else [0, 0])
    if evict and host:  # the older prompt was read from the host tier
        assert store.stats()["host_hit_tokens"] == full
    store.check_invariants()
