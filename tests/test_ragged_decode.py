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


def test_pooled_sums_as_the_same_prefix_copied_into_the_rows_columns():
    """Rows whose first tokens lie in a pool (fragmented block lists, a partial last block, a row
    with none) attend to them then to their own columns: bit for bit what ragged_packed gives
    over buffers holding those tokens in the rows' columns; unread pool blocks never count."""
    g = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, dv, bs = 8, 2, 24, 16, 4
    pool_k = torch.randn(12, bs, kv_heads, dim, generator=g)
    pool_v = torch.randn(12, bs, kv_heads, dv, generator=g)
    tables = torch.tensor([[7, 2, 9], [4, 0, 0], [0, 0, 0]])
    lengths = [10, 3, 0]
    own = torch.randn(3, kv_heads, 9, dim, generator=g)
    own_v = torch.randn(3, kv_heads, 9, dv, generator=g)
    starts = [6, 2, 0]  # each row's own columns start:9
    # the copy: each row's pool tokens written into its columns before its own
    width = 9 + max(lengths)
    k = torch.zeros(3, kv_heads, width, dim)
    v = torch.zeros(3, kv_heads, width, dv)
    copy_starts = []
    for b, n in enumerate(lengths):
        rows = torch.cat([pool_k[t] for t in tables[b]])[:n].transpose(0, 1)
        rows_v = torch.cat([pool_v[t] for t in tables[b]])[:n].transpose(0, 1)
        first = width - (9 - starts[b]) - n
        k[b, :, first : first + n], v[b, :, first : first + n] = rows, rows_v
        k[b, :, first + n :], v[b, :, first + n :] = own[b, :, starts[b] :], own_v[b, :, starts[b] :]
        copy_starts.append(first)
    # 5 query tokens: a decode token per row, and two earlier ones of row 0 (causal ends)
    slots, ends = [0, 1, 2, 0, 0], [9, 9, 9, 7, 8]
    q = torch.randn(5, heads, dim, generator=g)
    unused = torch.ones(12, dtype=torch.bool)
    unused[[7, 2, 9, 4]] = False
    pool_k[unused], pool_v[unused] = float("nan"), float("nan")
    got = rd.ragged_pooled(
        q, own, own_v, slots, [starts[s] for s in slots], ends, pool_k, pool_v, tables, lengths, 0.2
    )
    copy_ends = [e + width - 9 for e in ends]
    want = rd.ragged_packed(q, k, v, slots, [copy_starts[s] for s in slots], copy_ends, 0.2)
    assert torch.equal(got, want)


def test_pooled_refuses_tables_outside_the_pool():
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 2, 3, 8)
    pool = torch.zeros(4, 4, 2, 8)
    args = (q, k, k, [0], [0], [3], pool, pool)
    with pytest.raises(ValueError, match="outside the pool"):
        rd.ragged_pooled(*args, [[1, 4]], [5], 1.0)
    with pytest.raises(ValueError, match="within the tables"):
        rd.ragged_pooled(*args, [[1]], [5], 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        rd.ragged_pooled(
            q, k, k, [0], [0], [3], torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8), [[1]], [2], 1.0
        )
    with pytest.raises(ValueError, match="tables"):
        rd.ragged_pooled(*args, [[1], [2]], [2, 2], 1.0)
