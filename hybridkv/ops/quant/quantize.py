"""Float weights into GGUF blocks, as llama.cpp's reference quantizers write them.

Q8_0 (`quantize_row_q8_0_ref` in ggml-quants.c): per block of 32, d = max|x| / 127 in float32,
q = roundf(x · (1/d)) (halves away from zero; 0 where d = 0), d stored as float16. Bit-identical
to llama.cpp's and gguf-py's (`gguf.quants.quantize`) blocks; so are Q5_0 and Q5_1 (the fallbacks
`hybridkv quantize` writes for rows that K-quant blocks do not fit).

Q4_K, Q5_K and Q6_K follow `quantize_row_q4_K_ref` / `_q5_K_ref` / `_q6_K_ref` (what `llama-quantize`
runs without an importance matrix), vectorized over sub-blocks: Q6_K picks each 16-weight
sub-block's scale by `make_qx_quants` (the best of 19 trial scales by weighted least squares,
weights x²), Q4_K and Q5_K each 32-weight sub-block's scale and min by `make_qkx2_quants` (21
and 16 trial scales, weights rms(x) + |x|); all then quantize the sub-block scales against the super-block's
largest (to 8 and 6 bits) and the weights against the rounded scales. The sums here are added
pairwise, not in the C loop's order, so a near-tie between two trial scales can resolve the other
way: the blocks are valid and as accurate, not always byte-identical to llama.cpp's. They are
byte-identical on every CPU: a fixed order of IEEE operations, square roots correctly rounded. A sub-block
whose rounded scale is 0 gets codes for 0 (llama.cpp leaves its trial codes; both dequantize
the same).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hybridkv.ops.quant.traits import GGMLType

QUANTIZE_TYPES = {"q8_0": GGMLType.Q8_0, "q4_k": GGMLType.Q4_K, "q6_k": GGMLType.Q6_K}
_ROWS_AT_ONCE = 4096  # rows quantized at once: bounds the temporaries
_WEIGHTS_AT_ONCE = 1 << 18  # K-quants: weights quantized at once (their trial loops keep a few copies)
_BLOCK_ELEMS = {
    GGMLType.Q8_0: 32,
    GGMLType.Q5_0: 32,
    GGMLType.Q5_1: 32,
    GGMLType.Q4_K: 256,
    GGMLType.Q5_K: 256,
    GGMLType.Q6_K: 256,
}
GROUP_MAX_EPS = 1e-15


def quantize_q8_0(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] (K a multiple of 32) → Q8_0 rows uint8 [..., K/32·34]."""
    K = w.shape[-1]
    if K % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 weights, got {K}")
    flat = w.reshape(-1, K)
    out = torch.empty(flat.shape[0], K // 32, 34, dtype=torch.uint8)
    for r in range(0, flat.shape[0], _ROWS_AT_ONCE):
        x = flat[r : r + _ROWS_AT_ONCE].float().reshape(-1, K // 32, 32)
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, torch.ones_like(d) / d)
        scaled = x * inv
        q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # roundf: halves away from zero
        out[r : r + _ROWS_AT_ONCE, :, :2] = d.half().view(torch.uint8).reshape(-1, K // 32, 2)
        out[r : r + _ROWS_AT_ONCE, :, 2:] = q.to(torch.int8).view(torch.uint8)
    return out.reshape(*w.shape[:-1], K // 32 * 34)


def _five_bit_blocks(
    w: torch.Tensor, name: str, header: int, codes: Callable[[torch.Tensor], tuple[list[torch.Tensor], torch.Tensor]]
) -> torch.Tensor:
    """Q5_0 / Q5_1 rows: per block of 32, `codes(x [N, B, 32])` gives the float16 header values and
    the 5-bit codes q [N, B, 32]; stored as the header, qh (bit j: element j's fifth bit) and the
    low nibbles (element j and j + 16 share byte j)."""
    K = w.shape[-1]
    if K % 32:
        raise ValueError(f"{name} needs rows of a multiple of 32 weights, got {K}")
    flat = w.reshape(-1, K)
    size = header + 20
    out = torch.empty(flat.shape[0], K // 32, size, dtype=torch.uint8)
    bit = torch.arange(32, dtype=torch.int64)
    for r in range(0, flat.shape[0], _ROWS_AT_ONCE):
        x = flat[r : r + _ROWS_AT_ONCE].float().reshape(-1, K // 32, 32)
        values, q = codes(x)
        n = x.shape[0]
        out[r : r + n, :, :header] = torch.cat([v.half().view(torch.uint8) for v in values], -1)
        qh = (((q >> 4) & 1) << bit).sum(-1)
        out[r : r + n, :, header : header + 4] = torch.stack([(qh >> (8 * i)) & 0xFF for i in range(4)], -1).to(
            torch.uint8
        )
        out[r : r + n, :, header + 4 :] = ((q[..., :16] & 0xF) | ((q[..., 16:] & 0xF) << 4)).to(torch.uint8)
    return out.reshape(*w.shape[:-1], K // 32 * size)


def quantize_q5_0(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] (K a multiple of 32) → Q5_0 rows uint8 [..., K/32·22], as `quantize_row_q5_0_ref`:
    d = (the first element of largest |x|) / −16, q = min(31, trunc(x/d + 16.5)). llama.cpp's
    fallback for Q4_K rows that are not 256 wide."""

    def codes(x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        d = x.gather(-1, x.abs().argmax(-1, keepdim=True)) / -16
        inv = torch.where(d == 0, 0.0, torch.ones_like(d) / d)
        return [d], (x * inv + 16.5).to(torch.int8).clamp(max=31).to(torch.int64)  # the C cast truncates

    return _five_bit_blocks(w, "Q5_0", 2, codes)


def quantize_q5_1(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] (K a multiple of 32) → Q5_1 rows uint8 [..., K/32·24], as `quantize_row_q5_1_ref`:
    d = (max − min) / 31, m = min, q = trunc((x − min)/d + 0.5). llama.cpp's fallback for Q5_K."""

    def codes(x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 31
        inv = torch.where(d == 0, 0.0, torch.ones_like(d) / d)
        return [d, lo], ((x - lo) * inv + 0.5).to(torch.uint8).to(torch.int64)

    return _five_bit_blocks(w, "Q5_1", 4, codes)


def _nearest(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's `nearest_int`: round to nearest, ties to even (its float trick), as int32."""
    return torch.round(x).to(torch.int32)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.half().float()


def _sum(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a power of two) → [..., 1]: halves added pairwise, the same IEEE additions in
    the same order on every CPU."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, n
    while n > 1:
        n //= 2
        x = x[..., :n] + x[..., n:]
    return x


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square roots, as C's sqrtf: NumPy's come from the CPU's instruction, while
    `torch.sqrt` may go through MKL's vector library, which on some CPUs is off by an ulp for ~15%
    of inputs (measured on Zen 4) and so changed a few Q4_K blocks between machines."""
    return torch.from_numpy(np.sqrt(x.contiguous().numpy()))


def _qx_scale(x: torch.Tensor, nmax: int) -> torch.Tensor:
    """`make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)`'s scale for each row of x [S, n]."""
    at = x.abs().argmax(-1, keepdim=True)
    peak = x.gather(-1, at)  # the first element of largest |x|, with its sign
    zero = x.abs().amax(-1, keepdim=True) < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    w = x * x

    def trial(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = _nearest(iscale * x).clamp(-nmax, nmax - 1).float()
        return _sum(w * x * q), _sum(w * q * q)

    sumlx, suml2 = trial(-nmax / peak)
    scale = torch.where(suml2 > 0, sumlx / suml2.clamp_min(1e-30), torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        lx, l2 = trial(-(nmax + 0.1 * step) / peak)
        better = (l2 > 0) & (lx * lx > best * l2)
        scale = torch.where(better, lx / l2.clamp_min(1e-30), scale)
        best = torch.where(better, scale * lx, best)
    return torch.where(zero, torch.zeros_like(scale), scale).squeeze(-1)


def _qkx2_scale_min(
    x: torch.Tensor, nmax: int, rmin: float = -1.0, nstep: int = 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """`make_qkx2_quants(n, nmax, x, weights, ..., rmin, rdelta=0.1, nstep, use_mad=false)` with
    Q4_K's and Q5_K's weights rms(x) + |x|, for each row of x [S, n] → (scale, −min) [S]."""
    w = _sqrt(_sum(x * x) / x.shape[-1]) + x.abs()
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    hi = x.amax(-1, keepdim=True)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    sum_w, sum_x = _sum(w), _sum(w * x)

    def codes(iscale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        return _nearest(iscale * (x - minimum)).clamp(0, nmax).float()

    def error(scale: torch.Tensor, minimum: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        diff = scale * q + minimum - x
        return _sum(w * diff * diff)

    iscale = nmax / span
    scale, minimum = 1 / iscale, lo
    best = error(scale, minimum, codes(iscale, minimum))
    for step in range(nstep + 1):
        # as the C loop: each trial starts from the best min so far (it moves when a trial wins)
        width = hi - minimum
        q = codes((rmin + 0.1 * step + nmax) / torch.where(width > 0, width, torch.ones_like(width)), minimum)
        sum_l, sum_l2, sum_xl = _sum(w * q), _sum(w * q * q), _sum(w * q * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = torch.where(ok, D, torch.ones_like(D))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        positive = this_min > 0
        this_scale = torch.where(positive, sum_xl / sum_l2.clamp_min(1e-30), this_scale)
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        cur = error(this_scale, this_min, q)
        better = ok & (cur < best)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        minimum = torch.where(better, this_min, minimum)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale.squeeze(-1), (-minimum).squeeze(-1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    """x [B, 256] → Q6_K blocks uint8 [B, 210]."""
    B = x.shape[0]
    scales = _qx_scale(x.reshape(B * 16, 16), 32).view(B, 16)
    at = scales.abs().argmax(-1, keepdim=True)
    max_scale = scales.gather(-1, at)
    zero = max_scale.abs() < GROUP_MAX_EPS
    iscale = torch.where(
        zero, torch.zeros_like(max_scale), -128.0 / torch.where(zero, torch.ones_like(max_scale), max_scale)
    )
    d = _f16(torch.where(zero, torch.zeros_like(iscale), 1 / torch.where(zero, torch.ones_like(iscale), iscale)))
    sc = _nearest(iscale * scales).clamp(max=127)  # [B, 16] (≥ -128 by construction)
    dd = (d * sc.float()).unsqueeze(-1)  # [B, 16, 1]
    sub = x.view(B, 16, 16)
    L = (_nearest(sub / torch.where(dd == 0, torch.ones_like(dd), dd)).clamp(-32, 31) + 32).where(dd != 0, 32)
    L = L.view(B, 2, 4, 32).to(torch.uint8)  # per 128-half: 4 runs of 32
    low = L & 0xF
    ql = torch.cat([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=-1)  # [B, 2, 64]
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    out = torch.empty(B, 210, dtype=torch.uint8)
    out[:, :128] = ql.reshape(B, 128)
    out[:, 128:192] = qh.reshape(B, 64)
    out[:, 192:208] = sc.to(torch.int8).view(torch.uint8)
    out[:, 208:] = d.half().view(torch.uint8).view(B, 2)
    return torch.where(zero.expand(B, 210), torch.zeros_like(out), out)


def _scale_min_blocks(x: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's shared part (`quantize_row_q4_K_ref`, `_q5_K_ref`): x [B, 256] → (d, dmin,
    packed 6-bit sub-block scales and mins) as the block's first 16 bytes [B, 16], and the codes
    L [B, 8, 32] in 0..nmax."""
    B = x.shape[0]
    scales, mins = (t.view(B, 8) for t in _qkx2_scale_min(x.reshape(B * 8, 32), nmax, rmin, nstep))
    # the C loop starts both at +0 and takes only larger values: never -0
    max_scale, max_min = (
        torch.where(t > 0, t, 0.0) for t in (scales.amax(-1, keepdim=True), mins.amax(-1, keepdim=True))
    )
    inv_scale = torch.where(max_scale > 0, 63.0 / max_scale.clamp_min(1e-30), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, 63.0 / max_min.clamp_min(1e-30), torch.zeros_like(max_min))
    ls = _nearest(inv_scale * scales).clamp(max=63).to(torch.uint8)
    lm = _nearest(inv_min * mins).clamp(max=63).to(torch.uint8)
    head = torch.empty(B, 16, dtype=torch.uint8)
    d, dmin = _f16(max_scale / 63), _f16(max_min / 63)
    head[:, 0:2] = d.half().view(torch.uint8).view(B, 2)
    head[:, 2:4] = dmin.half().view(torch.uint8).view(B, 2)
    head[:, 4:8] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    head[:, 8:12] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    head[:, 12:16] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    dd = (d * ls.float()).unsqueeze(-1)  # [B, 8, 1]
    dm = (dmin * lm.float()).unsqueeze(-1)
    sub = x.view(B, 8, 32)
    L = _nearest((sub + dm) / torch.where(dd == 0, torch.ones_like(dd), dd)).clamp(0, nmax).where(dd != 0, 0)
    return head, L.to(torch.uint8)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    """x [B, 256] → Q4_K blocks uint8 [B, 144]: 32-byte chunk c holds sub-blocks 2c (low nibbles)
    and 2c + 1 (high)."""
    head, L = _scale_min_blocks(x, 15, -1.0, 20)
    L = L.view(-1, 4, 2, 32)
    return torch.cat([head, (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    """x [B, 256] → Q5_K blocks uint8 [B, 176]: Q4_K's nibbles, and bit j of qh[l] the fifth bit
    of element l of sub-block j."""
    head, L = _scale_min_blocks(x, 31, -0.5, 15)
    fifth = (L >> 4).to(torch.int32) << torch.arange(8, dtype=torch.int32).view(1, 8, 1)
    qh = fifth.sum(1).to(torch.uint8)  # [B, 32]
    L = (L & 0xF).view(-1, 4, 2, 32)
    return torch.cat([head, qh, (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)], dim=1)


def _k_quantize(w: torch.Tensor, block: Callable[[torch.Tensor], torch.Tensor], block_bytes: int) -> torch.Tensor:
    K = w.shape[-1]
    if K % 256:
        raise ValueError(f"K-quants need rows of a multiple of 256 weights, got {K}")
    flat = w.reshape(-1, 256)
    out = torch.empty(flat.shape[0], block_bytes, dtype=torch.uint8)
    step = _WEIGHTS_AT_ONCE // 256
    for r in range(0, flat.shape[0], step):
        out[r : r + step] = block(flat[r : r + step].float())
    return out.reshape(*w.shape[:-1], K // 256 * block_bytes)


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] (K a multiple of 256) → Q6_K rows uint8 [..., K/256·210]."""
    return _k_quantize(w, _q6_k, 210)


def quantize_q5_k(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] (K a multiple of 256) → Q5_K rows uint8 [..., K/256·176]."""
    return _k_quantize(w, _q5_k, 176)


def quantize_q4_k(w: torch.Tensor) -> torch.Tensor:
    """w [..., K] (K a multiple of 256) → Q4_K rows uint8 [..., K/256·144]."""
    return _k_quantize(w, _q4_k, 144)


def fits(type_id: GGMLType, in_features: int) -> bool:
    """Whether rows of `in_features` weights split into whole blocks of the type."""
    return in_features % _BLOCK_ELEMS[type_id] == 0


def quantize(w: torch.Tensor, type_id: GGMLType) -> torch.Tensor:
    """w [..., K] → rows of blocks of `type_id` (one of QUANTIZE_TYPES)."""
    if type_id == GGMLType.Q8_0:
        return quantize_q8_0(w)
    if type_id == GGMLType.Q5_0:
        return quantize_q5_0(w)
    if type_id == GGMLType.Q5_1:
        return quantize_q5_1(w)
    if type_id == GGMLType.Q4_K:
        return quantize_q4_k(w)
    if type_id == GGMLType.Q5_K:
        return quantize_q5_k(w)
    if type_id == GGMLType.Q6_K:
        return quantize_q6_k(w)
    raise ValueError(
        f"cannot quantize to {type_id.name}; hybridkv quantizes to {', '.join(QUANTIZE_TYPES)}, q5_0, q5_k"
    )
