"""Pure-torch paged gather / scatter: the CPU implementation, the fallback, and the test oracle.

Pool layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous).
Cache layout handed to attention: ``[batch, num_kv_heads, seq, head_dim]`` (any strides).
These functions do not validate (``cuda_ext.validate`` does, before they are called); they
copy values exactly (indexing and ``copy_`` only), so any faster path must match them bit
for bit. Cost: one index and one copy per layer and per K/V, i.e. ``4 * layers`` kernels.
"""

from __future__ import annotations

import torch


def _token_rows(block_ids: torch.Tensor, block_size: int, num_tokens: int, device) -> torch.Tensor:
    """Flat pool rows ``[B, num_tokens]`` (int64, on ``device``) of each row's first tokens."""
    t = torch.arange(num_tokens, device=device)
    ids = block_ids.to(device=device, dtype=torch.long, non_blocking=True)
    return ids[:, t // block_size] * block_size + (t % block_size)


def paged_gather_ref(
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
    block_ids: torch.Tensor,
    num_tokens: int,
    k_out: list[torch.Tensor],
    v_out: list[torch.Tensor],
) -> None:
    """``out[l][b, h, t] = pool[l][block_ids[b, t // bs], t % bs, h]`` for ``t < num_tokens``.

    block_ids: ``[B, nb]`` int32/int64 (on the pools' device or CPU); out tensors
    ``[B, H, num_tokens, D]`` with any strides, written in place.
    """
    if not k_pools or num_tokens == 0 or block_ids.shape[0] == 0:
        return
    batch = block_ids.shape[0]
    rows = _token_rows(block_ids, k_pools[0].shape[1], num_tokens, k_pools[0].device).reshape(-1)
    for pools, outs in ((k_pools, k_out), (v_pools, v_out)):
        for pool, out in zip(pools, outs):
            flat = pool.view(-1, pool.shape[2], pool.shape[3])  # [nb*bs, H, D]
            picked = flat.index_select(0, rows).view(batch, num_tokens, pool.shape[2], pool.shape[3])
            out.copy_(picked.permute(0, 2, 1, 3))  # [B, T, H, D] -> [B, H, T, D]


def paged_scatter_ref(
    k_src: list[torch.Tensor],
    v_src: list[torch.Tensor],
    block_ids: torch.Tensor,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
) -> None:
    """``pool[l][block_ids[b, t // bs], t % bs, h] = src[l][b, h, t]`` for ``t < S``.

    src tensors: ``[B, H, S, D]`` (any strides); block_ids ``[B, nb]`` with ``S <= nb * bs``
    and no block written twice. Pools are written in place; other slots are left untouched.
    """
    num_tokens = k_src[0].shape[2] if k_src else 0
    if num_tokens == 0 or block_ids.shape[0] == 0:
        return
    rows = _token_rows(block_ids, k_pools[0].shape[1], num_tokens, k_pools[0].device).reshape(-1)
    for srcs, pools in ((k_src, k_pools), (v_src, v_pools)):
        for src, pool in zip(srcs, pools):
            flat = pool.view(-1, pool.shape[2], pool.shape[3])
            flat.index_copy_(0, rows, src.permute(0, 2, 1, 3).reshape(-1, src.shape[1], src.shape[3]))
