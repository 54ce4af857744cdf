"""Pure-torch paged gather / scatter: the CPU implementation and the test oracle.

Pool layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (contiguous).
Cache layout handed to attention: ``[batch, num_kv_heads, seq, head_dim]`` (any strides).
"""

from __future__ import annotations

import torch


def _token_rows(block_ids: torch.Tensor, block_size: int, num_tokens: int) -> torch.Tensor:
    """Flat pool rows ``[B, num_tokens]`` for the first ``num_tokens`` tokens of each row."""
    t = torch.arange(num_tokens, device=block_ids.device)
    return block_ids.long()[:, t // block_size] * block_size + (t % block_size)


def paged_gather_ref(
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
    block_ids: torch.Tensor,
    num_tokens: int,
    k_out: list[torch.Tensor],
    v_out: list[torch.Tensor],
) -> None:
    """``out[l][b, h, t] = pool[l][block_ids[b, t // bs], t % bs, h]`` for ``t < num_tokens``.

    block_ids: ``[B, nb]`` integer; out tensors ``[B, H, num_tokens, D]`` (written in place).
    """
    if num_tokens == 0 or block_ids.shape[0] == 0:
        return
    block_size = k_pools[0].shape[1]
    rows = _token_rows(block_ids, block_size, num_tokens)  # [B, T]
    for pools, outs in ((k_pools, k_out), (v_pools, v_out)):
        for pool, out in zip(pools, outs):
            flat = pool.view(-1, pool.shape[2], pool.shape[3])  # [nb*bs, H, D]
            out.copy_(flat[rows].permute(0, 2, 1, 3))  # [B, T, H, D] -> [B, H, T, D]


def paged_scatter_ref(
    k_src: list[torch.Tensor],
    v_src: list[torch.Tensor],
    block_ids: torch.Tensor,
    k_pools: list[torch.Tensor],
    v_pools: list[torch.Tensor],
) -> None:
    """``pool[l][block_ids[b, t // bs], t % bs, h] = src[l][b, h, t]`` for ``t < S``.

    src tensors: ``[B, H, S, D]`` (any strides); block_ids ``[B, nb]`` with ``S <= nb * bs``.
    """
    num_tokens = k_src[0].shape[2] if k_src else 0
    if num_tokens == 0 or block_ids.shape[0] == 0:
        return
    block_size = k_pools[0].shape[1]
    rows = _token_rows(block_ids, block_size, num_tokens).reshape(-1)  # [B*T]
    for srcs, pools in ((k_src, k_pools), (v_src, v_pools)):
        for src, pool in zip(srcs, pools):
            flat = pool.view(-1, pool.shape[2], pool.shape[3])
            flat[rows] = src.permute(0, 2, 1, 3).reshape(-1, src.shape[1], src.shape[3])
