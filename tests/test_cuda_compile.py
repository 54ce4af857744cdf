"""The CUDA sources compile, and the kernel's indexing is right, without a GPU.

1. ``paged_copy.cu`` compiles with the machine's nvcc for sm_80 and sm_90, warning-free.
2. The kernel's per-CTA body is ``__host__ __device__``: a small harness runs the real
   launch planning and every (view, CTA, thread) of every launch on the CPU, and the result
   must equal the pure-torch reference bit for bit (vector widths, strides, chunking of
   more than 64 views, odd block sizes, out-of-range ids skipped), with every unit copy
   aligned to its size as the GPU requires (the harness fails the call otherwise).
3. The torch bindings pass a syntax-only compile against this torch's headers (when a host
   compiler and the headers are there; a CPU torch wheel lacks one generated CUDA header,
   which is stubbed).

Without nvcc these skip, except when CI=true (CI machines have nvcc).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import cuda_ext
from cuda_ext.build import CSRC, find_nvcc
from tests.test_cuda_ext import assert_bits_equal, bits, make_cache, make_ids, make_pools, mixed_case

NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(
    NVCC is None and os.environ.get("CI") != "true", reason="nvcc not found (required when CI=true)"
)
_DTYPE_ENUM = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    assert NVCC is not None, "CI=true but nvcc was not found (set CUDA_HOME or PATH)"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_kernel_compiles_for_sm80_and_sm90_without_warnings(tmp_path):
    cmd = [NVCC, "-c", str(CSRC / "paged_copy.cu"), "-std=c++17", "-O3",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
           "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror",
           "-o", str(tmp_path / "paged_copy.o")]  # fmt: skip
    res = _run(cmd)
    assert res.returncode == 0, res.stderr
    assert "warning" not in (res.stdout + res.stderr).lower(), res.stdout + res.stderr


# ---- the kernel body, run on the CPU ---------------------------------------------------------

_HARNESS = r"""
#include <cstdint>
// Counts unit copies at an address the GPU's vector load/store would fault on.
static int64_t g_misaligned = 0;
#define RADIXKV_HOST_COPY_HOOK(dst, src, unit) \
  g_misaligned += ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) % (unit)) != 0
#include "paged_copy.cu"
#include <vector>
// Runs every launch that paged_copy() would make, thread by thread, on host memory.
extern "C" int radixkv_emulate(int scatter, const void* ids, int ids_int32,
    int64_t ids_s0, int64_t ids_s1, int64_t batch, int64_t cols, int64_t num_tokens,
    int64_t num_blocks, int64_t block_size, int64_t num_views, void** pools, void** caches,
    const int64_t* strides, const int64_t* heads, const int64_t* head_dims, const int32_t* dtypes,
    int32_t* unit_bytes, int64_t* num_launches) {
  using namespace radixkv;
  PagedCopyGeometry g{};
  g.block_ids = ids; g.block_ids_int32 = ids_int32 != 0;
  g.block_id_stride[0] = ids_s0; g.block_id_stride[1] = ids_s1;
  g.batch = batch; g.num_block_cols = cols; g.num_tokens = num_tokens;
  g.num_blocks = num_blocks; g.block_size = block_size;
  std::vector<LayerView> views(static_cast<size_t>(num_views));
  for (int64_t i = 0; i < num_views; ++i) {
    views[i].pool = pools[i]; views[i].cache = caches[i];
    views[i].num_heads = heads[i]; views[i].head_dim = head_dims[i];
    views[i].dtype = static_cast<DType>(dtypes[i]);
    for (int d = 0; d < 4; ++d) views[i].cache_stride[d] = strides[4 * i + d];
  }
  int64_t launches = 0, seen = 0;
  const cudaError_t err = detail::for_each_launch(g, views.data(), num_views,
      [&](const detail::Launch& l) {
        ++launches;
        for (int32_t y = 0; y < l.grid_y; ++y) {
          unit_bytes[seen++] = l.params.views[y].unit_bytes;
          for (int64_t x = 0; x < l.grid_x; ++x)
            for (int32_t tid = 0; tid < detail::kThreads; ++tid) {
              if (scatter) detail::copy_cta<true>(l.params, y, x, tid, detail::kThreads);
              else detail::copy_cta<false>(l.params, y, x, tid, detail::kThreads);
            }
        }
        return cudaSuccess;
      });
  *num_launches = launches;
  if (g_misaligned != 0) {
    g_misaligned = 0;
    return -1;  // the GPU would have raised a misaligned address error
  }
  return static_cast<int>(err);
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    out = tmp_path_factory.mktemp("harness")
    (out / "harness.cu").write_text(_HARNESS)
    lib = out / "libharness.so"
    res = _run([NVCC, "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "-O1",
                "-gencode", "arch=compute_80,code=compute_80", f"-I{CSRC}",
                str(out / "harness.cu"), "-o", str(lib)])  # fmt: skip
    assert res.returncode == 0, res.stderr
    return ctypes.CDLL(str(lib))


def emulate(lib, scatter, k_pools, v_pools, ids, num_tokens, k_cache, v_cache):
    """Runs the kernel body on CPU tensors; returns (error code, unit bytes per view, launches)."""
    pools, caches = [*k_pools, *v_pools], [*k_cache, *v_cache]
    n = len(pools)
    strides = [s for c in caches for s in c.stride()]
    units = (ctypes.c_int32 * max(n, 1))()
    launches = ctypes.c_int64()
    i64 = ctypes.c_int64
    err = lib.radixkv_emulate(
        int(scatter), ctypes.c_void_p(ids.data_ptr()), int(ids.dtype == torch.int32),
        i64(ids.stride(0)), i64(ids.stride(1)), i64(ids.shape[0]), i64(ids.shape[1]), i64(num_tokens),
        i64(pools[0].shape[0]), i64(pools[0].shape[1]), i64(n),
        (ctypes.c_void_p * n)(*[p.data_ptr() for p in pools]),
        (ctypes.c_void_p * n)(*[c.data_ptr() for c in caches]), (i64 * (4 * n))(*strides),
        (i64 * n)(*[p.shape[2] for p in pools]), (i64 * n)(*[p.shape[3] for p in pools]),
        (ctypes.c_int32 * n)(*[_DTYPE_ENUM[p.dtype] for p in pools]), units, ctypes.byref(launches),
    )  # fmt: skip
    return err, list(units)[:n], launches.value


# (dtype, layers, block_size, heads, k_dim, v_dim, batch, cols, num_tokens, k style, v style, ids)
CASES = {
    "bf16_d128_16B_units": (
        torch.bfloat16,
        2,
        16,
        8,
        128,
        128,
        2,
        4,
        50,
        "contiguous",
        "seq_major",
        torch.int64,
    ),
    "fp16_d64_bs1_int32": (torch.float16, 2, 1, 4, 64, 64, 3, 40, 37, "seq_major", "contiguous", torch.int32),
    "fp64_d64_bs1_int32": (torch.float64, 2, 1, 4, 64, 64, 3, 40, 37, "seq_major", "contiguous", torch.int32),
    "fp32_d256_big_rows": (
        torch.float32,
        1,
        128,
        8,
        256,
        80,
        1,
        2,
        200,
        "contiguous",
        "contiguous",
        torch.int64,
    ),
    "bf16_d80_d72_kv_differ": (
        torch.bfloat16,
        2,
        16,
        4,
        80,
        72,
        2,
        3,
        33,
        "slice",
        "contiguous",
        torch.int32,
    ),
    "fp16_d96_dim_strided": (torch.float16, 2, 16, 2, 96, 96, 2, 2, 20, "dim_strided", "slice", torch.int64),
    "fp32_tiny_rows_odd_bs": (torch.float32, 3, 5, 1, 3, 1, 4, 3, 13, "slice", "dim_strided", torch.int64),
    "bf16_d2_d4_8B_4B_units": (
        torch.bfloat16,
        2,
        4,
        3,
        2,
        4,
        2,
        3,
        9,
        "contiguous",
        "seq_major",
        torch.int32,
    ),
    "fp16_40_layers_chunked": (
        torch.float16,
        40,
        16,
        2,
        64,
        32,
        1,
        2,
        17,
        "contiguous",
        "slice",
        torch.int64,
    ),
}


def _case(name, seed=0):
    if name == "mixed_heads_dims_dtypes":
        return mixed_case(seed)
    dtype, layers, bs, heads, k_dim, v_dim, batch, cols, n, k_style, v_style, id_dtype = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    num_blocks = batch * cols + 3
    k_pools, v_pools = make_pools(layers, num_blocks, bs, heads, k_dim, v_dim, dtype, gen)
    ids = make_ids(batch, cols, num_blocks, id_dtype, gen)
    k_cache = [make_cache((batch, heads, n, k_dim), dtype, k_style, gen) for _ in range(layers)]
    v_cache = [make_cache((batch, heads, n, v_dim), dtype, v_style, gen) for _ in range(layers)]
    return k_pools, v_pools, ids, n, k_cache, v_cache


@pytest.mark.parametrize("name", [*sorted(CASES), "mixed_heads_dims_dtypes"])
def test_emulated_kernel_matches_reference(harness, name):
    k_pools, v_pools, ids, n, k_cache, v_cache = _case(name)
    k_exp = [torch.empty_like(c) for c in k_cache]
    v_exp = [torch.empty_like(c) for c in v_cache]
    cuda_ext.paged_gather_ref(k_pools, v_pools, ids, n, k_exp, v_exp)
    err, units, launches = emulate(harness, False, k_pools, v_pools, ids, n, k_cache, v_cache)
    assert err == 0
    assert_bits_equal(k_cache + v_cache, k_exp + v_exp)
    assert launches == -(-2 * len(k_pools) // 64)
    if name == "bf16_d128_16B_units":
        assert set(units) == {16}
    if name == "bf16_d2_d4_8B_4B_units":
        assert units == [4, 4, 8, 8]
    if name == "fp16_d96_dim_strided":
        assert units == [2, 2, 2, 2]  # K: last-dim stride != 1; V: odd element offset

    # scatter back: the same pools again; into fresh pools: what the reference writes
    pools_before = [p.clone() for p in k_pools + v_pools]
    assert emulate(harness, True, k_pools, v_pools, ids, n, k_cache, v_cache)[0] == 0
    assert_bits_equal(k_pools + v_pools, pools_before)
    k_new, v_new = [torch.zeros_like(p) for p in k_pools], [torch.zeros_like(p) for p in v_pools]
    k_ref, v_ref = [p.clone() for p in k_new], [p.clone() for p in v_new]
    cuda_ext.paged_scatter_ref(k_cache, v_cache, ids, k_ref, v_ref)
    assert emulate(harness, True, k_new, v_new, ids, n, k_cache, v_cache)[0] == 0
    assert_bits_equal(k_new + v_new, k_ref + v_ref)


def _guarded_zeros(pool):
    """A zero pool shaped like ``pool`` with one guard block before and after it."""
    buf = torch.zeros((pool.shape[0] + 2, *pool.shape[1:]), dtype=pool.dtype)
    return buf, buf[1:-1]


def test_emulated_kernel_skips_out_of_range_ids(harness):
    k_pools, v_pools, ids, n, k_cache, v_cache = _case("bf16_d80_d72_kv_differ", seed=1)
    bs, num_blocks = k_pools[0].shape[1], k_pools[0].shape[0]
    bad = ids.clone()
    bad[0, 1], bad[1, 0] = -1, num_blocks  # just outside the pool on either side
    # gather: tokens with a bad id are skipped, every other token is copied
    before = [c.clone() for c in k_cache + v_cache]
    assert emulate(harness, False, k_pools, v_pools, bad, n, k_cache, v_cache)[0] == 0
    expected = [c.clone() for c in k_cache + v_cache]
    cuda_ext.paged_gather_ref(k_pools, v_pools, ids, n, expected[: len(k_pools)], expected[len(k_pools) :])
    for exp, old in zip(expected, before):
        exp[0, :, bs : 2 * bs] = old[0, :, bs : 2 * bs]
        exp[1, :, :bs] = old[1, :, :bs]
    assert_bits_equal(k_cache + v_cache, expected)
    # scatter: nothing lands outside the pool (guard blocks stay zero) or in the bad ids' place
    guarded = [_guarded_zeros(p) for p in k_pools + v_pools]
    pools = [g[1] for g in guarded]
    assert (
        emulate(harness, True, pools[: len(k_pools)], pools[len(k_pools) :], bad, n, k_cache, v_cache)[0] == 0
    )
    expected = [torch.zeros_like(p) for p in pools]
    cuda_ext.paged_scatter_ref(k_cache, v_cache, ids, expected[: len(k_pools)], expected[len(k_pools) :])
    for exp in expected:
        exp[ids[0, 1]] = 0
        exp[ids[1, 0]] = 0
    assert_bits_equal(pools, expected)
    for buf, _ in guarded:
        assert not bits(buf[0]).any() and not bits(buf[-1]).any(), "wrote outside the pool"


def test_emulated_launcher_rejects_bad_geometry(harness):
    k_pools, v_pools, ids, n, k_cache, v_cache = _case("bf16_d128_16B_units")
    before = [c.clone() for c in k_cache]
    too_many = (ids.shape[1] * k_pools[0].shape[1]) + 1
    err, _, launches = emulate(harness, False, k_pools, v_pools, ids, too_many, k_cache, v_cache)
    assert err == 1 and launches == 0  # cudaErrorInvalidValue, nothing launched
    assert_bits_equal(k_cache, before)
    err, _, launches = emulate(harness, False, k_pools, v_pools, ids[:0], n, k_cache, v_cache)
    assert err == 0 and launches == 0  # batch 0: nothing to do


# ---- the torch bindings: syntax only -------------------------------------------------------------


@pytest.mark.slow
def test_bindings_pass_syntax_check(tmp_path):
    cxx = shutil.which("g++") or shutil.which("c++")
    torch_inc = Path(torch.__file__).parent / "include"
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    roots.append(str(Path(NVCC).resolve().parent.parent) if NVCC else None)
    cuda_inc = next(
        (Path(r, "include") for r in roots if r and Path(r, "include/cuda_runtime.h").exists()), None
    )
    if cxx is None or not (torch_inc / "c10/cuda/CUDAGuard.h").exists() or cuda_inc is None:
        pytest.skip("needs a host C++ compiler, torch's c10/cuda headers and the CUDA headers")
    stub = tmp_path / "c10/cuda/impl/cuda_cmake_macros.h"  # generated; only CUDA wheels ship it
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [cxx, "-fsyntax-only", "-std=c++20", "-Wall", "-Wextra", "-Werror",
           "-isystem", str(tmp_path), "-isystem", str(torch_inc),
           "-isystem", str(torch_inc / "torch/csrc/api/include"), "-isystem", str(cuda_inc),
           f"-I{CSRC}", str(CSRC / "paged_copy_bindings.cpp")]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr


def test_cuda_dispatch_path_with_emulated_kernel(harness, monkeypatch):
    """The public ops' CUDA-side Python (validation, id transfer, call into the private op),
    with the private kernel ops served by the emulated kernel on CPU tensors."""
    from cuda_ext import build, ops

    calls = []

    def gather(k_pools, v_pools, ids, n, k_out, v_out):
        calls.append("gather")
        assert emulate(harness, False, k_pools, v_pools, ids, n, k_out, v_out)[0] == 0

    def scatter(k_src, v_src, ids, k_pools, v_pools):
        calls.append("scatter")
        n = k_src[0].shape[2]
        assert emulate(harness, True, k_pools, v_pools, ids, n, k_src, v_src)[0] == 0

    lib = torch.library.Library("radixkv", "IMPL")
    try:
        lib.impl("_paged_gather_cuda", gather, "CPU")
        lib.impl("_paged_scatter_cuda", scatter, "CPU")
        monkeypatch.setattr(build, "backend_for", lambda device: "cuda-kernel")
        k_pools, v_pools, ids, n, k_out, v_out = mixed_case(seed=4)
        k_exp = [torch.empty_like(o) for o in k_out]
        v_exp = [torch.empty_like(o) for o in v_out]
        cuda_ext.paged_gather_ref(k_pools, v_pools, ids, n, k_exp, v_exp)
        ops._gather_impl(k_pools, v_pools, ids.int(), n, k_out, v_out, use_kernel=True)
        assert_bits_equal(k_out + v_out, k_exp + v_exp)
        k_new = [torch.zeros_like(p) for p in k_pools]
        v_new = [torch.zeros_like(p) for p in v_pools]
        k_ref, v_ref = [p.clone() for p in k_new], [p.clone() for p in v_new]
        cuda_ext.paged_scatter_ref(k_out, v_out, ids, k_ref, v_ref)
        ops._scatter_impl(k_out, v_out, ids, k_new, v_new, use_kernel=True)
        assert_bits_equal(k_new + v_new, k_ref + v_ref)
        with pytest.raises(ValueError, match="out of range"):  # validated before the kernel
            ops._gather_impl(k_pools, v_pools, ids + 100, n, k_out, v_out, use_kernel=True)
        assert calls == ["gather", "scatter"]
    finally:
        lib._destroy()
