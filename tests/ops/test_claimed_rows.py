"""The decode-time products split their weight rows into chunks the threads claim (`claimed_for` in
`csrc/parallel.h`): every row is computed once, by whichever thread, so a product is bit for bit
the same at any thread count. The shapes make 5 to 128 chunks: two or more in each share at 2
threads."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from op_checks import threads
from test_quant import random_rows
from test_quant_k import KERNEL_TYPES, activations, file_type, kernel_rows

from hybridkv.ops import native
from hybridkv.ops.quant import GGMLType, block_type, int8_dot, k_dot

pytestmark = pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")

Q8_TYPES = [GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q4_1, GGMLType.IQ4_NL]


def _each_thread_count(product: Callable[[], torch.Tensor]) -> None:
    """product() at 1 thread, then at 2 and 3: the same bits."""
    with threads(1):
        want = product()
    for n in (2, 3):
        with threads(n):
            got = product()
        assert torch.equal(got, want), f"{n} threads: {int((got != want).sum())} values differ"
    assert want.abs().sum() > 0  # rows were computed, not left as allocated


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 3])
def test_k_quant_rows_at_any_thread_count(t: GGMLType, T: int) -> None:
    rows = kernel_rows(t, random_rows(block_type(file_type(t)), (1003,), 256, seed=1))
    x = activations(T, 256, seed=2)
    _each_thread_count(lambda: k_dot.native_k_matmul(x, rows, int(t)))


@pytest.mark.parametrize("t", Q8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 3])
def test_32_weight_rows_at_any_thread_count(t: GGMLType, T: int) -> None:
    rows = torch.from_numpy(random_rows(block_type(t), (1003,), 256, seed=3))
    x = activations(T, 256, seed=4)
    _each_thread_count(lambda: int8_dot.native_q8_matmul(x, rows, int(t)))


@pytest.mark.parametrize("t", [GGMLType.Q4_K_R, GGMLType.Q6_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_expert_rows_at_any_thread_count(t: GGMLType) -> None:
    """Three experts of 400 rows, one token each: the pairs' rows claimed across experts."""
    rows = np.stack([random_rows(block_type(file_type(t)), (400,), 256, seed=e) for e in range(3)])
    ids, x = torch.tensor([2, 0, 1]), activations(3, 256, seed=5)
    if t == GGMLType.Q8_0:
        _each_thread_count(lambda: int8_dot.native_q8_experts_matmul(x, torch.from_numpy(rows), ids, int(t)))
    else:
        _each_thread_count(lambda: k_dot.native_k_experts_matmul(x, kernel_rows(t, rows), ids, int(t)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_rows_at_any_thread_count(dtype: torch.dtype) -> None:
    """A weight stored [out, in] read row after row (the head), and [in, out] read by column
    chunks at a few rows (a weight under the size the depth split takes)."""
    gen = torch.Generator().manual_seed(6)
    w_t = torch.randn(4099, 64, generator=gen).to(dtype)
    w = torch.randn(64, 8195, generator=gen).to(dtype)
    x1, x3 = torch.randn(1, 64, generator=gen), torch.randn(3, 64, generator=gen)
    _each_thread_count(lambda: native.rows_matmul_t(x1, w_t))
    _each_thread_count(lambda: native.rows_matmul(x3, w))
