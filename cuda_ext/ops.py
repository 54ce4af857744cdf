"""The ``radixkv`` custom ops: schemas (defined once, here), CPU / CUDA / fake implementations.

Public ops (mutate their outputs, return nothing)::

    radixkv::paged_gather(Tensor[] k_pools, Tensor[] v_pools, Tensor block_ids,
                          SymInt num_tokens, Tensor(a!)[] k_out, Tensor(b!)[] v_out) -> ()
    radixkv::paged_scatter(Tensor[] k_src, Tensor[] v_src, Tensor block_ids,
                           Tensor(a!)[] k_pools, Tensor(b!)[] v_pools) -> ()

CPU: validate, then ``cpu_runs`` (one slice copy per run of consecutive blocks; the
reference when forced or when the ids are fragmented). CUDA: validate, then the fused kernel
(``radixkv::_paged_*_cuda``, registered by ``csrc/paged_copy_bindings.cpp`` once
``cuda_ext.build`` has loaded it) or the reference when the kernel is unavailable or the
reference is forced. Fake: metadata checks only, so ``torch.compile`` traces through.
"""

from __future__ import annotations

import torch

from cuda_ext import build, cpu_runs, reference, validate

_lib = torch.library.Library("radixkv", "DEF")

_GATHER_ARGS = (
    "(Tensor[] k_pools, Tensor[] v_pools, Tensor block_ids, {int} num_tokens, "
    "Tensor(a!)[] k_out, Tensor(b!)[] v_out) -> ()"
)
_SCATTER_ARGS = (
    "(Tensor[] k_src, Tensor[] v_src, Tensor block_ids, Tensor(a!)[] k_pools, Tensor(b!)[] v_pools) -> ()"
)
_lib.define("paged_gather" + _GATHER_ARGS.format(int="SymInt"))
_lib.define("paged_scatter" + _SCATTER_ARGS)
# The raw CUDA kernels (implemented in C++ only; called after validation, never traced).
_lib.define("_paged_gather_cuda" + _GATHER_ARGS.format(int="int"))
_lib.define("_paged_scatter_cuda" + _SCATTER_ARGS)

_GATHER_CACHE = ("k_out", "v_out")
_SCATTER_CACHE = ("k_src", "v_src")


def _check_gather(k_pools, v_pools, block_ids, num_tokens, k_out, v_out) -> None:
    validate.check_layout(
        "paged_gather", k_pools, v_pools, block_ids, num_tokens, k_out, v_out, _GATHER_CACHE, True
    )


def _check_scatter(k_src, v_src, block_ids, k_pools, v_pools) -> int:
    """Validates the layout and returns the number of tokens written (``S``)."""
    num_tokens = k_src[0].shape[2] if k_src and k_src[0].dim() == 4 else 0
    validate.check_layout(
        "paged_scatter", k_pools, v_pools, block_ids, num_tokens, k_src, v_src, _SCATTER_CACHE, False
    )
    return num_tokens


def _gather_impl(k_pools, v_pools, block_ids, num_tokens, k_out, v_out, use_kernel: bool) -> None:
    _check_gather(k_pools, v_pools, block_ids, num_tokens, k_out, v_out)
    if not k_pools or num_tokens == 0 or block_ids.shape[0] == 0:
        return
    pool = k_pools[0]
    validate.check_block_ids(
        "paged_gather", block_ids, num_tokens, pool.shape[1], pool.shape[0], unique=False
    )
    # CPU ids were validated on the host; a pageable-memory copy is staged before .to returns.
    ids = block_ids.to(pool.device, non_blocking=True)
    backend = build.backend_for(pool.device)
    if use_kernel and backend == "cuda-kernel":
        torch.ops.radixkv._paged_gather_cuda.default(k_pools, v_pools, ids, num_tokens, k_out, v_out)
    elif backend == "cpu-runs":
        cpu_runs.paged_gather_runs(k_pools, v_pools, ids, num_tokens, k_out, v_out)
    else:
        reference.paged_gather_ref(k_pools, v_pools, ids, num_tokens, k_out, v_out)


def _scatter_impl(k_src, v_src, block_ids, k_pools, v_pools, use_kernel: bool) -> None:
    num_tokens = _check_scatter(k_src, v_src, block_ids, k_pools, v_pools)
    if not k_pools or num_tokens == 0 or block_ids.shape[0] == 0:
        return
    pool = k_pools[0]
    validate.check_block_ids(
        "paged_scatter", block_ids, num_tokens, pool.shape[1], pool.shape[0], unique=True
    )
    ids = block_ids.to(pool.device, non_blocking=True)
    backend = build.backend_for(pool.device)
    if use_kernel and backend == "cuda-kernel":
        torch.ops.radixkv._paged_scatter_cuda.default(k_src, v_src, ids, k_pools, v_pools)
    elif backend == "cpu-runs":
        cpu_runs.paged_scatter_runs(k_src, v_src, ids, k_pools, v_pools)
    else:
        reference.paged_scatter_ref(k_src, v_src, ids, k_pools, v_pools)


def _gather_cpu(k_pools, v_pools, block_ids, num_tokens, k_out, v_out) -> None:
    _gather_impl(k_pools, v_pools, block_ids, num_tokens, k_out, v_out, use_kernel=False)


def _gather_cuda(k_pools, v_pools, block_ids, num_tokens, k_out, v_out) -> None:
    _gather_impl(k_pools, v_pools, block_ids, num_tokens, k_out, v_out, use_kernel=True)


def _scatter_cpu(k_src, v_src, block_ids, k_pools, v_pools) -> None:
    _scatter_impl(k_src, v_src, block_ids, k_pools, v_pools, use_kernel=False)


def _scatter_cuda(k_src, v_src, block_ids, k_pools, v_pools) -> None:
    _scatter_impl(k_src, v_src, block_ids, k_pools, v_pools, use_kernel=True)


def _gather_fake(k_pools, v_pools, block_ids, num_tokens, k_out, v_out) -> None:
    _check_gather(k_pools, v_pools, block_ids, num_tokens, k_out, v_out)


def _scatter_fake(k_src, v_src, block_ids, k_pools, v_pools) -> None:
    _check_scatter(k_src, v_src, block_ids, k_pools, v_pools)


_lib.impl("paged_gather", _gather_cpu, "CPU")
_lib.impl("paged_gather", _gather_cuda, "CUDA")
_lib.impl("paged_scatter", _scatter_cpu, "CPU")
_lib.impl("paged_scatter", _scatter_cuda, "CUDA")
torch.library.register_fake("radixkv::paged_gather", _gather_fake, lib=_lib)
torch.library.register_fake("radixkv::paged_scatter", _scatter_fake, lib=_lib)


def paged_gather(k_pools, v_pools, block_ids, num_tokens, k_out, v_out) -> None:
    """Copies each row's first ``num_tokens`` cached tokens from the pool into ``k_out``/``v_out``.

    ``out[l][b, h, t, :] = pool[l][block_ids[b, t // bs], t % bs, h, :]`` for ``t < num_tokens``.

    k_pools / v_pools: per layer ``[num_blocks, bs, H_l, Dk_l]`` / ``[num_blocks, bs, H_l, Dv_l]``,
        contiguous, fp16/bf16/fp32; ``num_blocks``, ``bs`` and the device are shared by every
        tensor of the call, heads / head dims / dtype may differ per layer and K/V.
    block_ids: ``[B, nb]`` int32/int64 with ``num_tokens <= nb * bs``, on that device or on
        the CPU. CPU ids are range-checked without a device sync and then copied with
        ``non_blocking=True`` (so pinned CPU ids must not change until the stream has run the
        copy); device ids cost one device->host sync for the check. See ``cuda_ext.validate``.
    k_out / v_out: per layer ``[B, H_l, num_tokens, D]`` in the pool's dtype, any strides
        (views of bigger buffers are fine), written in place. On CUDA: one kernel launch for
        up to 32 layers (64 K/V views), ``ceil(2 * layers / 64)`` launches beyond.
    Raises ValueError naming the argument at fault (shape, dtype, device, id out of range).
    """
    torch.ops.radixkv.paged_gather.default(k_pools, v_pools, block_ids, num_tokens, k_out, v_out)


def paged_scatter(k_src, v_src, block_ids, k_pools, v_pools) -> None:
    """Writes each row's ``S`` tokens from ``k_src``/``v_src`` into the pool's blocks.

    ``pool[l][block_ids[b, t // bs], t % bs, h, :] = src[l][b, h, t, :]`` for ``t < S``.

    k_src / v_src: per layer ``[B, H_l, S, Dk_l|Dv_l]`` in the pool's dtype, any strides.
    block_ids: ``[B, nb]`` int32/int64, ``S <= nb * bs``, the used ones distinct and in range,
    on the pools' device or the CPU (as in :func:`paged_gather`). k_pools / v_pools: as in
    :func:`paged_gather`, mutated in place (slots past ``S`` in a partly filled block are
    left untouched). On CUDA: one kernel launch for up to 32 layers.
    """
    torch.ops.radixkv.paged_scatter.default(k_src, v_src, block_ids, k_pools, v_pools)
