"""llama.cpp's decode scheme for the K-quants (Q2_K to Q6_K): integer dots on Q8_K activations.

Each activation row is quantized once into Q8_K super-blocks of 256 (`quantize_rows_q8_k`): f32 d,
i8 q[256] and the sums of each 16 q (bsums). A weight super-block (d, dmin, 6-bit per-sub-block
scales sc_j and mins m_j, unsigned codes q) meets one as two exact integers,

    S = Σ_j sc_j·(q·x)_j        M = Σ_j m_j·bsum_j        (x: the activation's int8 q)

and the float result is Σ over super-blocks of (d_w·d_x)·S − (dmin_w·d_x)·M: no per-weight float
work. Q6_K has no min: its codes are q − 32, which llama.cpp writes as the unsigned q with
m_j = 32·sc_j in units of d, so its super-block counts (d_w·d_x)·(S − M); Q3_K likewise with q − 4
and m_j = 4·sc_j (its scales signed). Q2_K has 16 sub-blocks of 16 with a 4-bit scale and min
each. This is the readable twin that the C++ kernel (`csrc/kquant.cpp`) matches: the same
activation blocks bit for bit, the same integers S and M exactly, the float result up to
summation order.

Shapes: x [T, K] float32 (K a multiple of 256, nb = K/256); W rows uint8 [N, nb·block_bytes].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from hybridkv.ops import native
from hybridkv.ops.quant import blocks
from hybridkv.ops.quant.int8_dot import MatmulFn, kernel_or_twin

QK_K = 256
ISAS = ("avx2", "scalar")  # the C++ kernel's code paths, fastest first


class KType(NamedTuple):
    """One K-quant as the integer dot sees it: its ggml id, bytes per super-block, sub-blocks."""

    ggml_id: int
    block_bytes: int
    n_sub: int  # sub-blocks per super-block, each of 256/n_sub weights


# Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, and Q4_K repacked or tiled at load (`blocks.repack_q4_k`,
# `blocks.tile_q4_k`; hybridkv's ids, not ggml's), and Q6_K tiled (`blocks.tile_q6_k`)
K_TYPES = {
    10: KType(10, 84, 16),
    11: KType(11, 110, 16),
    12: KType(12, 144, 8),
    13: KType(13, 176, 8),
    14: KType(14, 210, 16),
    1012: KType(1012, 144, 8),
    1013: KType(1013, 144, 8),
    1014: KType(1014, 210, 16),
}
Q4_K_R = 1012
Q4_K_T = 1013
Q6_K_T = 1014


def untiled(rows: torch.Tensor, ggml_id: int) -> tuple[torch.Tensor, int]:
    """Rows of a type tiled at load (Q4_K_T, Q6_K_T: whole tiles of 16 rows, [..., 16·n, ·]) as
    the file's rows and type (a copy); any other type's rows as they are."""
    if ggml_id == Q4_K_T:
        return blocks.untile_q4_k(rows), 12
    if ggml_id == Q6_K_T:
        return blocks.untile_q6_k(rows), 14
    return rows, ggml_id


class Q8KRows(NamedTuple):
    """Activation rows in Q8_K blocks: q int8 [T, K], d float32 [T, nb], bsums int16 [T, K/16];
    x ≈ d·q per super-block."""

    q: torch.Tensor
    d: torch.Tensor
    bsums: torch.Tensor


class KRows(NamedTuple):
    """K-quant weight rows unpacked: q uint8 [N, nb, n_sub, 256/n_sub] (unsigned codes), scales and
    mins int32 [N, nb, n_sub], d float32 [N, nb], dmin float32 [N, nb] or None (Q6_K: mins are
    32·sc in units of d; Q3_K: 4·sc)."""

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor | None


def quantize_rows_q8_k(x: torch.Tensor) -> Q8KRows:
    """x [T, K] → Q8_K super-blocks as llama.cpp's `quantize_row_q8_K_ref`: max = the first element
    of largest |x|, iscale = −127/max, q = min(127, round(iscale·x)) ties to even, d = 1/iscale
    (so the largest element becomes −127 and d takes the opposite sign of max); all zero where
    max = 0."""
    T, K = x.shape
    sb = x.float().reshape(T, K // QK_K, QK_K)
    at = sb.abs().argmax(-1, keepdim=True)  # the first maximum, as the reference's strict `>`
    peak = sb.gather(-1, at)
    # Tensor / tensor: a scalar numerator would run as reciprocal-then-multiply, rounding twice.
    iscale = torch.where(peak == 0, 0.0, torch.full_like(peak, -127.0) / peak)
    q = torch.round(sb * iscale).clamp_(max=127).to(torch.int8)
    d = torch.where(iscale == 0, 0.0, torch.ones_like(iscale) / iscale).squeeze(-1)
    bsums = q.view(T, -1, 16).sum(-1, dtype=torch.int16)
    return Q8KRows(q.view(T, K), d, bsums)


def split_k(rows: torch.Tensor, ggml_id: int) -> KRows:
    """K-quant rows uint8 [N, nb·block_bytes] → their codes, scales, mins and d's."""
    if ggml_id == Q4_K_R:
        rows, ggml_id = blocks.unrepack_q4_k(rows), 12
    rows, ggml_id = untiled(rows, ggml_id)
    kt = K_TYPES[ggml_id]
    N = rows.shape[0]
    b = rows.reshape(-1, kt.block_bytes)
    nb = b.shape[0] // max(N, 1)

    def f16(at: int) -> torch.Tensor:
        return b[:, at : at + 2].contiguous().view(torch.float16).float().view(N, nb)

    if ggml_id == 14:
        q = blocks.q6_k_codes(b)
        scales = b[:, 192:208].contiguous().view(torch.int8).int()
        return KRows(q.view(N, nb, 16, 16), scales.view(N, nb, 16), 32 * scales.view(N, nb, 16), f16(208), None)
    if ggml_id == 11:  # codes q − 4 as Q6_K's q − 32: mins 4·sc in units of d
        scales = blocks.q3_k_scales(b).view(N, nb, 16)
        return KRows(blocks.q3_k_codes(b).view(N, nb, 16, 16), scales, 4 * scales, f16(108), None)
    if ggml_id == 10:
        sc = b[:, :16].int()
        return KRows(
            blocks.q2_k_codes(b).view(N, nb, 16, 16),
            (sc & 15).view(N, nb, 16),
            (sc >> 4).view(N, nb, 16),
            f16(80),
            f16(82),
        )
    q = blocks.q4_k_codes(b) if ggml_id == 12 else blocks.q5_k_codes(b)
    sc, mn = blocks.k_scales(b[:, 4:16])
    return KRows(q.view(N, nb, 8, 32), sc.int().view(N, nb, 8), mn.int().view(N, nb, 8), f16(0), f16(2))


def sub_block_sums(x: Q8KRows, w: KRows) -> torch.Tensor:
    """(q·x)_j: each weight sub-block's codes dotted with its activations → int32 [T, N, nb, n_sub],
    exactly: every partial sum is an integer below 32·63·128 < 2^24, which float32 holds."""
    T = x.q.shape[0]
    N, nb, n_sub, sub = w.q.shape
    xq = x.q.float().view(T, nb * n_sub, sub).transpose(0, 1)  # [nb·n_sub, T, sub]
    wq = w.q.float().view(N, nb * n_sub, sub).permute(1, 2, 0)  # [nb·n_sub, sub, N]
    return torch.bmm(xq, wq).view(nb, n_sub, T, N).permute(2, 3, 0, 1).to(torch.int32)


def superblock_sums(x: Q8KRows, w: KRows) -> torch.Tensor:
    """The two integers of each super-block pair, (S, M) → int32 [T, N, nb, 2]: S = Σ_j sc_j·(q·x)_j,
    M = Σ_j m_j·(the sum of sub-block j's activations, from bsums)."""
    T = x.q.shape[0]
    N, nb, n_sub, _ = w.q.shape
    x_sums = x.bsums.view(T, nb, n_sub, -1).sum(-1, dtype=torch.int32)  # Q4_K/Q5_K: pairs of 16
    S = (sub_block_sums(x, w) * w.scales).sum(-1, dtype=torch.int32)
    M = (x_sums[:, None] * w.mins).sum(-1, dtype=torch.int32)
    return torch.stack([S, M], dim=-1)


def k_matmul_twin(x: torch.Tensor, rows: torch.Tensor, ggml_id: int) -> torch.Tensor:
    """x [T, K] @ W.T → [T, N] float32 for K-quant rows: Σ over super-blocks of (d_w·d_x)·S −
    (dmin_w·d_x)·M (Q3_K, Q6_K: (d_w·d_x)·(S − M)), in chunks of N so the integer sums stay small."""
    xq = quantize_rows_q8_k(x)
    T, N = x.shape[0], rows.shape[0]
    step = max(1, (1 << 20) // max(1, T * xq.d.shape[1] * K_TYPES[ggml_id].n_sub))
    out = []
    for n in range(0, N, step):
        w = split_k(rows[n : n + step], ggml_id)
        S, M = superblock_sums(xq, w).unbind(-1)
        dd = w.d[None] * xq.d[:, None]  # [T, n, nb], one float32 product per super-block pair
        if w.dmin is None:
            out.append((dd * (S - M).float()).sum(-1))
        else:
            out.append((dd * S.float() - (w.dmin[None] * xq.d[:, None]) * M.float()).sum(-1))
    return torch.cat(out, dim=1) if out else torch.zeros(T, 0)


def _ops() -> Any:
    ops = native.kernels()
    assert ops is not None, "check native.enabled() first"
    return ops


def available_isas() -> tuple[str, ...]:
    """The C++ kernel's code paths this machine runs ('avx2' needs AVX2; 'scalar' always), fastest
    first; () without the kernels."""
    ops = native.kernels()
    return tuple(ops.kq_isas()) if ops is not None else ()


def native_quantize_rows_q8_k(x: torch.Tensor) -> Q8KRows:
    """`quantize_rows_q8_k` by the C++ kernel (bit-identical)."""
    return Q8KRows(*_ops().quantize_rows_q8_k(x))


def native_superblock_sums(x: Q8KRows, rows: torch.Tensor, ggml_id: int, isa: str = "auto") -> torch.Tensor:
    """`superblock_sums(x, split_k(rows, ggml_id))` by the C++ kernel's integer dot (the one
    `native_k_matmul` runs), on code path `isa` ('auto': the fastest here)."""
    return _ops().kq_superblock_sums(x.q, x.bsums, rows, ggml_id, isa)


def native_k_matmul(x: torch.Tensor, rows: torch.Tensor, ggml_id: int, isa: str = "auto") -> torch.Tensor:
    """`k_matmul_twin` by the C++ kernel: each row of x quantized once, the weight streamed once."""
    return _ops().kq_matmul(x, rows, ggml_id, isa)


def native_k_matmul_parts(
    x: torch.Tensor, parts: Sequence[torch.Tensor], ggml_ids: Sequence[int], isa: str = "auto"
) -> torch.Tensor:
    """x @ [W_0 | W_1 | ...]ᵀ → [T, ΣN_i] float32 for K-quant row blocks `parts` of types `ggml_ids`
    (a projection stored in parts of different types): `native_k_matmul` of each, concatenated,
    in one call with x quantized once."""
    return _ops().kq_matmul_parts(x, list(parts), list(ggml_ids), isa)


def native_k_dequantize_rows(rows: torch.Tensor, ids: torch.Tensor, ggml_id: int) -> torch.Tensor:
    """Rows `ids` of K-quant rows [V, nb·block_bytes] as float32 [len(ids), nb·256] (an embedding
    lookup on a file's blocks): bit-identical to `blocks.dequantize` of those rows, in one call."""
    return _ops().kq_dequantize_rows(rows, ids, ggml_id)


def k_matmul(ggml_id: int) -> MatmulFn:
    """The traits table's product for a K-quant (Q2_K to Q6_K)."""
    return kernel_or_twin(native_k_matmul, k_matmul_twin, ggml_id)


def native_repack_q4_k(rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`blocks.repack_q4_k` (or `unrepack_q4_k`, inverse) by the C++ kernel: the same bytes, ~10x faster."""
    return _ops().kq_repack_q4_k(rows, inverse)


def native_tile_q4_k(rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`blocks.tile_q4_k` (or `untile_q4_k`, inverse) by the C++ kernel: the same bytes."""
    return _ops().kq_tile_q4_k(rows, inverse)


def native_tile_q6_k(rows: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`blocks.tile_q6_k` (or `untile_q6_k`, inverse) by the C++ kernel: the same bytes."""
    return _ops().kq_tile_q6_k(rows, inverse)


def native_tiles_q4_k() -> bool:
    """Whether the C++ kernels have the 16-lane products on tiled Q4_K and Q6_K (AVX-512 VNNI and
    VBMI)."""
    return bool(_ops().kq_tiled())


def native_stream_ahead(on: bool | None = None) -> bool:
    """Whether decode's products fetch their weights ahead in software (`ops.quant.stream`: the
    tiled K-quants at up to 8 activation rows, the 32-weight types at one); `on` sets it. Returns
    the value before."""
    return bool(_ops().kq_stream_ahead(-1 if on is None else int(on)))


def native_amx(on: bool | None = None) -> bool:
    """Whether the tiled K-quant products of 16 or more activation rows run on AMX's tile
    instructions (a CPU with AMX-INT8, Linux, and a build for it; the same numbers as without);
    `on` sets it (on where AMX cannot run leaves it off). Returns the value before."""
    return bool(_ops().kq_amx(-1 if on is None else int(on)))


def native_k_experts_matmul(
    x: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, ggml_id: int, isa: str = "auto"
) -> torch.Tensor:
    """Row p·T/P of x [T, K] times expert ids[p]'s K-quant rows (rows [E, N, nb·block_bytes]) →
    [P, N] float32 (P = len(ids), a multiple of T: each row quantized once for its P/T pairs): the
    products `native_k_matmul` computes, every (token, expert) pair in one call."""
    return _ops().kq_experts_matmul(x, rows, ids, ggml_id, isa)
