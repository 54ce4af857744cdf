"""hf_patch.save_cache / restore_cache / build_store(restore=): hits after a restart, equal to stock.

"A restart" is a second model object built from the same seed: same weights, another
per-process model scope, its own store, exactly what a new process sees.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import hf_patch
from radixkv import CacheFileMismatch, CorruptCacheFile
from radixkv.persist.cache_file import read_manifest
from tests.hf_models import (
    assert_same_as_stock,
    block_floor,
    build,
    ids,
    one_torch_thread,  # noqa: F401  (autouse)
    shared,
    store_for,
    tokens,
)

BS = 4
DOC = tokens(61, seed=1101)
Q1, Q2 = tokens(5, seed=1102), tokens(7, seed=1103)


def warm_store(model, namespaces=(None,)):
    store = store_for(model, BS)
    for ns in namespaces:
        assert_same_as_stock(model, ids(DOC + Q1), store, namespace=ns)
    return store


def tree_state(store) -> tuple:
    nodes = sorted((repr(n.parent.key), n.data, tuple(n.block_ids)) for n in store.tree.iter_nodes())
    return nodes, store.stats()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = shared("llama-sdpa")
    path = tmp_path_factory.mktemp("hf") / "kv.safetensors"
    result = hf_patch.save_cache(model, path, warm_store(model))
    assert result.num_tokens >= block_floor(len(DOC), BS)
    return path


def test_restored_prefixes_hit_after_a_restart_and_equal_stock(saved):
    model = build("llama-sdpa")  # a new object: another model scope, as in a new process
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=4096, restore=saved)
    store.check_invariants()
    cache, _ = assert_same_as_stock(model, ids(DOC + Q2), store)
    assert cache.cached_tokens == [block_floor(len(DOC), BS)]  # the whole document, from the file
    store.check_invariants()


def test_namespaces_survive_and_stay_apart(tmp_path):
    model = shared("llama-sdpa")
    path = tmp_path / "ns.safetensors"
    result = hf_patch.save_cache(
        model, path, warm_store(model, ("tenant:a", "tenant:b")), namespaces=["tenant:a"]
    )
    assert result.num_tokens == block_floor(len(DOC + Q1) + 5, BS)  # one namespace: prompt + answer
    restarted = build("llama-sdpa")
    store = hf_patch.build_store(restarted, block_size=BS, budget_tokens=4096, restore=path)
    hits = {}
    for ns in ("tenant:b", None, "tenant:a"):  # misses first: they commit nothing the hit could use
        cache, _ = assert_same_as_stock(restarted, ids(DOC + Q2), store, namespace=ns)
        hits[ns] = cache.cached_tokens[0]
    assert hits == {"tenant:b": 0, None: 0, "tenant:a": block_floor(len(DOC), BS)}


def test_another_models_prefixes_in_a_shared_store_are_not_saved(tmp_path):
    model, other = shared("llama-sdpa"), build("llama-sdpa", seed=5)
    store = warm_store(model)
    assert_same_as_stock(other, ids(tokens(30, seed=1104)), store)
    result = hf_patch.save_cache(model, tmp_path / "mine.safetensors", store)
    assert result.num_tokens == block_floor(len(DOC + Q1) + 5, BS)


def _changed_weight(model):
    changed = copy.deepcopy(model)
    with torch.no_grad():
        weight = changed.model.layers[1].mlp.down_proj.weight
        weight += 1e-4 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
    return changed


def _other_config(model):
    config = copy.deepcopy(model.config)
    config.rms_norm_eps = 1e-5  # same KV layout, another computation
    torch.manual_seed(0)
    return type(model)(config).float().eval()


@pytest.mark.parametrize(
    "make, message",
    [
        (_changed_weight, "weights_sha256"),
        (_other_config, "config_sha256"),
        (lambda m: build("llama-sdpa").to(torch.bfloat16), "dtype"),
        (lambda m: build("mistral-sliding"), "model_class"),
    ],
    ids=["fine-tuned weight", "other config", "bf16", "other class"],
)
def test_another_model_is_refused_and_its_store_keeps_serving(saved, make, message):
    model = make(shared("llama-sdpa"))
    store = store_for(model, BS)
    prompt = tokens(40, seed=1105)
    assert_same_as_stock(model, ids(prompt), store)
    before = tree_state(store)
    with pytest.raises(CacheFileMismatch, match=message):
        hf_patch.restore_cache(model, saved, store)
    assert tree_state(store) == before
    store.check_invariants()
    cache, _ = assert_same_as_stock(model, ids(prompt + Q2), store)
    assert cache.cached_tokens == [block_floor(len(prompt), BS)]  # its own prefix, untouched


def test_weights_changed_in_process_flush_instead_of_being_saved(tmp_path):
    model = build("llama-sdpa")
    store = warm_store(model)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.01)  # bumps the version counter
    assert hf_patch.save_cache(model, tmp_path / "x.safetensors", store).num_tokens == 0


def test_weights_changed_while_a_file_is_read_restore_no_stale_kv(saved, monkeypatch):
    # The file matched the weights when checked; another thread changes them and flushes the
    # store (its next generate() does) before the restore inserts: that KV is stale now.
    import radixkv.persist.restore

    model = build("llama-sdpa")
    store = store_for(model, BS)
    hf_patch.keys.weights.flush_if_weights_changed(store, model)  # the store has seen these weights
    read = radixkv.persist.restore.read_kv  # the KV is read without the store's lock

    def read_then_weights_change(*args, **kwargs):
        read(*args, **kwargs)
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
        hf_patch.keys.weights.flush_if_weights_changed(store, model)

    monkeypatch.setattr(radixkv.persist.restore, "read_kv", read_then_weights_change)
    with pytest.raises(RuntimeError, match="flushed"):
        hf_patch.restore_cache(model, saved, store)
    assert store.stats()["cached_blocks"] == 0 and store.stats()["free_blocks"] == store.pool.num_blocks
    store.check_invariants()
    cache, _ = assert_same_as_stock(model, ids(DOC + Q2), store)
    assert cache.cached_tokens == [0]


def test_weights_changed_while_the_identity_is_computed_save_no_mislabelled_kv(tmp_path, monkeypatch):
    # save_cache fingerprints the weights, then snapshots the tree. If another thread changes
    # the weights and caches KV under them in between, that KV must not be written under the
    # old weights' identity (a restore with the old weights would serve it).
    import hf_patch.identity

    model = build("llama-sdpa")
    store = warm_store(model)
    fingerprint = hf_patch.identity.weights_sha256

    def fingerprint_then_weights_change(m, *args, **kwargs):
        digest = fingerprint(m, *args, **kwargs)
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
        assert_same_as_stock(model, ids(DOC + Q1), store)  # flushes, caches the new weights' KV
        return digest

    monkeypatch.setattr(hf_patch.identity, "weights_sha256", fingerprint_then_weights_change)
    path = tmp_path / "kv.safetensors"
    with pytest.raises(RuntimeError, match="flushed"):
        hf_patch.save_cache(model, path, store)
    assert not path.exists()
    store.check_invariants()


def test_a_damaged_file_builds_no_store(saved, tmp_path):
    broken = tmp_path / "broken.safetensors"
    data = open(saved, "rb").read()
    broken.write_bytes(data[: len(data) // 3])
    with pytest.raises(CorruptCacheFile):
        hf_patch.build_store(build("llama-sdpa"), block_size=BS, budget_tokens=4096, restore=broken)
    assert os.path.getsize(saved) == len(data)


def test_identity_is_stable_and_json():
    a, b = build("llama-sdpa"), build("llama-sdpa")
    assert hf_patch.model_identity(a) == hf_patch.model_identity(b)
    assert set(hf_patch.model_identity(a)) == {"model_class", "config_sha256", "weights_sha256"}


def test_a_bit_flipped_file_leaves_a_warm_store_serving_as_before(saved, tmp_path):
    model = build("llama-sdpa")
    store = store_for(model, BS)
    prompt = tokens(40, seed=1106)
    assert_same_as_stock(model, ids(prompt), store)
    flipped = tmp_path / "flipped.safetensors"
    data = bytearray(open(saved, "rb").read())
    data[-5] ^= 0x01  # one bit of the last layer's V
    flipped.write_bytes(bytes(data))
    before = tree_state(store)
    with pytest.raises(CorruptCacheFile, match="checksum"):
        hf_patch.restore_cache(model, flipped, store)
    assert tree_state(store) == before
    store.check_invariants()
    cache, _ = assert_same_as_stock(model, ids(prompt + Q2), store)
    assert cache.cached_tokens == [block_floor(len(prompt), BS)]
    cache, _ = assert_same_as_stock(model, ids(DOC + Q2), store)
    assert cache.cached_tokens == [0]  # nothing of the refused file got in


def test_a_format_1_file_is_checked_with_sha256(tmp_path):
    """tests/data's format-1 file (saved before this format existed) restores (test_hf_keys.py);
    damaged, it is refused by its sha256 checksums."""
    data = os.path.join(os.path.dirname(__file__), "data", "format1_llama_sdpa.safetensors")
    assert read_manifest(data)["version"] == 1 and "checksum" not in read_manifest(data)
    path = tmp_path / "format1.safetensors"
    raw = bytearray(open(data, "rb").read())
    raw[-1] ^= 0x10
    path.write_bytes(bytes(raw))
    model = shared("llama-sdpa")
    store = store_for(model, 4)
    with pytest.raises(CorruptCacheFile, match="kv.1.v does not match its checksum"):
        hf_patch.restore_cache(model, path, store)
    assert store.stats()["cached_blocks"] == 0
    assert hf_patch.restore_cache(model, data, store).restored_tokens == 32
