"""Cascade attention: a prefix that many rows share, attended once for all their queries, merged
with each row's own keys by log-sum-exp.

    out, lse = attend(query, key, value, mask, scale)      # one part, with its log-sum-exp
    out, lse = merge(out_a, lse_a, out_b, lse_b)            # two parts of one softmax as one

``attend``: ``query`` ``[B, H, N, D]``, ``key`` / ``value`` ``[B, H, T, D]`` / ``[B, H, T, Dv]``
(equal head counts: grouped-query heads are packed as more query rows by the caller, which is
exact, since each query row's softmax is its own), any strides; ``mask``: None or an additive
float mask broadcastable to ``[B, 1, N, T]`` (0 or -inf, the query's dtype); each query row must
see at least one key. Returns ``out`` ``[B, H, N, Dv]`` in the query's dtype and ``lse``
``[B, H, N]`` float32: ``logsumexp(q k^T * scale + mask)`` per query row.

On the CPU both come from ``aten._scaled_dot_product_flash_attention_for_cpu`` (the kernel CPU
SDPA runs, strided inputs read in place: a prefix read straight from a block pool is not
copied); elsewhere from the plain formula (``attend_reference``, also the tests' oracle). The
merged result equals one softmax over both parts' keys up to the order of the sums (~1e-7 in
fp32): not bit-exact with a single SDPA call over the concatenated keys.
"""

from __future__ import annotations

import torch

__all__ = ["attend", "attend_reference", "merge"]


def attend_reference(query, key, value, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend`` in plain torch (float32 internally): the oracle and the non-CPU path."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), value.float())
    return out.to(query.dtype), lse


def attend(query, key, value, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module."""
    if query.device.type == "cpu" and query.dtype in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
    ):
        if key.shape[-1] == value.shape[-1]:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, attn_mask=mask, scale=scale
            )
            return out, lse.float()
    return attend_reference(query, key, value, mask, scale)


def merge(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two parts' ``[..., N, Dv]`` outputs and ``[..., N]`` log-sum-exps as one softmax's over the
    union of their keys (both parts finite: each saw at least one key)."""
    top = torch.maximum(lse_a, lse_b)
    wa = torch.exp(lse_a - top)
    wb = torch.exp(lse_b - top)
    total = wa + wb
    out = (out_a.float() * (wa / total).unsqueeze(-1) + out_b.float() * (wb / total).unsqueeze(-1)).to(
        out_a.dtype
    )
    return out, top + torch.log(total)
