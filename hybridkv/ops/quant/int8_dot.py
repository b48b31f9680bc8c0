"""llama.cpp's decode scheme for the 32-weight types — Q8_0, and Q5_0, Q4_0, IQ4_NL (the fallbacks
llama.cpp writes for rows that are not a multiple of 256), whose vec_dot type is Q8_0, and Q4_1, Q5_1
(blocks with a min, vec_dot type Q8_1): integer dot products on 8-bit activation blocks.

Each activation row is quantized once into blocks of 32 (`quantize_rows_q8`); a weight block and
an activation block then meet as one exact integer dot product (the block sum), scaled by one float
multiply, d_w·d_x. A block with a min m (weight = d·code + m) adds m·(d_x·Σq_x), each activation
block's code sum being what llama.cpp's Q8_1 blocks carry. Here is the readable PyTorch twin — the
NumPy-emulation-style reference that the C++ kernel (`csrc/quant.cpp`) matches: the same activation
blocks bit for bit, the same integer block sums exactly, and the float result up to summation order.

Shapes: x [T, K] float32 (K = in features, a multiple of 32); W rows uint8 [N, K/32·bytes] (N =
out features), each a run of blocks (f16 d, then the codes: Q8_0 i8 q[32]; Q4_0 nibbles − 8; Q5_0
five bits − 16; IQ4_NL a level per nibble; Q4_1 and Q5_1 unsigned, after d and m;
`blocks.block_codes`); nb = K/32 blocks per row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from hybridkv.ops import native
from hybridkv.ops.quant import blocks

QK8 = 32
Q8_0 = 8  # ggml type id
# Up to this many activation rows the integer kernel streams the weight once (decode).
FEW_ROWS = 32
ISAS = ("vnni", "avx2", "scalar")  # the C++ kernel's code paths, fastest first


class Q8Rows(NamedTuple):
    """Rows in 8-bit blocks: q int8 [T, K], d float32 [T, nb]; x ≈ d·q per block (+ m [T, nb] for
    weights of a type with a min)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None


def quantize_rows_q8(x: torch.Tensor) -> Q8Rows:
    """x [T, K] → 8-bit blocks of 32: d = max|x|/127 and q = round(x·(1/d)), ties to even (0 where
    d = 0). As llama.cpp's `quantize_row_q8_0`, except that d stays float32 (it is never stored)."""
    T, K = x.shape
    blocks = x.float().reshape(T, K // QK8, QK8)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    return Q8Rows(q.reshape(T, K), d)


def split_rows(rows: torch.Tensor, ggml_id: int = Q8_0) -> Q8Rows:
    """Weight rows uint8 [N, nb·bytes] of a 32-weight type → codes int8 [N, K], d float32 [N, nb]
    (and m float32 [N, nb] for Q4_1, Q5_1)."""
    from hybridkv.ops.quant.traits import block_type  # (traits imports this module)

    N = rows.shape[0]
    q, d, m = blocks.block_codes(rows.reshape(-1, block_type(ggml_id).block_bytes), ggml_id)
    return Q8Rows(q.reshape(N, -1), d.reshape(N, -1), None if m is None else m.reshape(N, -1))


def block_sums(x: Q8Rows, w: Q8Rows) -> torch.Tensor:
    """Σ q_x·q_w over each pair of blocks → int32 [T, N, nb], exactly: every partial sum is an
    integer below 32·128·127 < 2^24, which float32 holds in any summation order."""
    T, K = x.q.shape
    N = w.q.shape[0]
    xq = x.q.float().reshape(T, -1, QK8).transpose(0, 1)  # [nb, T, 32]
    wq = w.q.float().reshape(N, -1, QK8).permute(1, 2, 0)  # [nb, 32, N]
    return torch.bmm(xq, wq).permute(1, 2, 0).to(torch.int32)


def q8_matmul_twin(x: torch.Tensor, rows: torch.Tensor, ggml_id: int = Q8_0) -> torch.Tensor:
    """x [T, K] @ W.T → [T, N] float32: Σ over blocks of block_sum·(d_w·d_x), the integer path's
    reference (runs N in chunks, so the [T, N, nb] sums stay small)."""
    xq = quantize_rows_q8(x)
    T, N = x.shape[0], rows.shape[0]
    sx = xq.q.float().reshape(T, -1, QK8).sum(-1) * xq.d  # d_x·Σq_x [T, nb]: exact integer sums
    step = max(1, (1 << 20) // max(1, xq.d.numel()))
    out = []
    for n in range(0, N, step):
        w = split_rows(rows[n : n + step], ggml_id)
        scale = w.d[None, :, :] * xq.d[:, None, :]  # [T, n, nb]
        y = block_sums(xq, w).float() * scale
        if w.m is not None:
            y += w.m[None, :, :] * sx[:, None, :]
        out.append(y.sum(-1))
    return torch.cat(out, dim=1) if out else torch.zeros(x.shape[0], 0)


def _ops() -> Any:
    ops = native.kernels()
    assert ops is not None, "check native.enabled() first"
    return ops


def available_isas() -> tuple[str, ...]:
    """The C++ kernel's code paths this machine runs ('vnni' needs AVX-512 VNNI or AVX-VNNI, 'avx2'
    AVX2; 'scalar' always), fastest first; () without the kernels."""
    ops = native.kernels()
    return tuple(ops.q8_isas()) if ops is not None else ()


def native_quantize_rows_q8(x: torch.Tensor) -> Q8Rows:
    """`quantize_rows_q8` by the C++ kernel (bit-identical)."""
    q, d = _ops().quantize_rows_q8(x)
    return Q8Rows(q, d)


def native_block_sums(x: Q8Rows, rows: torch.Tensor, ggml_id: int = Q8_0, isa: str = "auto") -> torch.Tensor:
    """`block_sums(x, split_rows(rows, ggml_id))` by the C++ kernel's integer dot (the one
    `native_q8_matmul` runs), on code path `isa` ('auto': the fastest here)."""
    return _ops().q8_block_sums(x.q, rows, ggml_id, isa)


def native_q8_matmul(x: torch.Tensor, rows: torch.Tensor, ggml_id: int = Q8_0, isa: str = "auto") -> torch.Tensor:
    """`q8_matmul_twin` by the C++ kernel: each row of x quantized once, the weight streamed once."""
    return _ops().q8_matmul(x, rows, ggml_id, isa)


def native_q8_dequantize_rows(rows: torch.Tensor, ids: torch.Tensor, ggml_id: int) -> torch.Tensor:
    """Rows `ids` of 32-weight-type rows [V, nb·block_bytes] as float32 [len(ids), nb·32] (an
    embedding lookup on a file's blocks): bit-identical to `blocks.dequantize` of those rows."""
    return _ops().q8_dequantize_rows(rows, ids, ggml_id)


MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def kernel_or_twin(kernel: Callable[..., torch.Tensor], twin: Callable[..., torch.Tensor], ggml_id: int) -> MatmulFn:
    """A traits-table product for type `ggml_id`: x [T, K] float32 @ W.T → [T, N] float32 by the C++
    `kernel`, else (kernels off or unbuilt) its PyTorch `twin`, the same numbers up to summation order."""

    def matmul(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return kernel(x, rows, ggml_id) if native.enabled(x, rows) else twin(x, rows, ggml_id)

    return matmul


def q8_matmul(ggml_id: int) -> MatmulFn:
    """The traits table's product for a 32-weight type (Q8_0, Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1)."""
    return kernel_or_twin(native_q8_matmul, q8_matmul_twin, ggml_id)


def native_q8_experts_matmul(
    x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, ggml_id: int = Q8_0, isa: str = "auto"
) -> torch.Tensor:
    """Row p·T/P of x [T, K] times expert ids[p]'s rows (rows [E, N, nb·bytes]) → [P, N] float32
    (P = len(ids), a multiple of T: each row quantized once for its P/T pairs): the products
    `native_q8_matmul` computes, every (token, expert) pair of a MoE step in one call."""
    return _ops().q8_experts_matmul(x, rows, ids, ggml_id, isa)
