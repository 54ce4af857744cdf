"""cuda_ext on a GPU: the fused kernels against the pure-torch reference, bit for bit.

Skipped without CUDA. The reference runs through the same public ops with
``set_force_reference(True)``, so both paths see identical validation and inputs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import cuda_ext
from cuda_ext import build
from tests.test_cuda_ext import (
    DTYPES,
    assert_bits_equal,
    gather_case,
    make_cache,
    make_ids,
    make_pools,
    mixed_case,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@contextlib.contextmanager
def reference_forced():
    build.set_force_reference(True)
    try:
        yield
    finally:
        build.set_force_reference(None)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if build.force_reference():
        pytest.skip("RADIXKV_FORCE_REFERENCE is set")
    if build.find_nvcc() is None:
        pytest.skip("nvcc not found: the kernels cannot be built here")
    assert cuda_ext.backend_for("cuda") == "cuda-kernel", build.unavailable_reason()


def check_gather(k_pools, v_pools, ids, n, k_out, v_out):
    k_ref = [o.clone() for o in k_out]
    v_ref = [o.clone() for o in v_out]
    with reference_forced():
        cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_ref, v_ref)
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    torch.cuda.synchronize()
    assert_bits_equal(k_out + v_out, k_ref + v_ref)


def check_scatter(k_src, v_src, ids, k_pools, v_pools):
    k_ref = [p.clone() for p in k_pools]
    v_ref = [p.clone() for p in v_pools]
    with reference_forced():
        cuda_ext.paged_scatter(k_src, v_src, ids, k_ref, v_ref)
    cuda_ext.paged_scatter(k_src, v_src, ids, k_pools, v_pools)
    torch.cuda.synchronize()
    assert_bits_equal(k_pools + v_pools, k_ref + v_ref)


def test_backend_is_the_kernel():
    assert cuda_ext.backend_for(torch.device("cuda", 0)) == "cuda-kernel"
    assert cuda_ext.backend_for("cpu") == "cpu-runs"  # CPU tensors never reach the kernel
    with reference_forced():
        assert cuda_ext.backend_for("cuda") == "reference"


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_and_scatter_match_reference(dtype, block_size):
    id_dtype = torch.int32 if block_size == 16 else torch.int64
    args = gather_case(dtype, block_size, layers=4, heads=4, k_dim=128, v_dim=64, id_dtype=id_dtype,
                       styles=("slice", "seq_major"), seed=block_size, device="cuda")  # fmt: skip
    k_pools, v_pools, ids, n, k_cache, v_cache = args
    check_scatter(k_cache, v_cache, ids, k_pools, v_pools)  # fresh random values into the pools
    check_gather(k_pools, v_pools, ids, n, k_cache, v_cache)


@pytest.mark.parametrize(
    "k_dim, v_dim", [(64, 64), (80, 80), (128, 128), (256, 256), (72, 96), (96, 72), (128, 8)]
)
def test_head_dims(k_dim, v_dim):
    args = gather_case(torch.bfloat16, 16, layers=2, heads=8, k_dim=k_dim, v_dim=v_dim,
                       styles=("contiguous", "slice"), device="cuda")  # fmt: skip
    k_pools, v_pools, ids, n, k_cache, v_cache = args
    check_scatter(k_cache, v_cache, ids, k_pools, v_pools)  # fresh random values into the pools
    check_gather(k_pools, v_pools, ids, n, k_cache, v_cache)


def test_layers_differing_in_heads_dims_and_dtype():
    k_pools, v_pools, ids, n, k_cache, v_cache = mixed_case(device="cuda")
    check_scatter(k_cache, v_cache, ids, k_pools, v_pools)
    check_gather(k_pools, v_pools, ids, n, k_cache, v_cache)


@pytest.mark.parametrize("style", ["contiguous", "slice", "seq_major", "dim_strided"])
def test_strided_caches(style):
    args = gather_case(torch.float16, 16, layers=3, heads=4, k_dim=128, v_dim=128, styles=(style, style),
                       id_dtype=torch.int32, device="cuda")  # fmt: skip
    k_pools, v_pools, ids, n, k_cache, v_cache = args
    check_scatter(k_cache, v_cache, ids, k_pools, v_pools)  # fresh random values into the pools
    check_gather(k_pools, v_pools, ids, n, k_cache, v_cache)


@pytest.mark.parametrize("layers", [32, 40])  # one launch; two launches (more than 64 views)
def test_many_layers_batch_of_rows(layers):
    gen = torch.Generator().manual_seed(layers)
    batch, cols, bs, n = 6, 8, 16, 120
    k_pools, v_pools = make_pools(layers, 64, bs, 8, 128, 128, torch.bfloat16, gen, "cuda")
    ids = make_ids(batch, cols, 64, torch.int64, gen)  # CPU ids: validated without a sync
    k_out = [make_cache((batch, 8, n, 128), torch.bfloat16, "seq_major", gen, "cuda") for _ in range(layers)]
    v_out = [make_cache((batch, 8, n, 128), torch.bfloat16, "contiguous", gen, "cuda") for _ in range(layers)]
    check_scatter(k_out, v_out, ids, k_pools, v_pools)
    check_gather(k_pools, v_pools, ids, n, k_out, v_out)


def test_empty_inputs():
    args = gather_case(torch.float32, 16, num_tokens=0, device="cuda")
    k_pools, v_pools, ids, n, k_cache, v_cache = args
    check_scatter(k_cache, v_cache, ids, k_pools, v_pools)  # fresh random values into the pools
    check_gather(k_pools, v_pools, ids, n, k_cache, v_cache)
    args = gather_case(torch.float32, 16, batch=0, device="cuda")
    check_gather(*args)
    cuda_ext.paged_gather([], [], args[2], 5, [], [])


def test_device_ids_and_cpu_ids_agree():
    k_pools, v_pools, ids, n, k_out, v_out = gather_case(torch.bfloat16, 16, heads=8, k_dim=128, v_dim=128,
                                                         device="cuda")  # fmt: skip
    k_cpu_ids = [torch.empty_like(o) for o in k_out]
    v_cpu_ids = [torch.empty_like(o) for o in v_out]
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    cuda_ext.paged_gather(k_pools, v_pools, ids.cpu(), n, k_cpu_ids, v_cpu_ids)
    torch.cuda.synchronize()
    assert_bits_equal(k_out + v_out, k_cpu_ids + v_cpu_ids)


def test_runs_on_the_current_stream():
    args = gather_case(torch.float16, 16, heads=8, k_dim=128, v_dim=128, device="cuda")
    k_pools, v_pools, ids, n, k_out, v_out = args
    k_ref, v_ref = [o.clone() for o in k_out], [o.clone() for o in v_out]
    with reference_forced():
        cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_ref, v_ref)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cuda_ext.paged_gather(k_pools, v_pools, ids.cpu(), n, k_out, v_out)
    stream.synchronize()
    assert_bits_equal(k_out + v_out, k_ref + v_ref)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_device_guard_second_gpu():
    args = gather_case(torch.bfloat16, 16, heads=8, k_dim=128, v_dim=128, device="cuda:1")
    with torch.cuda.device(0):
        check_gather(*args)


def test_errors_on_cuda():
    k_pools, v_pools, ids, n, k_out, v_out = gather_case(torch.float32, 16, num_tokens=40, device="cuda")
    bad = ids.clone()
    bad[0, 0] = 10**6
    for id_tensor in (bad, bad.cpu()):
        with pytest.raises(ValueError, match="out of range"):
            cuda_ext.paged_gather(k_pools, v_pools, id_tensor, n, k_out, v_out)
    with pytest.raises(ValueError, match="is on cpu but k_pools"):
        cuda_ext.paged_gather(k_pools, v_pools, ids, n, [o.cpu() for o in k_out], v_out)


def test_torch_compile_on_cuda():
    def fn(k_pools, v_pools, ids, k_out, v_out):
        cuda_ext.paged_gather(k_pools, v_pools, ids, k_out[0].shape[2], k_out, v_out)
        return k_out[0] * 2

    k_pools, v_pools, ids, _, k_out, v_out = gather_case(torch.float32, 16, finite=True, device="cuda")
    k_eager, v_eager = [o.clone() for o in k_out], [o.clone() for o in v_out]
    expected = fn(k_pools, v_pools, ids, k_eager, v_eager)
    got = torch.compile(fn, fullgraph=True)(k_pools, v_pools, ids, k_out, v_out)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_bits_equal(k_out + v_out, k_eager + v_eager)
