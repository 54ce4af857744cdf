"""The CPU runs path (one slice copy per run of consecutive blocks) against the naive loops."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import cpu_runs, reference
from tests.test_cuda_ext import DTYPES, assert_bits_equal, make_cache, make_pools, naive_gather, naive_scatter


@pytest.mark.parametrize(
    "ids, block_size, num_tokens, expected",
    [
        ([5, 6, 7], 4, 12, [(20, 0, 12)]),  # one run, whole blocks
        ([5, 6, 7], 4, 10, [(20, 0, 10)]),  # last block partly used
        ([5, 6, 9, 10], 4, 16, [(20, 0, 8), (36, 8, 8)]),  # a gap splits the run
        ([3, 2, 1], 2, 5, [(6, 0, 2), (4, 2, 2), (2, 4, 1)]),  # descending: no runs at all
        ([0, 1, 2, 99], 1, 3, [(0, 0, 3)]),  # columns past num_tokens are never looked at
        ([7], 16, 1, [(112, 0, 1)]),
    ],
)
def test_block_runs(ids, block_size, num_tokens, expected):
    assert cpu_runs.block_runs(ids, block_size, num_tokens) == expected


def run_ids(batch: int, cols: int, run_length: int, num_blocks: int, gen) -> torch.Tensor:
    """``[batch, cols]`` distinct ids made of ascending runs of ``run_length`` at random places."""
    starts = torch.randperm(num_blocks // run_length, generator=gen) * run_length
    flat = (starts.unsqueeze(1) + torch.arange(run_length)).reshape(-1)
    return flat[: batch * cols].view(batch, cols)


def runs_case(dtype, block_size, *, batch=3, run_length=None, styles=("slice", "seq_major"), seed=0):
    """Rows of two runs of 64 tokens each (by default), the last block partly used."""
    gen = torch.Generator().manual_seed(seed)
    run_length = run_length or max(1, 64 // block_size)
    cols = 2 * run_length
    num_blocks = 4 * batch * cols
    k_pools, v_pools = make_pools(2, num_blocks, block_size, 2, 8, 12, dtype, gen)
    ids = run_ids(batch, cols, run_length, num_blocks, gen)
    num_tokens = cols * block_size - (block_size + 1) // 2  # last block partly used
    k_out = [make_cache((batch, 2, num_tokens, 8), dtype, styles[0], gen) for _ in range(2)]
    v_out = [make_cache((batch, 2, num_tokens, 12), dtype, styles[1], gen) for _ in range(2)]
    return k_pools, v_pools, ids, num_tokens, k_out, v_out


@pytest.fixture
def no_reference(monkeypatch):
    """Fails the test if the runs path falls back to the reference."""

    def refuse(*args):
        pytest.fail("the runs path fell back to the reference")

    monkeypatch.setattr(reference, "paged_gather_ref", refuse)
    monkeypatch.setattr(reference, "paged_scatter_ref", refuse)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_runs_match_naive(dtype, block_size, no_reference):
    k_pools, v_pools, ids, n, k_out, v_out = runs_case(dtype, block_size, seed=block_size)
    expected = naive_gather(k_pools, v_pools, ids, n)
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    assert_bits_equal(k_out + v_out, expected[0] + expected[1])


@pytest.mark.parametrize("style", ["contiguous", "slice", "seq_major", "dim_strided"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_scatter_runs_match_naive(block_size, style, no_reference):
    k_pools, v_pools, ids, n, k_src, v_src = runs_case(
        torch.bfloat16, block_size, styles=(style, style), seed=3
    )
    k_exp, v_exp = naive_scatter(k_src, v_src, ids, k_pools, v_pools)
    cuda_ext.paged_scatter(k_src, v_src, ids, k_pools, v_pools)
    assert_bits_equal(k_pools + v_pools, k_exp + v_exp)  # slots past n in the last block untouched


def test_fragmented_ids_take_one_indexed_copy_per_layer_group(no_reference):
    """Many short runs: one index_select (gather) / index_copy_ (scatter), not the reference."""
    k_pools, v_pools, ids, n, k_out, v_out = runs_case(torch.float32, 4, run_length=1, seed=5)
    assert cpu_runs._row_runs(ids, 4, n) is None
    expected = naive_gather(k_pools, v_pools, ids, n)
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    assert_bits_equal(k_out + v_out, expected[0] + expected[1])
    k_exp, v_exp = naive_scatter(k_out, v_out, ids.flip(1), k_pools, v_pools)
    cuda_ext.paged_scatter(k_out, v_out, ids.flip(1), k_pools, v_pools)
    assert_bits_equal(k_pools + v_pools, k_exp + v_exp)


def test_forced_reference_matches_runs_path():
    k_pools, v_pools, ids, n, k_out, v_out = runs_case(torch.float16, 16, seed=9)
    forced = [torch.empty_like(o) for o in k_out + v_out]
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    cuda_ext.set_force_reference(True)
    try:
        cuda_ext.paged_gather(k_pools, v_pools, ids, n, forced[:2], forced[2:])
    finally:
        cuda_ext.set_force_reference(None)
    assert_bits_equal(k_out + v_out, forced)
