"""cuda_ext on CPU: the registered ops (reference path) against naive per-token loops.

Values are random bit patterns (NaN, inf and subnormals included) and every comparison is
on the raw bits, so "equal" means bit-exact. The helpers are reused by the GPU tests and the
kernel emulation in test_cuda_compile.py.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import cuda_ext
from cuda_ext import build

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


# ---- helpers (imported by the other cuda_ext test modules) -------------------------------


def rand_bits(shape, dtype, gen: torch.Generator, device="cpu") -> torch.Tensor:
    """A tensor of ``dtype`` whose elements are uniformly random bit patterns."""
    bits = _BITS[dtype]
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, tuple(shape), dtype=torch.int64, generator=gen)
    return raw.to(bits).view(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (integer tensors are returned as they are)."""
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


def assert_bits_equal(actual, expected) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.shape == e.shape, f"layer {i}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert torch.equal(bits(a), bits(e)), f"layer {i}: bits differ"


def make_pools(layers, num_blocks, block_size, heads, k_dim, v_dim, dtype, gen, device="cpu", finite=False):
    """Per-layer K and V pools ``[num_blocks, block_size, heads, k_dim|v_dim]``.

    Random bits, or standard normal values with ``finite`` (for tests that do arithmetic).
    """

    def one(dim):
        shape = (num_blocks, block_size, heads, dim)
        if finite:
            return torch.randn(shape, generator=gen).to(device, dtype)
        return rand_bits(shape, dtype, gen, device)

    return [one(k_dim) for _ in range(layers)], [one(v_dim) for _ in range(layers)]


def make_ids(batch, cols, num_blocks, id_dtype, gen, device="cpu") -> torch.Tensor:
    """``[batch, cols]`` distinct block ids in random order."""
    return torch.randperm(num_blocks, generator=gen)[: batch * cols].view(batch, cols).to(device, id_dtype)


def make_cache(shape, dtype, style: str, gen, device="cpu") -> torch.Tensor:
    """A ``[B, H, T, D]`` tensor laid out as ``style`` and filled with random bits.

    contiguous | slice (offset window of a bigger buffer, odd element offset)
    | seq_major (a ``[B, T, H, D]`` buffer permuted) | dim_strided (last dim stride != 1).
    """
    b, h, t, d = shape
    if style == "contiguous":
        return rand_bits(shape, dtype, gen, device)
    if style == "slice":
        return rand_bits((b + 1, h, t + 5, d + 3), dtype, gen, device)[1:, :, 3 : 3 + t, 1 : 1 + d]
    if style == "seq_major":
        return rand_bits((b, t, h, d), dtype, gen, device).permute(0, 2, 1, 3)
    if style == "dim_strided":
        return rand_bits((b, h, d, t), dtype, gen, device).transpose(2, 3)
    raise ValueError(style)


def naive_gather(k_pools, v_pools, block_ids, num_tokens):
    """Per-token loops: contiguous ``[B, H, T, D]`` results for every K and V layer."""
    ids = block_ids.cpu().tolist()
    out = []
    for pool in (*k_pools, *v_pools):
        bs = pool.shape[1]
        res = torch.empty(len(ids), pool.shape[2], num_tokens, pool.shape[3], dtype=pool.dtype)
        for b, row in enumerate(ids):
            for t in range(num_tokens):
                res[b, :, t, :] = pool[row[t // bs], t % bs].cpu()
        out.append(res)
    return out[: len(k_pools)], out[len(k_pools) :]


def naive_scatter(k_src, v_src, block_ids, k_pools, v_pools):
    """Per-token loops on CPU copies of the pools; returns the expected pools."""
    ids = block_ids.cpu().tolist()
    out = []
    for src, pool in zip((*k_src, *v_src), (*k_pools, *v_pools)):
        res, bs = pool.cpu().clone(), pool.shape[1]
        for b, row in enumerate(ids):
            for t in range(src.shape[2]):
                res[row[t // bs], t % bs] = src[b, :, t, :].cpu()
        out.append(res)
    return out[: len(k_pools)], out[len(k_pools) :]


def gather_case(
    dtype,
    block_size,
    *,
    layers=3,
    batch=3,
    heads=2,
    k_dim=8,
    v_dim=12,
    cols=3,
    num_tokens=None,
    id_dtype=torch.int64,
    styles=("slice", "seq_major"),
    seed=0,
    device="cpu",
    finite=False,
):
    """Pools, ids and output views for one gather call (a partly used last block by default)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = batch * cols + 2
    k_pools, v_pools = make_pools(
        layers, num_blocks, block_size, heads, k_dim, v_dim, dtype, gen, device, finite
    )
    ids = make_ids(batch, cols, num_blocks, id_dtype, gen, device)
    if num_tokens is None:
        num_tokens = max(0, cols * block_size - (block_size + 1) // 2)
    k_out = [
        make_cache((batch, heads, num_tokens, k_dim), dtype, styles[0], gen, device) for _ in range(layers)
    ]
    v_out = [
        make_cache((batch, heads, num_tokens, v_dim), dtype, styles[1], gen, device) for _ in range(layers)
    ]
    return k_pools, v_pools, ids, num_tokens, k_out, v_out


# ---- gather / scatter against the naive loops --------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_matches_naive(dtype, block_size):
    id_dtype = torch.int32 if block_size == 16 else torch.int64
    k_pools, v_pools, ids, n, _, v_out = gather_case(dtype, block_size, id_dtype=id_dtype, seed=block_size)
    gen = torch.Generator().manual_seed(1)
    batch, heads, k_dim = ids.shape[0], k_pools[0].shape[2], k_pools[0].shape[3]
    # k_out: windows of bigger preallocated buffers; nothing outside a window may change.
    bufs = [rand_bits((batch + 1, heads, n + 5, k_dim + 3), dtype, gen) for _ in k_pools]
    k_out = [buf[1:, :, 3 : 3 + n, 1 : 1 + k_dim] for buf in bufs]
    expected_bufs = [buf.clone() for buf in bufs]
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    k_exp, v_exp = naive_gather(k_pools, v_pools, ids, n)
    for buf, exp in zip(expected_bufs, k_exp):
        bits(buf[1:, :, 3 : 3 + n, 1 : 1 + k_dim]).copy_(bits(exp))
    assert_bits_equal(bufs, expected_bufs)
    assert_bits_equal(v_out, v_exp)


@pytest.mark.parametrize("style", ["contiguous", "slice", "seq_major", "dim_strided"])
def test_gather_output_layouts(style):
    k_pools, v_pools, ids, n, k_out, v_out = gather_case(torch.bfloat16, 16, styles=(style, style), seed=1)
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    k_exp, v_exp = naive_gather(k_pools, v_pools, ids, n)
    assert_bits_equal(k_out + v_out, k_exp + v_exp)


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter_matches_naive(dtype, block_size):
    id_dtype = torch.int32 if block_size != 16 else torch.int64
    k_pools, v_pools, ids, n, k_src, v_src = gather_case(
        dtype, block_size, id_dtype=id_dtype, styles=("dim_strided", "slice"), seed=7 + block_size
    )
    k_exp, v_exp = naive_scatter(k_src, v_src, ids, k_pools, v_pools)
    cuda_ext.paged_scatter(k_src, v_src, ids, k_pools, v_pools)
    assert_bits_equal(k_pools + v_pools, k_exp + v_exp)  # untouched slots kept their bits too


def mixed_case(seed=0, device="cpu"):
    """Layers that differ in heads, head dims and dtype (one call still shares blocks)."""
    gen = torch.Generator().manual_seed(seed)
    specs = [(2, 8, 8, torch.float32), (4, 16, 6, torch.bfloat16), (1, 3, 5, torch.float16)]
    num_blocks, bs, batch, cols, n = 10, 4, 2, 3, 10
    k_pools = [rand_bits((num_blocks, bs, h, dk), dt, gen, device) for h, dk, _, dt in specs]
    v_pools = [rand_bits((num_blocks, bs, h, dv), dt, gen, device) for h, _, dv, dt in specs]
    ids = make_ids(batch, cols, num_blocks, torch.int64, gen, device)
    k_out = [make_cache((batch, h, n, dk), dt, "seq_major", gen, device) for h, dk, _, dt in specs]
    v_out = [make_cache((batch, h, n, dv), dt, "slice", gen, device) for h, _, dv, dt in specs]
    return k_pools, v_pools, ids, n, k_out, v_out


def test_layers_may_differ_in_heads_dims_and_dtype():
    k_pools, v_pools, ids, n, k_out, v_out = mixed_case()
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    assert_bits_equal(k_out + v_out, sum(naive_gather(k_pools, v_pools, ids, n), []))
    k_src = [torch.flip(o, dims=[2]) for o in k_out]
    k_exp, v_exp = naive_scatter(k_src, v_out, ids, k_pools, v_pools)
    cuda_ext.paged_scatter(k_src, v_out, ids, k_pools, v_pools)
    assert_bits_equal(k_pools + v_pools, k_exp + v_exp)


def test_reference_functions_match_ops():
    k_pools, v_pools, ids, n, k_out, v_out = gather_case(
        torch.float16, 16, styles=("contiguous", "seq_major")
    )
    k_ref = [torch.empty_like(o) for o in k_out]
    v_ref = [torch.empty_like(o) for o in v_out]
    cuda_ext.paged_gather_ref(k_pools, v_pools, ids, n, k_ref, v_ref)
    torch.ops.radixkv.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)
    assert_bits_equal(k_out + v_out, k_ref + v_ref)


def test_scatter_then_gather_round_trips_batch_of_rows():
    gen = torch.Generator().manual_seed(3)
    k_pools, v_pools = make_pools(4, 40, 16, 4, 16, 8, torch.bfloat16, gen)
    ids = make_ids(5, 4, 40, torch.int64, gen)
    k_src = [make_cache((5, 4, 50, 16), torch.bfloat16, "seq_major", gen) for _ in range(4)]
    v_src = [make_cache((5, 4, 50, 8), torch.bfloat16, "slice", gen) for _ in range(4)]
    cuda_ext.paged_scatter(k_src, v_src, ids, k_pools, v_pools)
    k_out = [torch.empty(5, 4, 50, 16, dtype=torch.bfloat16) for _ in range(4)]
    v_out = [torch.empty(5, 4, 50, 8, dtype=torch.bfloat16) for _ in range(4)]
    cuda_ext.paged_gather(k_pools, v_pools, ids, 50, k_out, v_out)
    assert_bits_equal(k_out + v_out, k_src + v_src)


def test_empty_inputs_are_no_ops():
    k_pools, v_pools, ids, _, k_out, v_out = gather_case(torch.float32, 16, num_tokens=0)
    before = [bits(p).clone() for p in k_pools + v_pools]
    cuda_ext.paged_gather(k_pools, v_pools, ids, 0, k_out, v_out)  # num_tokens 0
    cuda_ext.paged_scatter(k_out, v_out, ids, k_pools, v_pools)
    assert_bits_equal(k_pools + v_pools, before)
    k_pools, v_pools, ids, n, k_out, v_out = gather_case(torch.float32, 16, batch=0)
    cuda_ext.paged_gather(k_pools, v_pools, ids, n, k_out, v_out)  # batch 0
    cuda_ext.paged_scatter(k_out, v_out, ids, k_pools, v_pools)
    cuda_ext.paged_gather([], [], ids, n, [], [])  # no layers
    cuda_ext.paged_scatter([], [], ids, [], [])


def test_unused_id_columns_are_not_read():
    k_pools, v_pools, ids, _, k_out, v_out = gather_case(torch.float32, 16, num_tokens=20)
    padded = torch.cat([ids, torch.full((ids.shape[0], 2), -1)], dim=1)  # cols 2.. unused
    padded[:, 2] = -1
    cuda_ext.paged_gather(k_pools, v_pools, padded, 20, k_out, v_out)
    assert_bits_equal(k_out + v_out, sum(naive_gather(k_pools, v_pools, ids, 20), []))


# ---- torch.library integration --------------------------------------------------------------


def test_opcheck_gather():
    for styles, id_dtype in (
        (("contiguous", "contiguous"), torch.int64),
        (("dim_strided", "slice"), torch.int32),
    ):
        args = gather_case(torch.float32, 4, layers=2, batch=2, styles=styles, id_dtype=id_dtype)
        torch.library.opcheck(torch.ops.radixkv.paged_gather.default, args)


def test_opcheck_scatter():
    k_pools, v_pools, ids, _, k_src, v_src = gather_case(
        torch.bfloat16, 4, layers=2, batch=2, styles=("seq_major", "slice")
    )
    torch.library.opcheck(torch.ops.radixkv.paged_scatter.default, (k_src, v_src, ids, k_pools, v_pools))


def _gather_double_scatter(k_pools, v_pools, ids, k_out, v_out, dst_ids, k_dst, v_dst):
    cuda_ext.paged_gather(k_pools, v_pools, ids, k_out[0].shape[2], k_out, v_out)
    doubled = [o * 2 for o in k_out]
    cuda_ext.paged_scatter(doubled, v_out, dst_ids, k_dst, v_dst)
    return doubled[0] + 1


@pytest.mark.slow  # ~12 s cold on 2 cores (inductor), still part of the default run
def test_torch_compile_fullgraph_inductor():
    def args(seed):
        k_pools, v_pools, ids, n, k_out, v_out = gather_case(torch.float32, 8, layers=2, seed=0, finite=True)
        gen = torch.Generator().manual_seed(seed)
        k_dst, v_dst = make_pools(2, 12, 8, 2, 8, 12, torch.float32, gen, finite=True)
        dst_ids = make_ids(3, 3, 12, torch.int64, gen)
        return k_pools, v_pools, ids, k_out, v_out, dst_ids, k_dst, v_dst

    eager, compiled = args(1), args(1)
    expected = _gather_double_scatter(*eager)
    fn = torch.compile(_gather_double_scatter, fullgraph=True, backend="inductor")
    got = fn(*compiled)
    torch.testing.assert_close(got, expected, equal_nan=True, rtol=0, atol=0)
    for i in (3, 4, 6, 7):  # k_out, v_out, k_dst, v_dst mutated identically
        assert_bits_equal(compiled[i], eager[i])


# ---- errors ------------------------------------------------------------------------------------

_GATHER_ERRORS = {
    "id_too_large": (
        "ids",
        lambda a: a[2].__setitem__((1, 0), 11),
        r"block id 11 at block_ids\[1, 0\] is out of range \[0, 11\)",
    ),
    "negative_id": ("ids", lambda a: a[2].__setitem__((0, 2), -3), r"block id -3 .* out of range"),
    "too_many_tokens": (
        "n",
        lambda a: 49,
        r"num_tokens=49 exceeds what block_ids holds \(3 blocks x block_size 16",
    ),
    "negative_tokens": ("n", lambda a: -1, r"num_tokens must be >= 0"),
    "layer_counts": ("v_pools", lambda a: a[1][:-1], r"layer counts differ: k_pools=3, v_pools=2"),
    "pool_dims": (
        "k_pools",
        lambda a: [p[0] for p in a[0]],
        r"k_pools\[0\] must be \[num_blocks, block_size, kv_heads, head_dim\]",
    ),
    "pool_shape": (
        "v_pools",
        lambda a: a[1][:2] + [a[1][2][:-1]],
        r"v_pools\[2\] has shape \(10, 16, 2, 12\), expected \[11, 16, kv_heads, head_dim\]",
    ),
    "out_shape": (
        "k_out",
        lambda a: [o[:, :, :-1] for o in a[4]],
        r"k_out\[0\] has shape \(3, 2, 39, 8\), expected \(3, 2, 40, 8\)",
    ),
    "out_dtype": (
        "v_out",
        lambda a: [o.half() for o in a[5]],
        r"v_out\[0\] is torch.float16 but v_pools\[0\] is torch.float32",
    ),
    "out_heads": (
        "v_out",
        lambda a: [o[:, :1] for o in a[5]],
        r"v_out\[0\] has shape \(3, 1, 40, 12\), expected \(3, 2, 40, 12\)",
    ),
    "out_device": (
        "k_out",
        lambda a: [o.to("meta") for o in a[4]],
        r"k_out\[0\] is on meta but k_pools\[0\] is on cpu",
    ),
    "ids_device": ("ids", lambda a: a[2].to("meta"), r"block_ids is on meta but k_pools\[0\] is on cpu"),
    "ids_dtype": ("ids", lambda a: a[2].float(), r"block_ids must be int32 or int64, got torch.float32"),
    "ids_dims": ("ids", lambda a: a[2][0], r"block_ids must be a 2-D"),
    "pool_noncontiguous": (
        "k_pools",
        lambda a: [p.transpose(2, 3).contiguous().transpose(2, 3) for p in a[0]],
        r"k_pools\[0\] must be contiguous",
    ),
    "pool_int32": (
        "pools",
        lambda a: None,
        r"k_pools\[0\] dtype must be float16, bfloat16, float32 or float64, got torch.int32",
    ),
    "expanded_out": (
        "k_out",
        lambda a: [o[:, :1].expand(o.shape) for o in a[4]],
        r"k_out\[0\] is an expanded view",
    ),
    "overlapping_out": (  # token stride 4 < head dim 8: tokens share elements, GPU writes race
        "k_out",
        lambda a: [o.new_zeros(4000).as_strided(o.shape, (640, 320, 4, 1)) for o in a[4]],
        r"k_out\[0\] is a self-overlapping view \(strides \(640, 320, 4, 1\)\)",
    ),
}


@pytest.mark.parametrize("case", sorted(_GATHER_ERRORS))
def test_gather_errors(case):
    what, change, match = _GATHER_ERRORS[case]
    args = list(gather_case(torch.float32, 16, num_tokens=40, styles=("contiguous", "contiguous")))
    if what == "pools":
        args[0], args[1], args[4], args[5] = ([t.to(torch.int32) for t in args[i]] for i in (0, 1, 4, 5))
    else:
        index = {"k_pools": 0, "v_pools": 1, "ids": 2, "n": 3, "k_out": 4, "v_out": 5}[what]
        changed = change(args)
        if changed is not None:
            args[index] = changed
    outs_before = [bits(o).clone() for o in args[4] + args[5] if o.device.type == "cpu" and o.dtype in _BITS]
    with pytest.raises(ValueError, match=match):
        cuda_ext.paged_gather(*args)
    outs_after = [bits(o) for o in args[4] + args[5] if o.device.type == "cpu" and o.dtype in _BITS]
    assert all(torch.equal(a, b) for a, b in zip(outs_after, outs_before)), "a failed call wrote"


def test_scatter_errors():
    k_pools, v_pools, ids, _, k_src, v_src = gather_case(torch.float32, 16, num_tokens=40)
    dup = ids.clone()
    dup[1, 1] = dup[0, 2]
    with pytest.raises(ValueError, match="paged_scatter: block_ids repeats a block"):
        cuda_ext.paged_scatter(k_src, v_src, dup, k_pools, v_pools)
    with pytest.raises(ValueError, match=r"paged_scatter: block id 99 .* out of range"):
        cuda_ext.paged_scatter(k_src, v_src, torch.full_like(ids, 99), k_pools, v_pools)
    with pytest.raises(ValueError, match=r"paged_scatter: num_tokens=40 exceeds"):
        cuda_ext.paged_scatter(k_src, v_src, ids[:, :2], k_pools, v_pools)
    with pytest.raises(ValueError, match=r"paged_scatter: v_src\[1\] is torch.bfloat16"):
        cuda_ext.paged_scatter(k_src, [v_src[0], v_src[1].bfloat16(), v_src[2]], ids, k_pools, v_pools)
    with pytest.raises(ValueError, match=r"paged_scatter: layer counts differ"):
        cuda_ext.paged_scatter(k_src, v_src, ids, k_pools[:1], v_pools)


# ---- backend selection and the build decision ----------------------------------------------


@pytest.fixture
def fresh_build_state(monkeypatch):
    monkeypatch.setattr(build, "_loaded", None)
    monkeypatch.setattr(build, "_failure", None)
    monkeypatch.setattr(build, "_force_reference", None)
    monkeypatch.delenv(build.ENV_FORCE_REFERENCE, raising=False)


def test_cpu_uses_the_runs_path_unless_forced(fresh_build_state):
    assert cuda_ext.backend_for("cpu") == "cpu-runs"
    assert build._loaded is None  # asking about the CPU never builds anything
    cuda_ext.set_force_reference(True)
    assert cuda_ext.backend_for("cpu") == "reference"


def test_force_reference_flag_and_env(fresh_build_state, monkeypatch):
    monkeypatch.setattr(build, "load_kernels", lambda: pytest.fail("must not build when forced"))
    monkeypatch.setenv(build.ENV_FORCE_REFERENCE, "1")
    assert cuda_ext.force_reference() and cuda_ext.backend_for("cuda") == "reference"
    monkeypatch.setenv(build.ENV_FORCE_REFERENCE, "0")
    assert not cuda_ext.force_reference()
    cuda_ext.set_force_reference(True)
    assert cuda_ext.backend_for("cuda:0") == "reference"
    cuda_ext.set_force_reference(False)
    monkeypatch.setenv(build.ENV_FORCE_REFERENCE, "1")
    assert not cuda_ext.force_reference()  # the flag wins over the environment


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only torch")
def test_cpu_torch_never_compiles_and_warns_once(fresh_build_state, caplog):
    with caplog.at_level(logging.WARNING, logger="cuda_ext.build"):
        assert cuda_ext.backend_for("cuda") == "reference"
        assert cuda_ext.backend_for("cuda") == "reference"
    assert len(caplog.records) == 1 and "built without CUDA" in caplog.records[0].getMessage()


def test_missing_nvcc_falls_back_with_warning(fresh_build_state, monkeypatch, caplog):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with caplog.at_level(logging.WARNING, logger="cuda_ext.build"):
        assert cuda_ext.backend_for("cuda") == "reference"
    assert "nvcc not found" in caplog.text and "nvcc not found" in build.unavailable_reason()


def test_import_builds_nothing():
    code = (
        "import sys, cuda_ext, cuda_ext.build as b; "
        "assert b._loaded is None; assert 'torch.utils.cpp_extension' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
