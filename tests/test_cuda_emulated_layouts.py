"""The kernel body, run on the CPU, on random strided cache layouts: bit-exact to the reference.

The fixed cases in test_cuda_compile.py cover the layouts hf_patch produces; this fuzzes the
unit choice (16/8/4/2 bytes, or one element) against views whose dims are permuted, padded
and offset so that pointers and strides are aligned to every unit size or to none, including
size-1 dims whose stride must be ignored. Skips with test_cuda_compile.py when nvcc is absent.
"""

from __future__ import annotations

import random

import torch

import cuda_ext
from cuda_ext.validate import _self_overlap
from tests.test_cuda_compile import emulate, harness, pytestmark  # noqa: F401 - fixture and skip
from tests.test_cuda_ext import DTYPES, assert_bits_equal, make_ids, make_pools, rand_bits


def random_view(rng: random.Random, gen: torch.Generator, shape: list[int], dtype) -> torch.Tensor:
    """A one-to-one ``as_strided`` view: random dim order, stride padding and storage offset."""
    order = list(range(4))
    rng.shuffle(order)  # order[0] is the innermost dim
    stride, span = [0] * 4, 1
    for d in order:
        stride[d] = span * rng.choice([1, 1, 2, 3]) if span > 1 or rng.random() < 0.3 else 1
        span = stride[d] * shape[d] + rng.randrange(3)
    offset = rng.randrange(5)
    return rand_bits((span + offset + 8,), dtype, gen).as_strided(shape, stride, offset)


def test_random_layouts_match_reference(harness):  # noqa: F811 - the imported fixture
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    units_seen: set[int] = set()
    for _ in range(200):
        dtype = rng.choice(DTYPES)
        bs, batch, heads = rng.choice([1, 2, 4, 16]), rng.randrange(1, 4), rng.randrange(1, 4)
        dim, n = rng.choice([1, 2, 3, 4, 8, 12, 16, 24]), rng.randrange(1, 3 * bs + 2)
        cols = -(-n // bs)
        num_blocks = batch * cols + 2
        k_pools, v_pools = make_pools(1, num_blocks, bs, heads, dim, dim, dtype, gen)
        ids = make_ids(batch, cols, num_blocks, rng.choice([torch.int32, torch.int64]), gen)
        k, v = (random_view(rng, gen, [batch, heads, n, dim], dtype) for _ in range(2))
        assert _self_overlap(k.shape, k.stride()) is None and _self_overlap(v.shape, v.stride()) is None
        expected = [torch.empty_like(k)], [torch.empty_like(v)]
        cuda_ext.paged_gather_ref(k_pools, v_pools, ids, n, *expected)
        err, units, _ = emulate(harness, False, k_pools, v_pools, ids, n, [k], [v])
        assert err == 0
        units_seen.update(units)
        assert_bits_equal([k, v], expected[0] + expected[1])
        k_new, v_new = [torch.zeros_like(k_pools[0])], [torch.zeros_like(v_pools[0])]
        k_ref, v_ref = [k_new[0].clone()], [v_new[0].clone()]
        cuda_ext.paged_scatter_ref([k], [v], ids, k_ref, v_ref)
        assert emulate(harness, True, k_new, v_new, ids, n, [k], [v])[0] == 0
        assert_bits_equal(k_new + v_new, k_ref + v_ref)
    assert units_seen == {2, 4, 8, 16}  # every vector width was exercised
