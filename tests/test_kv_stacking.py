"""One copy for all layers (cuda_ext.stacking): pools and cache buffers allocated as one
``[layers, 2, ...]`` tensor move every layer's K and V per run of blocks, bit-equal to the
per-layer reference, for runs and fragmented ids, the host tier, the sidecar's shared memory,
and generate() through RadixCache."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
import hf_patch
from cuda_ext import cpu_runs, stacking
from hf_patch.layer import AppendLayer, allocate_stacked
from radixkv import BlockPool, KVStore, LayerSpec
from radixkv.sidecar.layout import KVLayout, PoolGeometry
from radixkv.sidecar.shared_view import shared_pool_view
from radixkv.store.tier import host_pool_for
from tests.hf_models import assert_same_as_stock, ids, shared, tokens
from tests.test_cuda_ext import assert_bits_equal, rand_bits

CPU = torch.device("cpu")
LAYERS, HEADS, DIM, BS = 3, 2, 8, 4
UNIFORM = tuple(LayerSpec(HEADS, DIM, DIM, torch.float32, CPU) for _ in range(LAYERS))


@pytest.fixture
def group_sizes(monkeypatch):
    """The layer count of every group the CPU copies used, call after call."""
    seen = []
    original = cpu_runs.layer_groups

    def recording(*args):
        groups = original(*args)
        seen.append([int(p.shape[0]) for p, _ in groups])
        return groups

    monkeypatch.setattr(cpu_runs, "layer_groups", recording)
    return seen


def fill(pool: BlockPool, gen) -> None:
    for t in (*pool.k, *pool.v):
        t.copy_(rand_bits(t.shape, t.dtype, gen))


def stacked_buffers(batch: int, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = [AppendLayer() for _ in UNIFORM]
    allocate_stacked(layers, batch, UNIFORM, capacity)
    return [layer.buffers()[0] for layer in layers], [layer.buffers()[1] for layer in layers]


def reference_gather(pool: BlockPool, block_ids, n):
    k = [torch.zeros(block_ids.shape[0], s.num_kv_heads, n, s.k_head_dim) for s in pool.layers]
    v = [torch.zeros(block_ids.shape[0], s.num_kv_heads, n, s.v_head_dim) for s in pool.layers]
    cuda_ext.set_force_reference(True)  # the per-layer pure-torch oracle
    try:
        pool.gather(block_ids, n, k, v)
    finally:
        cuda_ext.set_force_reference(None)
    return k, v


def test_stacked_views_only_evenly_spaced_slices_of_one_storage():
    both = torch.arange(2 * 3 * 5 * 4, dtype=torch.float32).view(2, 3, 5, 4)
    parts = [both[i, j, 1:4] for i in range(2) for j in range(3)]
    view = stacking.stacked(parts)
    assert view is not None and view.shape == (6, 3, 4)
    assert all(torch.equal(view[i], p) for i, p in enumerate(parts))
    view[4].fill_(-1)  # a view, not a copy
    assert (both[1, 1, 1:4] == -1).all()
    separate = [torch.zeros(3, 4) for _ in range(3)]
    assert stacking.stacked(separate) is None  # three allocations
    assert stacking.stacked([parts[0], parts[2], parts[3]]) is None  # uneven offsets
    flat = torch.zeros(40)
    assert stacking.stacked([flat[0:8].view(2, 4), flat[4:12].view(2, 4)]) is None  # overlapping
    assert stacking.stacked([both[0, 0], both[0, 1, :4]]) is None  # another shape
    assert stacking.stacked([both[0, 0], both[0, 1].double()]) is None  # another dtype and storage
    assert stacking.stacked([parts[5], parts[4]]) is None  # descending
    assert stacking.stacked([]) is None and stacking.stacked(parts[:1]).shape == (1, 3, 4)


def test_pools_and_cache_buffers_of_uniform_layers_are_one_allocation():
    pool = BlockPool(UNIFORM, 16, BS)
    k, v = stacked_buffers(batch=2, capacity=10)
    groups = stacking.layer_groups(pool.k, pool.v, [t[:, :, 1:5] for t in k], [t[:, :, 1:5] for t in v])
    assert [(p.shape[0], c.shape[0]) for p, c in groups] == [(2 * LAYERS, 2 * LAYERS)]
    assert all(t.is_contiguous() for t in (*pool.k, *pool.v))
    mla = (LayerSpec(HEADS, DIM, 6, torch.float32, CPU),) * 2  # K and V dims differ: per layer
    other = BlockPool(mla, 16, BS)
    assert len(stacking.layer_groups(other.k, other.v, other.k, other.v)) == 4


def test_chunks_keep_small_copies_below_the_grain_size():
    assert stacking.chunks(6, 40_000) == [slice(0, 6)]  # each layer's copy is split over threads anyway
    assert stacking.chunks(6, 5_000) == [slice(0, 6)]  # 30,000 elements: one serial copy
    assert stacking.chunks(6, 8_192) == [slice(0, 3), slice(3, 6)]  # 3 x 8,192 < 32,768
    assert stacking.chunks(5, 20_000) == [slice(i, i + 1) for i in range(5)]
    assert stacking.chunks(0, 10) == [slice(0, 0)]


@pytest.mark.parametrize("grain", [stacking.GRAIN_SIZE, 700], ids=["grain", "small-grain"])
@pytest.mark.parametrize("fragmented", [False, True], ids=["runs", "fragmented"])
@pytest.mark.parametrize("outputs", ["stacked", "per-layer"])
def test_gather_and_scatter_of_all_layers_equal_the_per_layer_reference(
    fragmented, outputs, grain, group_sizes, monkeypatch
):
    monkeypatch.setattr(stacking, "GRAIN_SIZE", grain)  # 700: groups split into slices of one to five layers
    gen = torch.Generator().manual_seed(7)
    pool = BlockPool(UNIFORM, 64, BS)
    fill(pool, gen)
    if fragmented:  # every block alone: the indexed path
        block_ids = torch.tensor([[9, 3, 30, 17, 1], [40, 2, 22, 5, 11]])
    else:  # two runs per row
        block_ids = torch.tensor([[8, 9, 10, 20, 21], [32, 33, 34, 35, 50]])
    n = 5 * BS - 1
    if outputs == "stacked":
        k, v = stacked_buffers(batch=2, capacity=n + 7)
        k, v = [t[:, :, 3 : 3 + n] for t in k], [t[:, :, 3 : 3 + n] for t in v]
    else:
        k = [torch.empty(2, HEADS, n, DIM) for _ in UNIFORM]
        v = [torch.empty(2, HEADS, n, DIM) for _ in UNIFORM]
    pool.gather(block_ids, n, k, v)
    want_k, want_v = reference_gather(pool, block_ids, n)
    assert_bits_equal(k + v, want_k + want_v)
    assert group_sizes[-1] == ([2 * LAYERS] if outputs == "stacked" else [1] * (2 * LAYERS))
    # Write them back elsewhere: the scatter of all layers at once, read again per layer.
    target = block_ids.flip(1) + 1 if fragmented else torch.tensor([[1, 2, 3, 4, 5], [40, 41, 42, 43, 44]])
    pool.scatter(target, k, v)
    again_k, again_v = reference_gather(pool, target, n)
    assert_bits_equal(again_k + again_v, want_k + want_v)


def test_host_tier_reads_of_all_layers_equal_the_committed_kv(group_sizes):
    device = BlockPool(UNIFORM, 4, BS)  # two prompts of 2 blocks: the first is demoted
    store = KVStore(device, host_pool_for(device, tokens=32 * BS))
    gen = torch.Generator().manual_seed(3)
    prompts = [[p] * 8 + [99] for p in range(3)]
    committed = {}
    for p in prompts:
        k = [rand_bits((1, HEADS, 9, DIM), torch.float32, gen) for _ in UNIFORM]
        v = [rand_bits((1, HEADS, 9, DIM), torch.float32, gen) for _ in UNIFORM]
        store.commit(p, k, v)
        committed[p[0]] = (k, v)
    assert store.stats()["host_cached_blocks"] >= 2
    k_out, v_out = stacked_buffers(batch=3, capacity=8)
    leases = [store.acquire(p, max_tokens=8) for p in prompts]
    try:
        assert sum(lease.num_host_blocks for lease in leases) >= 2
        store.read(leases, 8, k_out, v_out)
    finally:
        for lease in leases:
            lease.release()
    for row, p in enumerate(prompts):
        k, v = committed[p[0]]
        assert_bits_equal([t[row : row + 1] for t in k_out + v_out], [t[:, :, :8] for t in k + v])
    assert [2 * LAYERS] in group_sizes  # the host rows too went through one copy for all layers


def test_the_sidecars_shared_memory_is_one_view_for_all_layers(group_sizes):
    local = BlockPool(UNIFORM, 8, BS)
    geometry = PoolGeometry(KVLayout(BS, ((HEADS, DIM, DIM, "float32"),) * LAYERS), 24)
    shared_pool = shared_pool_view(local, bytearray(geometry.total_bytes), 24)
    gen = torch.Generator().manual_seed(11)
    fill(shared_pool, gen)
    block_ids = torch.tensor([[4, 5, 6], [20, 21, 2]])
    k, v = stacked_buffers(batch=2, capacity=12)
    shared_pool.gather(block_ids, 11, [t[:, :, :11] for t in k], [t[:, :, :11] for t in v])
    want_k, want_v = reference_gather(shared_pool, block_ids, 11)
    assert_bits_equal([t[:, :, :11] for t in k + v], want_k + want_v)
    assert group_sizes[-1] == [2 * LAYERS]  # regions of one size, each padded to whole pages


def test_generate_reads_all_layers_at_once_and_equals_stock(group_sizes):
    model = shared("llama-sdpa")
    store = hf_patch.build_store(model, block_size=BS, budget_tokens=1024)
    prefix = tokens(24, seed=5)
    first, second = ids(prefix + tokens(5, seed=6)), ids(prefix + tokens(7, seed=7))
    assert_same_as_stock(model, first, store=store)
    group_sizes.clear()
    cache, _ = assert_same_as_stock(model, second, store=store)
    assert cache.cached_tokens == [24]
    assert group_sizes and all(g == [2 * model.config.num_hidden_layers] for g in group_sizes)
