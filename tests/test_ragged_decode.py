"""cuda_ext.ragged_decode: decode attention over each row's own columns equals SDPA with a mask
hiding the other columns, over grouped-query heads, strided buffer views and a value head size
other than the key's; bad arguments are refused by name."""

from __future__ import annotations

import pytest
import torch

from cuda_ext import ragged_decode as rd

pytestmark = pytest.mark.skipif(not rd.available(), reason="numba is not installed (the demo extra)")


def reference(q, k, v, starts, end, scale):
    """SDPA over columns :end with columns before starts[b] masked, per query head."""
    batch, heads, _ = q.shape
    rep = heads // k.shape[1]
    keep = torch.zeros(batch, 1, 1, end, dtype=torch.bool)
    for b, s in enumerate(starts):
        keep[b, ..., s:] = True
    kk = k[:, :, :end].repeat_interleave(rep, dim=1)
    vv = v[:, :, :end].repeat_interleave(rep, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), kk, vv, attn_mask=keep, scale=scale
    )
    return out[:, :, 0]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "dv"),
    [(4, 4, 16, 16), (8, 4, 64, 64), (8, 2, 32, 32), (4, 1, 16, 16), (4, 2, 24, 16)],
)
def test_equals_sdpa_over_each_rows_columns(heads, kv_heads, dim, dv):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + dim)
    batch, capacity, end = 5, 40, 29
    # an AppendLayer-like buffer and its view of the first `end` columns (strided)
    kbuf = torch.randn(batch, kv_heads, capacity, dim, generator=g)
    vbuf = torch.randn(batch, kv_heads, capacity, dv, generator=g)
    k, v = kbuf[:, :, :end], vbuf[:, :, :end]
    q = torch.randn(batch, heads, dim, generator=g)
    starts = [0, 7, 28, 15, 3]  # a row of one column included
    got = rd.ragged_decode(q, k, v, starts, end, 0.3)
    assert got.shape == (batch, heads, dv)
    torch.testing.assert_close(got, reference(q, k, v, starts, end, 0.3), rtol=1e-5, atol=1e-5)
    # the same through contiguous copies, and what lies past `end` or before a start never counts
    kbuf[:, :, end:] = float("nan")
    kbuf[1, :, :7] = float("nan")
    vbuf[1, :, :7] = 1e30
    again = rd.ragged_decode(q, k.contiguous(), v.contiguous(), starts, end, 0.3)
    torch.testing.assert_close(again, rd.ragged_decode(q, k, v, starts, end, 0.3), rtol=0, atol=0)
    assert torch.isfinite(again).all()


def test_refuses_what_it_cannot_compute():
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 10, 8)
    with pytest.raises(ValueError, match="float32 on the CPU"):
        rd.ragged_decode(q.double(), k, k, [0, 0], 10, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        rd.ragged_decode(torch.zeros(2, 3, 8), k, k, [0, 0], 10, 1.0)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="does not fit"):
        rd.ragged_decode(torch.zeros(3, 4, 8), k, k, [0, 0, 0], 10, 1.0)
    with pytest.raises(ValueError, match="starts"):
        rd.ragged_decode(q, k, k, [0], 10, 1.0)
    for starts, end in (([0, 10], 10), ([-1, 0], 10), ([0, 0], 11), ([0, 0], 0)):
        with pytest.raises(ValueError, match="columns"):
            rd.ragged_decode(q, k, k, starts, end, 1.0)
    with pytest.raises(ValueError, match="query"):
        rd.ragged_decode(torch.zeros(2, 4, 1, 8), k, k, [0, 0], 10, 1.0)


def test_without_numba_says_so(monkeypatch):
    monkeypatch.setattr(rd, "numba", None)
    assert not rd.available()
    with pytest.raises(RuntimeError, match="numba"):
        rd.ragged_decode(torch.zeros(1, 1, 4), torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), [0], 2, 1.0)
