"""CPU paged gather / scatter that copies each run of consecutive blocks as one slice.

The reference picks tokens with ``index_select`` into a temporary and then copies that into
the output: two copies of every byte. A pool hands out ascending runs of block ids (see
``radixkv.BlockPool.allocate``), so a cached prefix is usually a few runs; a run's tokens are
one contiguous slice of the pool's flat ``[num_blocks * block_size, H, D]`` view, and one
strided ``copy_`` per run moves them straight to (or from) the ``[H, T, D]`` cache row.
One copy instead of two is what lets a preload beat ``copy.deepcopy`` of a DynamicCache.
Layers that are slices of one buffer (``cuda_ext.stacking``) move together: one copy per run
for all layers and K/V, not one per layer.

Same contract as ``cuda_ext.reference`` (which validates nothing either: ``cuda_ext.ops``
validates first), same bits: only slicing, indexing and ``copy_``. Heavily fragmented ids
(many short runs) take one ``index_select`` / ``index_copy_`` per group of layers instead, as
the reference does per layer: it beats many small Python-level copies.
"""

from __future__ import annotations

import torch

from cuda_ext.stacking import chunks, layer_groups

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


def _token_rows(block_ids: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Flat pool rows ``[B * num_tokens]`` (int64) of each row's first ``num_tokens`` tokens."""
    t = torch.arange(num_tokens)
    return (block_ids.long()[:, t // block_size] * block_size + t % block_size).reshape(-1)


def paged_gather_runs(k_pools, v_pools, block_ids, num_tokens, k_out, v_out) -> None:
    """As :func:`cuda_ext.reference.paged_gather_ref`: per group of stacked layers
    (``cuda_ext.stacking``), one copy per run of blocks, or one ``index_select`` for
    fragmented ids (CPU tensors)."""
    if not k_pools or num_tokens == 0 or block_ids.shape[0] == 0:
        return
    runs = _row_runs(block_ids, k_pools[0].shape[1], num_tokens)
    groups = layer_groups(k_pools, v_pools, k_out, v_out)
    if runs is None:
        rows = _token_rows(block_ids, k_pools[0].shape[1], num_tokens)
        batch = block_ids.shape[0]
        for pools, outs in groups:  # [n, N, bs, H, D], [n, B, H, T, D]
            _, _, _, heads, dim = pools.shape
            for part in chunks(pools.shape[0], rows.numel() * heads * dim):
                p = pools[part]
                picked = p.flatten(1, 2).index_select(1, rows).view(-1, batch, num_tokens, heads, dim)
                outs[part].copy_(picked.transpose(2, 3))
        return
    for pools, outs in groups:
        flat = pools.flatten(1, 2)  # [n, N * bs, H, D]
        per_token = flat.shape[2] * flat.shape[3]
        for b, row_runs in enumerate(runs):
            for first_row, first_token, n in row_runs:
                for part in chunks(flat.shape[0], n * per_token):
                    outs[part, b, :, first_token : first_token + n].copy_(
                        flat[part, first_row : first_row + n].transpose(1, 2)
                    )


def paged_scatter_runs(k_src, v_src, block_ids, k_pools, v_pools) -> None:
    """As :func:`cuda_ext.reference.paged_scatter_ref`, grouped as :func:`paged_gather_runs`."""
    num_tokens = k_src[0].shape[2] if k_src else 0
    if num_tokens == 0 or block_ids.shape[0] == 0:
        return
    runs = _row_runs(block_ids, k_pools[0].shape[1], num_tokens)
    groups = layer_groups(k_pools, v_pools, k_src, v_src)
    if runs is None:
        rows = _token_rows(block_ids, k_pools[0].shape[1], num_tokens)
        for pools, srcs in groups:  # [n, N, bs, H, D], [n, B, H, S, D]
            _, _, _, heads, dim = pools.shape
            for part in chunks(pools.shape[0], rows.numel() * heads * dim):
                # reshape copies the strided sources once; index_copy_ then writes the pool rows.
                src = srcs[part].transpose(2, 3).reshape(-1, rows.numel(), heads, dim)
                pools[part].flatten(1, 2).index_copy_(1, rows, src)
        return
    for pools, srcs in groups:
        flat = pools.flatten(1, 2)
        per_token = flat.shape[2] * flat.shape[3]
        for b, row_runs in enumerate(runs):
            for first_row, first_token, n in row_runs:
                for part in chunks(flat.shape[0], n * per_token):
                    flat[part, first_row : first_row + n].copy_(
                        srcs[part, b, :, first_token : first_token + n].transpose(1, 2)
                    )
