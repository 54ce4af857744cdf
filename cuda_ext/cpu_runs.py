"""CPU paged gather / scatter that copies each run of consecutive blocks as one slice.

The reference picks tokens with ``index_select`` into a temporary and then copies that into
the output: two copies of every byte. A pool hands out ascending runs of block ids (see
``radixkv.BlockPool.allocate``), so a cached prefix is usually a few runs; a run's tokens are
one contiguous slice of the pool's flat ``[num_blocks * block_size, H, D]`` view, and one
strided ``copy_`` per run moves them straight to (or from) the ``[H, T, D]`` cache row.
One copy instead of two is what lets a preload beat ``copy.deepcopy`` of a DynamicCache.

Same contract as ``cuda_ext.reference`` (which validates nothing either: ``cuda_ext.ops``
validates first), same bits: only slicing and ``copy_``. Heavily fragmented ids (many short
runs) go to the reference, whose one ``index_select`` beats many small Python-level copies.
"""

from __future__ import annotations

import torch

from cuda_ext import reference

# Below this mean run length (in tokens) per-run Python overhead outweighs the saved copy.
MIN_MEAN_RUN_TOKENS = 32


def block_runs(ids: list[int], block_size: int, num_tokens: int) -> list[tuple[int, int, int]]:
    """``(first_pool_row, first_token, num_tokens)`` per run of consecutive ids covering ``num_tokens``."""
    used = -(-num_tokens // block_size)
    runs: list[tuple[int, int, int]] = []
    start = 0
    for j in range(1, used + 1):
        if j == used or ids[j] != ids[j - 1] + 1:
            first_token = start * block_size
            runs.append((ids[start] * block_size, first_token, min(j * block_size, num_tokens) - first_token))
            start = j
    return runs


def _row_runs(
    block_ids: torch.Tensor, block_size: int, num_tokens: int
) -> list[list[tuple[int, int, int]]] | None:
    """Runs per batch row, or None when the ids are too fragmented for this path to pay."""
    rows = block_ids.tolist()
    runs = [block_runs(row, block_size, num_tokens) for row in rows]
    if sum(map(len, runs)) * MIN_MEAN_RUN_TOKENS > max(num_tokens * len(rows), MIN_MEAN_RUN_TOKENS):
        return None
    return runs


def paged_gather_runs(k_pools, v_pools, block_ids, num_tokens, k_out, v_out) -> None:
    """As :func:`cuda_ext.reference.paged_gather_ref`, one copy per run of blocks (CPU tensors)."""
    if not k_pools or num_tokens == 0 or block_ids.shape[0] == 0:
        return
    runs = _row_runs(block_ids, k_pools[0].shape[1], num_tokens)
    if runs is None:
        reference.paged_gather_ref(k_pools, v_pools, block_ids, num_tokens, k_out, v_out)
        return
    for pools, outs in ((k_pools, k_out), (v_pools, v_out)):
        for pool, out in zip(pools, outs):
            flat = pool.view(-1, pool.shape[2], pool.shape[3])  # [nb*bs, H, D]
            for b, row_runs in enumerate(runs):
                for first_row, first_token, n in row_runs:
                    out[b, :, first_token : first_token + n].copy_(
                        flat[first_row : first_row + n].transpose(0, 1)
                    )


def paged_scatter_runs(k_src, v_src, block_ids, k_pools, v_pools) -> None:
    """As :func:`cuda_ext.reference.paged_scatter_ref`, one copy per run of blocks (CPU tensors)."""
    num_tokens = k_src[0].shape[2] if k_src else 0
    if num_tokens == 0 or block_ids.shape[0] == 0:
        return
    runs = _row_runs(block_ids, k_pools[0].shape[1], num_tokens)
    if runs is None:
        reference.paged_scatter_ref(k_src, v_src, block_ids, k_pools, v_pools)
        return
    for srcs, pools in ((k_src, k_pools), (v_src, v_pools)):
        for src, pool in zip(srcs, pools):
            flat = pool.view(-1, pool.shape[2], pool.shape[3])
            for b, row_runs in enumerate(runs):
                for first_row, first_token, n in row_runs:
                    flat[first_row : first_row + n].copy_(
                        src[b, :, first_token : first_token + n].transpose(0, 1)
                    )
