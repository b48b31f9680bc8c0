"""Paged attention agrees with the per-query loop and with dense causal attention on unpaged K/V."""

from __future__ import annotations

import pytest
import torch
from op_checks import assert_close

from hybridkv.ops.attention import paged_attention
from hybridkv.ops.naive import naive_paged_attention


def paged_batch(q_lens, kv_lens, H, Hkv, hd, block_size, num_blocks=40, seed=0, dtype=torch.float32):
    """A pool whose unused blocks and rows are NaN, sequences scattered over random blocks, and
    garbage in block-table slots past each sequence's last block."""
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.full((num_blocks, block_size, Hkv, hd), float("nan"), dtype=dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    max_blocks = max(-(-n // block_size) for n in kv_lens) + 1
    block_tables = torch.full((len(kv_lens), max_blocks), 10**6, dtype=torch.long)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    dense_k, dense_v = [], []
    for n, kv_len in enumerate(kv_lens):
        k = torch.randn(kv_len, Hkv, hd, generator=gen).to(dtype)
        v = torch.randn(kv_len, Hkv, hd, generator=gen).to(dtype)
        for b in range(-(-kv_len // block_size)):
            block_tables[n, b] = blk = free.pop()
            rows = slice(b * block_size, min((b + 1) * block_size, kv_len))
            k_pool[blk, : rows.stop - rows.start] = k[rows]
            v_pool[blk, : rows.stop - rows.start] = v[rows]
        dense_k.append(k)
        dense_v.append(v)
    q = torch.randn(sum(q_lens), H, hd, generator=gen).to(dtype)
    cu = torch.tensor([0, *q_lens]).cumsum(0)
    return q, k_pool, v_pool, block_tables, cu, torch.tensor(kv_lens), dense_k, dense_v


CASES = [
    # q_lens, kv_lens: decode batch, fresh prefill, prefill after a cached prefix, mixed
    ([1, 1, 1], [1, 9, 17]),
    ([5], [5]),
    ([4, 7], [11, 7]),
    ([2, 1, 6], [20, 13, 6]),
]


@pytest.mark.parametrize("q_lens, kv_lens", CASES)
@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_naive(q_lens, kv_lens, H, Hkv, block_size):
    hd = 8
    q, k_pool, v_pool, tables, cu, kv, _, _ = paged_batch(q_lens, kv_lens, H, Hkv, hd, block_size)
    out = paged_attention(q, k_pool, v_pool, tables, cu, kv, hd**-0.5)
    assert torch.isfinite(out).all(), "read a block or row it does not own"
    assert_close(out, naive_paged_attention(q, k_pool, v_pool, tables, cu, kv, hd**-0.5), dtype=None)


@pytest.mark.parametrize("q_lens, kv_lens", CASES)
def test_matches_dense_causal_attention(q_lens, kv_lens):
    """Independent of paging: softmax(q kᵀ · scale + causal-with-offset mask) v on each sequence's own K/V."""
    H, Hkv, hd = 6, 2, 16
    q, k_pool, v_pool, tables, cu, kv, dense_k, dense_v = paged_batch(q_lens, kv_lens, H, Hkv, hd, 4, seed=1)
    out = paged_attention(q, k_pool, v_pool, tables, cu, kv, 0.3)
    for n, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        k = dense_k[n].repeat_interleave(H // Hkv, dim=1)  # [kv_len, H, hd]
        v = dense_v[n].repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[cu[n] : cu[n + 1]], k) * 0.3
        visible = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        assert_close(out[cu[n] : cu[n + 1]], torch.einsum("hqk,khd->qhd", probs, v), dtype=None)


@pytest.mark.parametrize("q_lens, kv_lens", [([1, 1], [3, 10]), ([3, 2], [8, 2])])
def test_low_precision_returns_q_dtype(q_lens, kv_lens):
    q, k_pool, v_pool, tables, cu, kv, _, _ = paged_batch(q_lens, kv_lens, 4, 2, 8, 4, dtype=torch.bfloat16)
    out = paged_attention(q, k_pool, v_pool, tables, cu, kv, 8**-0.5)
    assert out.dtype == torch.bfloat16
    # both round a float32 result to bf16 once
    assert_close(out, naive_paged_attention(q, k_pool, v_pool, tables, cu, kv, 8**-0.5), rel=1e-2, dtype=None)
