"""K-quant integer matmuls (Q2_K to Q6_K on Q8_K activations) against a NumPy emulation of
llama.cpp's arithmetic, written from its C (`quantize_row_q8_K_ref`, `ggml_vec_dot_q*_K_q8_K`):
activation blocks and integer sums exactly, floats to rounding; and against gguf-py's dequantized
weights in float64."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from op_checks import assert_close
from test_quant import gguf_dequantize, random_rows

from hybridkv.ops import native
from hybridkv.ops.quant import GGMLType, QuantizedWeight, block_type, int8_dot, k_dot, stream
from hybridkv.ops.quant import blocks as block_fns
from hybridkv.ops.quant.linear import QuantExperts, QuantLinear
from hybridkv.ops.quant.weight import for_kernels

K_QUANTS = [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K]
# Codes stored unsigned with the offset in M (d·sc·(q − offset)): the float step is d·(S − M).
MINS_IN_D = (GGMLType.Q3_K, GGMLType.Q6_K)
# The kernels' types: the file's, and Q4_K as repacked at load (checked against Q4_K's emulation).
KERNEL_TYPES = [*K_QUANTS, GGMLType.Q4_K_R]
SHAPES = [
    (1, 256, 1),
    (1, 4096, 37),
    (1, 1024, 45),
    (2, 1024, 9),
    (3, 768, 5),
    (5, 512, 11),
    (7, 512, 17),
    (9, 512, 21),
    (32, 256, 9),
    (70, 256, 45),
]
# (T, K, N). One row: weight rows eight at a time, the rest one by one. 2-15 rows (AVX-512): Q4_K_R
# blocks decoded once for up to 4 rows (5 = 3 + 2, 7 = 4 + 3), Q6_K and Q2_K blocks for 2-4 rows,
# Q3_K for 2-3, or else unpacked once for all; from 8 rows Q4_K and Q4_K_R take weight rows 16 at
# a time (9 x 21: one group of 16, then 5 unpacked).
# 70 x 45: two tiles of activation rows; with 32+ rows, two groups of 16 weight rows (AVX-512), 8,
# then 5 one by one


# --- the emulation -----------------------------------------------------------------------------


def emulate_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`quantize_row_q8_K_ref` in NumPy float32: the first element of largest |x| is `max`,
    iscale = -127/max, q = min(127, nearest_int(iscale*x)) with nearest_int's 1.5·2^23 trick,
    bsums = sums of 16, d = 1/iscale; a zero block stays zero."""
    T, K = x.shape
    sb = x.astype(np.float32).reshape(T, K // 256, 256)
    q = np.zeros(sb.shape, np.int8)
    d = np.zeros(sb.shape[:2], np.float32)
    for t, b in np.ndindex(*sb.shape[:2]):
        v = sb[t, b]
        peak = v[np.argmax(np.abs(v))]  # argmax: the first maximum, as the C loop's strict `>`
        if peak == 0:
            continue
        iscale = np.float32(-127) / peak
        biased = ((iscale * v).astype(np.float32) + np.float32(12582912)).astype(np.float32)
        q[t, b] = np.minimum(127, (biased.view(np.int32) & 0x007FFFFF) - 0x00400000)
        d[t, b] = np.float32(1) / iscale
    bsums = q.reshape(T, -1, 16).astype(np.int32).sum(-1).astype(np.int16)
    return q.reshape(T, K), d, bsums


def k4_scales_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K scale bytes [..., 12] → scales, mins [..., 8] by the C code's kmask word shuffle."""
    u = scales.copy().view("<u4")  # [..., 3]
    k1, k2, k3 = np.uint32(0x3F3F3F3F), np.uint32(0x0F0F0F0F), np.uint32(0x03030303)
    u3 = ((u[..., 2] >> 4) & k2) | (((u[..., 1] >> 6) & k3) << 4)
    u1 = (u[..., 2] & k2) | (((u[..., 0] >> 6) & k3) << 4)
    words = np.stack([u[..., 0] & k1, u1, u[..., 1] & k1, u3], axis=-1).astype("<u4")
    b = words.view(np.uint8).astype(np.int64)
    return b[..., :8], b[..., 8:]


def q3_k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K scale bytes [..., 12] → the 16 signed scales by the C code's kmask word shuffle (aux[0..3]
    of `ggml_vec_dot_q3_K_q8_K_generic`), less 32."""
    u = scales.copy().view("<u4")  # [..., 3]
    k1, k2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    a, b, tmp = u[..., 0], u[..., 1], u[..., 2]
    words = [
        (a & k2) | ((tmp & k1) << 4),
        (b & k2) | (((tmp >> 2) & k1) << 4),
        ((a >> 4) & k2) | (((tmp >> 4) & k1) << 4),
        ((b >> 4) & k2) | (((tmp >> 6) & k1) << 4),
    ]
    return np.stack(words, axis=-1).astype("<u4").view(np.int8).astype(np.int64) - 32


def emulate_codes(rows: np.ndarray, t: GGMLType) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Weight rows → (unsigned codes [N, nb, n_sub, sub], scales, mins [N, nb, n_sub] in units of
    the activation bsums of each sub-block, d, dmin float32 [N, nb]), as the C code unpacks them."""
    N = rows.shape[0]
    b = rows.reshape(N, -1, block_type(t).block_bytes)
    if t in (GGMLType.Q2_K, GGMLType.Q3_K):
        # Per 128-weight half h and shift 2j: weights 128h + 32j + l from qs[32h + l] (the C loops'
        # q2/q3 += 32 per half, shift += 2 per j); Q3_K subtracts 4 where hmask[l] bit 4h + j is clear.
        at = 16 if t == GGMLType.Q2_K else 32
        qs = b[..., at : at + 64].reshape(N, -1, 2, 1, 32)
        codes = ((qs >> (2 * np.arange(4))[:, None]) & 3).astype(np.int64)  # [N, nb, h, j, 32]
        if t == GGMLType.Q2_K:
            sc = b[..., :16].astype(np.int64)
            d, dmin = (b[..., at : at + 2].copy().view(np.float16).astype(np.float32)[..., 0] for at in (80, 82))
            return codes.reshape(N, -1, 16, 16), sc & 15, sc >> 4, d, dmin
        hm = b[..., :32].reshape(N, -1, 1, 1, 32)
        bit = (hm >> (4 * np.arange(2)[:, None, None] + np.arange(4)[:, None])) & 1  # [N, nb, h, j, 32]
        signed = codes - 4 * (1 - bit.astype(np.int64))
        sc = q3_k_scales(b[..., 96:108])
        d = b[..., 108:110].copy().view(np.float16).astype(np.float32)[..., 0]
        return (signed + 4).reshape(N, -1, 16, 16), sc, 4 * sc, d, d
    if t == GGMLType.Q6_K:
        ql, qh = b[..., :128].reshape(N, -1, 2, 64), b[..., 128:192].reshape(N, -1, 2, 32)
        parts = [
            (ql[..., :32] & 15) | ((qh & 3) << 4),
            (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
            (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4),
            (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4),
        ]
        codes = np.concatenate(parts, axis=-1).reshape(N, -1, 16, 16)  # weights l, l+32, l+64, l+96
        sc = b[..., 192:208].copy().view(np.int8).astype(np.int64)
        d = b[..., 208:210].copy().view(np.float16).astype(np.float32)[..., 0]
        return codes.astype(np.int64), sc, 32 * sc, d, d
    qs = b[..., -128:].reshape(N, -1, 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, -1, 8, 32).astype(np.int64)
    if t == GGMLType.Q5_K:
        qh = b[..., 16:48]
        codes += 16 * ((qh[..., None, :] >> np.arange(8)[:, None]) & 1)
    sc, mn = k4_scales_mins(b[..., 4:16])
    d, dmin = (b[..., at : at + 2].copy().view(np.float16).astype(np.float32)[..., 0] for at in (0, 2))
    return codes, sc, mn, d, dmin


def emulate(x: np.ndarray, rows: np.ndarray, t: GGMLType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sub-block sums [T, N, nb, n_sub], (S, M) [T, N, nb, 2] in int64, x @ W.T [T, N] float64):
    S = Σ sc_j·(codes·q)_j, M = Σ m_j·bsum_j, and Σ_b f32(d_w·d_x)·S − f32(dmin_w·d_x)·M (Q6_K:
    f32(d_w·d_x)·(S − M)), the float products rounded as llama.cpp rounds them."""
    q, dx, bsums = emulate_q8_k(x)
    codes, sc, mn, d, dmin = emulate_codes(rows, t)
    T, (_, nb, n_sub, sub) = x.shape[0], codes.shape
    sub_sums = np.einsum("nbjl,tbjl->tnbj", codes, q.reshape(T, nb, n_sub, sub).astype(np.int64))
    x_sums = bsums.reshape(T, nb, n_sub, -1).astype(np.int64).sum(-1)
    S = (sub_sums * sc).sum(-1)
    M = np.einsum("tbj,nbj->tnb", x_sums, mn)
    dd = (d[None] * dx[:, None]).astype(np.float64)
    if t in MINS_IN_D:
        y = (dd * (S - M)).sum(-1)
    else:
        y = (dd * S - (dmin[None] * dx[:, None]).astype(np.float64) * M).sum(-1)
    return sub_sums, np.stack([S, M], axis=-1), y


def activations(T: int, K: int, seed: int) -> torch.Tensor:
    """Random rows with mixed scales and the cases that matter: a zero super-block; one whose
    largest |x| is negative and ties with a later +127 (the first wins: iscale = 1), with exact
    rounding ties."""
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-3, 1, K)
    if K >= 512:
        x[0, :256] = 0
        x[0, 256:264] = torch.tensor([-127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.0])
        x[0, 264:512] = torch.empty(248).uniform_(-126, 126, generator=torch.Generator().manual_seed(seed))
    return x


def weight_rows(t: GGMLType, N: int, K: int, seed: int) -> np.ndarray:
    return random_rows(block_type(t), (N,), K, seed)


def file_type(t: GGMLType) -> GGMLType:
    """The type the emulation reads for a kernel type (Q4_K_R: Q4_K, whose bytes it permutes)."""
    return GGMLType.Q4_K if t == GGMLType.Q4_K_R else t


def kernel_rows(t: GGMLType, rows: np.ndarray) -> torch.Tensor:
    """File rows of `file_type(t)` as the kernels of type t read them."""
    w = torch.from_numpy(rows)
    return block_fns.repack_q4_k(w) if t == GGMLType.Q4_K_R else w


# --- Q8_K activations --------------------------------------------------------------------------


@pytest.mark.parametrize(("T", "K"), [(1, 256), (3, 512), (7, 1024)])
def test_q8_k_blocks_match_the_emulation(T: int, K: int) -> None:
    x = activations(T, K, seed=K)
    want = emulate_q8_k(x.numpy())
    got = [k_dot.quantize_rows_q8_k(x)]
    if native.kernels() is not None:
        got.append(k_dot.native_quantize_rows_q8_k(x))
    for blocks in got:
        assert [a.dtype for a in blocks] == [torch.int8, torch.float32, torch.int16]
        for a, b in zip(blocks, want, strict=True):
            assert np.array_equal(a.numpy(), b)
        if K >= 512:
            assert blocks.q[0, 256:264].tolist() == [-127, 0, 2, 2, 0, -2, -2, 127]  # ties to even
            assert blocks.d[0].tolist()[:2] == [0.0, 1.0]
        # The sign trick: the largest |x| always becomes -127 (d takes the sign that undoes it).
        assert ((blocks.q.view(T, -1, 256).amin(-1) == -127) | (blocks.d == 0)).all()


def test_q8_k_peak_in_every_lane_and_the_first_of_equal_ones() -> None:
    # Row i: super-block 0's largest |x| at position i; super-block 1's at position 255 - i, tied
    # there by an opposite-signed one further on (the first decides the sign of d)
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(7))
    for i in range(256):
        x[i, i] = 40.0 if i % 2 else -40.0
        x[i, 256 + 255 - i] = -50.0
        if i > 0:
            x[i, 256 + 255 - i + 1 + (i * 37) % i] = 50.0
    want = emulate_q8_k(x.numpy())
    got = [k_dot.quantize_rows_q8_k(x)] + ([k_dot.native_quantize_rows_q8_k(x)] if native.kernels() else [])
    for blocks in got:
        for a, b in zip(blocks, want, strict=True):
            assert np.array_equal(a.numpy(), b)
    assert (want[1][:, 1] > 0).all() and (np.sign(want[1][:, 0]) == [1, -1] * 128).all()


# --- integer sums and float results ------------------------------------------------------------


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("T", "K", "N"), SHAPES)
def test_integer_sums_equal_the_emulation_exactly(t: GGMLType, T: int, K: int, N: int) -> None:
    x = activations(T, K, seed=N)
    rows = weight_rows(file_type(t), N, K, seed=T)
    want_sub, want_sums, _ = emulate(x.numpy(), rows, file_type(t))
    xq, w = k_dot.quantize_rows_q8_k(x), kernel_rows(t, rows)
    assert np.array_equal(k_dot.sub_block_sums(xq, k_dot.split_k(w, t)).numpy(), want_sub)
    assert np.array_equal(k_dot.superblock_sums(xq, k_dot.split_k(w, t)).numpy(), want_sums)
    for isa in k_dot.available_isas():
        assert np.array_equal(k_dot.native_superblock_sums(xq, w, t, isa).numpy(), want_sums), isa


@pytest.mark.parametrize(("t", "offset"), [(GGMLType.Q6_K, 32), (GGMLType.Q3_K, 4)], ids=["Q6_K", "Q3_K"])
def test_sums_with_the_offset_in_m_are_llama_cpp_generic_signed_ones(t: GGMLType, offset: int) -> None:
    # The generic C code subtracts the offset from each code; the kernels subtract offset·Σ sc·bsum: the same S − M.
    x = activations(3, 512, seed=0)
    rows = weight_rows(t, 5, 512, seed=0)
    sub, sums, _ = emulate(x.numpy(), rows, t)
    q, _, _ = emulate_q8_k(x.numpy())
    codes, sc, _, _, _ = emulate_codes(rows, t)
    signed = np.einsum("nbjl,tbjl->tnbj", codes - offset, q.reshape(3, 2, 16, 16).astype(np.int64))
    assert np.array_equal((signed * sc).sum(-1), sums[..., 0] - sums[..., 1])


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize(("T", "K", "N"), SHAPES)
def test_matmul_within_rounding_of_the_emulation(t: GGMLType, T: int, K: int, N: int) -> None:
    x = activations(T, K, seed=N)
    rows = weight_rows(file_type(t), N, K, seed=T)
    want = torch.from_numpy(emulate(x.numpy(), rows, file_type(t))[2])
    w = kernel_rows(t, rows)
    assert_close(k_dot.k_matmul_twin(x, w, t), want, rel=1e-6)
    for isa in k_dot.available_isas():
        assert_close(k_dot.native_k_matmul(x, w, t, isa), want, rel=1e-6)


@pytest.mark.parametrize("t", K_QUANTS, ids=lambda t: t.name)
@pytest.mark.parametrize(("T", "K", "N"), SHAPES)
def test_matmul_is_float64_on_gguf_weights_and_q8_k_activations(t: GGMLType, T: int, K: int, N: int) -> None:
    x = activations(T, K, seed=N)
    rows = weight_rows(t, N, K, seed=T)
    xq = k_dot.quantize_rows_q8_k(x)
    x_blocks = (xq.q.double().view(T, -1, 256) * xq.d.double()[..., None]).view(T, K)
    w = torch.from_numpy(gguf_dequantize(rows, block_type(t))).double()
    got = k_dot.k_matmul_twin(x, torch.from_numpy(rows), t)
    assert_close(got, x_blocks @ w.T, rel=1e-6 * K**0.5)
    # Against float activations: off by the activations' rounding (up to 1/254 of a block's max, each).
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(K))
    assert_close(k_dot.k_matmul_twin(x, torch.from_numpy(rows), t), x.double() @ w.T, rel=3e-2)


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_is_gguf_dequantize_of_those_rows_bit_for_bit(t: GGMLType) -> None:
    """An embedding lookup on a file's blocks: the C++ rows equal gguf-py's and the PyTorch twin's
    exactly (a decode step looks its token up there, a prefill through the same kernel or the twin)."""
    V, K = 23, 768
    rows = weight_rows(file_type(t), V, K, seed=V)
    ids = torch.tensor([0, 22, 5, 5, 17])
    got = k_dot.native_k_dequantize_rows(kernel_rows(t, rows), ids, int(t))
    want = torch.from_numpy(gguf_dequantize(rows[ids.numpy()], block_type(file_type(t)))).float()
    assert torch.equal(got, want.view(len(ids), K))
    twin = QuantizedWeight(kernel_rows(t, rows), block_type(t), (V, K)).dequantize()
    assert torch.equal(got, twin[ids])
    assert k_dot.native_k_dequantize_rows(kernel_rows(t, rows), ids[:0], int(t)).shape == (0, K)
    with pytest.raises(RuntimeError, match="row 23 out of range for 23 rows"):
        k_dot.native_k_dequantize_rows(kernel_rows(t, rows), torch.tensor([23]), int(t))


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("T", [1, 3, 7, 20, 40])  # every form of the product: 1 row, decoded, unpacked, 16-row
def test_matmul_parts_is_each_parts_product_side_by_side(T: int) -> None:
    """A projection in parts of different K-quant types (a Q4_K_M file's q|k|v and z) in one call:
    each part's columns exactly what its own call gives (the same quantized activations)."""
    K, f = 512, [(GGMLType.Q6_K, 19), (GGMLType.Q4_K_R, 16), (GGMLType.Q5_K, 9), (GGMLType.Q4_K, 8)]
    f += [(GGMLType.Q3_K, 17), (GGMLType.Q2_K, 5)]
    x = activations(T, K, seed=T)
    ws = [kernel_rows(t, weight_rows(file_type(t), N, K, seed=N)) for t, N in f]
    for isa in k_dot.available_isas():
        got = k_dot.native_k_matmul_parts(x, ws, [int(t) for t, _ in f], isa)
        want = torch.cat([k_dot.native_k_matmul(x, w, t, isa) for w, (t, _) in zip(ws, f, strict=True)], 1)
        assert torch.equal(got, want), isa
    with pytest.raises(RuntimeError, match="one type per weight"):
        k_dot.native_k_matmul_parts(x, ws, [int(GGMLType.Q6_K)])
    with pytest.raises(RuntimeError, match="kq_matmul_parts: activations of 512 features need rows of"):
        k_dot.native_k_matmul_parts(x, ws[:1], [int(GGMLType.Q4_K)])


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
def test_experts_matmul_equals_each_tokens_product_on_its_expert(t: GGMLType) -> None:
    """Expert 0 meets 67 tokens (two tiles: on AVX-512 its rows 0-15 sixteen at a time, then rows
    16-23 eight at a time, without AVX-512 rows 0-23; the last five unpacked), expert 1 two,
    expert 2 one (the one-token path: its rows eight at a time, the rest one by one), experts 3
    and 4 seven and five, between the others' (on AVX-512 Q4_K_R's rows 0-15 sixteen at a time,
    the rest decoded, 4 + 3 and 3 + 2 rows; Q6_K's two decoded, its seven and five unpacked)."""
    E, N, K, f = 5, 29, 512, file_type(t)
    rows = np.stack([weight_rows(f, N, K, seed=e) for e in range(E)])
    ids = torch.tensor([0] * 33 + [1, 2] + [3, 4] * 5 + [0] * 34 + [3, 1, 3])
    x = activations(len(ids), K, seed=5)
    want = torch.cat(
        [torch.from_numpy(emulate(x[p : p + 1].numpy(), rows[e], f)[2]) for p, e in enumerate(ids.tolist())]
    )
    for isa in k_dot.available_isas():
        assert_close(k_dot.native_k_experts_matmul(x, kernel_rows(t, rows), ids, t, isa), want, rel=1e-6)
    _assert_rows_serve_their_pairs(x, kernel_rows(t, rows), t, E)


def _assert_rows_serve_their_pairs(x: torch.Tensor, w: torch.Tensor, t: GGMLType, E: int) -> None:
    """x [T, K] with k ids a row (each row quantized once for its k pairs) gives what each row
    repeated k times gives, bit for bit, on every path; ids not a multiple of T are refused."""
    x = x[:21]
    ids = torch.arange(3 * 21) * 7 % E  # k = 3, the experts meeting 1-13 pairs each
    for isa in k_dot.available_isas():
        want = k_dot.native_k_experts_matmul(x.repeat_interleave(3, 0), w, ids, t, isa)
        assert torch.equal(k_dot.native_k_experts_matmul(x, w, ids, t, isa), want)
    with pytest.raises(RuntimeError, match="multiple of x's 21 rows"):
        k_dot.native_k_experts_matmul(x, w, ids[:40], t)


# --- the traits table and the weight -----------------------------------------------------------


@pytest.mark.parametrize("t", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "pytorch"])
def test_k_quant_weight_matmul_takes_the_integer_path_for_few_rows(
    t: GGMLType, use_native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if use_native and native.kernels() is None:
        pytest.skip("C++ kernels could not be built here")
    monkeypatch.setattr(native, "disabled", not use_native)
    assert block_type(t).vec_dot_type == GGMLType.Q8_K
    rows = weight_rows(file_type(t), 9, 512, seed=0)
    w = QuantizedWeight.of(kernel_rows(t, rows), t)
    few, many = activations(3, 512, seed=1), activations(int8_dot.FEW_ROWS + 1, 512, seed=2)
    assert_close(w.matmul(few), torch.from_numpy(emulate(few.numpy(), rows, file_type(t))[2]), rel=1e-6)
    assert torch.equal(w.matmul(many), w.reference_matmul(many))


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
def test_native_k_quant_names_what_does_not_match() -> None:
    x, rows = torch.randn(2, 256), torch.zeros(3, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="activations of 512 features need rows of 288 bytes"):
        k_dot.native_k_matmul(torch.randn(2, 512), rows, GGMLType.Q4_K)
    with pytest.raises(
        RuntimeError,
        match=r"14 \(Q6_K\), 1012 \(Q4_K repacked at load\), 1013 and 1014 \(Q4_K, Q6_K tiled at load\), not 8",
    ):
        k_dot.native_k_matmul(x, rows, GGMLType.Q8_0)
    with pytest.raises(RuntimeError, match="isa 'vnni' is not available"):
        k_dot.native_k_matmul(x, rows, GGMLType.Q4_K, "vnni")
    with pytest.raises(RuntimeError, match="K a multiple of 256"):
        k_dot.native_quantize_rows_q8_k(torch.randn(2, 96))


# --- Q4_K repacked at load ---------------------------------------------------------------------


def test_q4_k_repack_puts_a_sub_block_in_each_lane_and_undoes_exactly() -> None:
    rows = torch.from_numpy(weight_rows(GGMLType.Q4_K, 5, 768, seed=3))
    r = block_fns.repack_q4_k(rows)
    assert torch.equal(block_fns.unrepack_q4_k(r), rows) and not torch.equal(r, rows)
    b, rb = rows.reshape(-1, 144), r.reshape(-1, 144)
    assert torch.equal(rb[:, :16], b[:, :16])  # d, dmin, scales in place
    codes = block_fns.q4_k_codes(b)  # [B, sub-block, position]
    # Chunk c, 4-byte lane j: low nibbles sub-block 2(j % 4), high 2(j % 4) + 1, positions 8c + 4(j // 4) + 0..3.
    lanes = rb[:, 16:].reshape(-1, 4, 8, 4)
    for c in range(4):
        for j in range(8):
            at = 8 * c + 4 * (j // 4)
            assert torch.equal(lanes[:, c, j] & 15, codes[:, 2 * (j % 4), at : at + 4])
            assert torch.equal(lanes[:, c, j] >> 4, codes[:, 2 * (j % 4) + 1, at : at + 4])
    dequantized = block_type(GGMLType.Q4_K_R).dequantize_blocks(rb)
    assert torch.equal(dequantized, block_type(GGMLType.Q4_K).dequantize_blocks(b))
    if native.kernels() is not None:  # the C++ twin that repacks at load
        assert torch.equal(k_dot.native_repack_q4_k(rows), r)
        assert torch.equal(k_dot.native_repack_q4_k(r, inverse=True), rows)


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "pytorch"])
def test_q4_k_is_repacked_for_the_kernels_only_where_they_run(use_native: bool, monkeypatch: pytest.MonkeyPatch):
    if use_native and native.kernels() is None:
        pytest.skip("C++ kernels could not be built here")
    monkeypatch.setattr(native, "disabled", not use_native)
    rows = torch.from_numpy(weight_rows(GGMLType.Q4_K, 4, 512, seed=1))
    w = for_kernels(QuantizedWeight.of(rows, GGMLType.Q4_K))
    assert w.btype.name == ("Q4_K_R" if use_native else "Q4_K") and w.shape == (4, 512)
    assert torch.equal(w.dequantize(), QuantizedWeight.of(rows, GGMLType.Q4_K).dequantize())
    q6 = QuantizedWeight.of(torch.from_numpy(weight_rows(GGMLType.Q6_K, 4, 512, seed=1)), GGMLType.Q6_K)
    assert for_kernels(q6) is q6


# --- Q4_K tiled by 16 rows at load ----------------------------------------------------------------


def test_q4_k_tiles_put_16_rows_side_by_side_and_undo_exactly() -> None:
    rows = torch.from_numpy(weight_rows(GGMLType.Q4_K, 32, 512, seed=5))
    t = block_fns.tile_q4_k(rows)
    assert torch.equal(block_fns.untile_q4_k(t), rows) and not torch.equal(t, rows)
    b = rows.reshape(2, 16, 2, 144)  # [tile, row, super-block, byte]
    tile = t.reshape(2, 2, 2304)  # [tile, super-block, byte]
    assert torch.equal(tile[..., :32].reshape(2, 2, 16, 2), b[..., :2].transpose(1, 2))  # d
    assert torch.equal(tile[..., 32:64].reshape(2, 2, 16, 2), b[..., 2:4].transpose(1, 2))  # dmin
    # Group (c, g) of 64 bytes: row r's Q4_K code bytes 32c + 4g .. +3 at 4r.
    groups = tile[..., 256:].reshape(2, 2, 4, 8, 16, 4)
    codes = b[..., 16:].reshape(2, 16, 2, 4, 8, 4)
    for c, g, r in [(0, 0, 0), (3, 7, 15), (1, 5, 9)]:
        assert torch.equal(groups[:, :, c, g, r], codes[:, r, :, c, g])
    # Value v of row r (sc_0..7, m_0..7) at bits 6r..6r+5 of its 12 bytes.
    sc, mn = block_fns.k_scales(b[..., 4:16].reshape(-1, 12))
    values = torch.cat([sc, mn], -1).view(2, 16, 2, 16)
    packed = tile[..., 64:256].reshape(2, 2, 16, 12)
    bits = ((packed[..., None].int() >> torch.arange(8)) & 1).reshape(2, 2, 16, 96)
    for v, r in [(0, 0), (7, 10), (8, 15), (15, 3)]:
        got = (bits[:, :, v, 6 * r : 6 * r + 6] << torch.arange(6)).sum(-1)
        assert torch.equal(got, values[:, r, :, v].int())
    _assert_tiles_are_the_rows(rows, t, GGMLType.Q4_K, GGMLType.Q4_K_T)


def _assert_tiles_are_the_rows(rows: torch.Tensor, t: torch.Tensor, file_t: GGMLType, tiled_t: GGMLType) -> None:
    """Tiles t of rows [32, 512·] dequantize to the rows' weights; the tilers refuse rows not 16 at
    a time; the C++ twin that tiles at load gives the same bytes both ways."""
    name = file_t.name.lower()
    assert torch.equal(
        QuantizedWeight(t, block_type(tiled_t), (32, 512)).dequantize(), QuantizedWeight.of(rows, file_t).dequantize()
    )
    with pytest.raises(ValueError, match="16"):
        getattr(block_fns, f"tile_{name}")(rows[:20])
    if native.kernels() is not None:
        native_tile = getattr(k_dot, f"native_tile_{name}")
        assert torch.equal(native_tile(rows), t)
        assert torch.equal(native_tile(t, inverse=True), rows)
        with pytest.raises(RuntimeError, match="multiple of 16"):
            native_tile(rows[:20])


# (T, K, N): one row and 2-4 (the rows in registers at once), 5 and 9 (4 + 1, 4 + 4 + 1), 70 (two
# TILE_T passes), on one and several tiles.
TILED_SHAPES = [
    (1, 256, 16),
    (1, 1024, 48),
    (2, 512, 32),
    (3, 768, 16),
    (4, 256, 32),
    (5, 512, 16),
    (9, 256, 48),
    (70, 256, 32),
]


# The tiled types: (file type, tiled type, the Python tiler)
TILED = [
    (GGMLType.Q4_K, GGMLType.Q4_K_T, block_fns.tile_q4_k),
    (GGMLType.Q6_K, GGMLType.Q6_K_T, block_fns.tile_q6_k),
]


@pytest.mark.parametrize(("file_t", "tiled_t", "tile"), TILED, ids=lambda v: getattr(v, "name", ""))
@pytest.mark.parametrize(("T", "K", "N"), TILED_SHAPES)
def test_tiled_k_matmul_within_rounding_of_the_emulation(
    T: int, K: int, N: int, file_t: GGMLType, tiled_t: GGMLType, tile: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    x = activations(T, K, seed=N)
    rows = weight_rows(file_t, N, K, seed=T)
    _, want_sums, want = emulate(x.numpy(), rows, file_t)
    w = tile(torch.from_numpy(rows))
    xq = k_dot.quantize_rows_q8_k(x)
    assert np.array_equal(k_dot.superblock_sums(xq, k_dot.split_k(w, tiled_t)).numpy(), want_sums)
    assert_close(k_dot.k_matmul_twin(x, w, tiled_t), torch.from_numpy(want), rel=1e-6)
    if native.kernels() is None:
        return
    for isa in k_dot.available_isas():  # "avx2": the 16-lane kernel where this build has it
        assert np.array_equal(k_dot.native_superblock_sums(xq, w, tiled_t, isa).numpy(), want_sums)
        assert_close(k_dot.native_k_matmul(x, w, tiled_t, isa), torch.from_numpy(want), rel=1e-6)
    parts = k_dot.native_k_matmul_parts(x, [w, torch.from_numpy(rows)], [tiled_t, file_t])
    assert_close(parts, torch.from_numpy(np.concatenate([want, want], -1)), rel=1e-6)
    ids = torch.tensor([N - 1, 0, 17 % N])
    assert torch.equal(
        k_dot.native_k_dequantize_rows(w, ids, tiled_t),
        QuantizedWeight.of(torch.from_numpy(rows), file_t).dequantize()[ids],
    )


def test_q6_k_tiles_put_16_rows_side_by_side_and_undo_exactly() -> None:
    rows = torch.from_numpy(weight_rows(GGMLType.Q6_K, 32, 512, seed=6))
    t = block_fns.tile_q6_k(rows)
    assert torch.equal(block_fns.untile_q6_k(t), rows) and not torch.equal(t, rows)
    b = rows.reshape(2, 16, 2, 210)  # [tile, row, super-block, byte]
    tile = t.reshape(2, 2, 3360)  # [tile, super-block, byte]
    assert torch.equal(tile[..., :32].reshape(2, 2, 16, 2), b[..., 208:210].transpose(1, 2))  # d
    assert torch.equal(tile[..., 32:288].reshape(2, 2, 16, 16), b[..., 192:208].permute(0, 2, 3, 1))  # scales [j, row]
    codes = block_fns.q6_k_codes(b.reshape(-1, 210)).view(2, 16, 2, 256)  # [tile, row, super-block, weight]
    groups = tile[..., 288:].reshape(2, 2, 16, 3, 16, 4)  # [tile, super-block, m, vector, row, byte]
    for m, r, i in [(0, 0, 0), (15, 15, 3), (6, 9, 2)]:
        for n in (2 * m, 2 * m + 1):  # nibble vectors: weight 4n + i low, 128 + 4n + i high
            byte = groups[:, :, m, n - 2 * m, r, i]
            assert torch.equal(byte & 15, codes[:, r, :, 4 * n + i] & 15)
            assert torch.equal(byte >> 4, codes[:, r, :, 128 + 4 * n + i] & 15)
        top = groups[:, :, m, 2, r, i]  # bits 2k: weights 8m + i, 8m + 4 + i, 128 + 8m + i, 132 + 8m + i
        for k, weight in enumerate([8 * m + i, 8 * m + 4 + i, 128 + 8 * m + i, 132 + 8 * m + i]):
            assert torch.equal((top >> (2 * k)) & 3, codes[:, r, :, weight] >> 4)
    _assert_tiles_are_the_rows(rows, t, GGMLType.Q6_K, GGMLType.Q6_K_T)


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize(
    ("file_t", "tiled", "kept"), [(GGMLType.Q4_K, "Q4_K_T", "Q4_K_R"), (GGMLType.Q6_K, "Q6_K_T", "Q6_K")]
)
def test_k_quants_are_tiled_where_the_16_lane_kernel_runs_and_rows_allow(
    file_t: GGMLType, tiled: str, kept: str
) -> None:
    # elsewhere Q4_K is repacked and Q6_K kept as the file's
    rows = torch.from_numpy(weight_rows(file_t, 32, 512, seed=2))
    assert for_kernels(QuantizedWeight.of(rows, file_t)).btype.name == (tiled if k_dot.native_tiles_q4_k() else kept)
    assert for_kernels(QuantizedWeight.of(rows[:24], file_t)).btype.name == kept  # 24 rows
    # an embedding (or a tied head) too: its lookups untile the rows they read
    embed = for_kernels(QuantizedWeight.of(rows, file_t))
    ids = torch.tensor([31, 0, 17, 17])
    assert torch.equal(embed.rows(ids), QuantizedWeight.of(rows, file_t).dequantize()[ids])
    experts = QuantizedWeight(rows.view(2, 16, -1), block_type(file_t), (2, 16, 512))  # each expert's rows tiled
    assert for_kernels(experts).btype.name == (tiled if k_dot.native_tiles_q4_k() else kept)
    assert for_kernels(QuantizedWeight(rows[:24].view(3, 8, -1), block_type(file_t), (3, 8, 512))).btype.name == kept
    if k_dot.native_tiles_q4_k():
        tiled_experts = for_kernels(experts).blocks
        for e in range(2):
            assert torch.equal(
                block_fns.untile_q4_k(tiled_experts[e])
                if file_t == GGMLType.Q4_K
                else block_fns.untile_q6_k(tiled_experts[e]),
                rows.view(2, 16, -1)[e],
            )
    native_tile = getattr(k_dot, f"native_tile_{file_t.name.lower()}")
    with pytest.raises(RuntimeError, match="multiple of 16 rows each"):
        k_dot.native_k_experts_matmul(
            torch.randn(1, 512), native_tile(rows).view(4, 8, -1), torch.tensor([0]), GGMLType[tiled]
        )


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize(("file_t", "tiled_t", "tile"), TILED, ids=lambda v: getattr(v, "name", ""))
def test_tiled_experts_matmul_equals_each_tokens_product_on_its_expert(
    file_t: GGMLType, tiled_t: GGMLType, tile: Callable[[torch.Tensor], torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts tiled at load (each expert's 32 rows: two tiles): expert 0 meets 70 tokens (two
    TILE_T passes), expert 1 two, expert 2 one, experts 3 and 4 seven and five (4 + 3, 4 + 1 rows in
    registers), expert 5 none; the same numbers on every path (the untiled kernels where the 16-lane
    one is not built)."""
    E, N, K = 6, 32, 512
    rows = np.stack([weight_rows(file_t, N, K, seed=e) for e in range(E)])
    ids = torch.tensor([0] * 33 + [1, 2] + [3, 4] * 5 + [0] * 37 + [3, 1, 3])
    x = activations(len(ids), K, seed=6)
    want = torch.cat(
        [torch.from_numpy(emulate(x[p : p + 1].numpy(), rows[e], file_t)[2]) for p, e in enumerate(ids.tolist())]
    )
    w = tile(torch.from_numpy(rows))
    assert torch.equal(w[3], tile(torch.from_numpy(rows[3])))  # each expert tiled as its own rows
    for isa in k_dot.available_isas():
        assert_close(k_dot.native_k_experts_matmul(x, w, ids, tiled_t, isa), want, rel=1e-6)
    _assert_rows_serve_their_pairs(x, w, tiled_t, E)
    experts = QuantExperts((QuantizedWeight(w, block_type(tiled_t), (E, N, K)),))
    assert_close(experts.pairs_matmul(x, ids), want, rel=1e-6)
    pairs = torch.arange(90) % E  # k = 3
    got = experts.pairs_matmul(x[:30], pairs)
    assert torch.equal(got, experts.pairs_matmul(x[:30].repeat_interleave(3, 0), pairs))
    with pytest.raises(ValueError, match="multiple of T expert ids"):
        experts.pairs_matmul(x[:29], pairs)
    monkeypatch.setattr(native, "disabled", True)  # the PyTorch twin, pair by pair, takes rows alike
    assert_close(experts.pairs_matmul(x[:30], pairs), got, rel=1e-6)
    assert_close(
        experts.expert(4).matmul(x[:3]), torch.from_numpy(emulate(x[:3].numpy(), rows[4], file_t)[2]), rel=1e-6
    )


@pytest.fixture
def stream_setting():
    """The fetch-ahead setting of the tiled products, put back as it was after the test."""
    before = stream.native_stream_ahead()
    yield
    stream.native_stream_ahead(before)


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize(("file_t", "tiled_t", "tile"), TILED, ids=lambda v: getattr(v, "name", ""))
def test_fetching_weights_ahead_or_not_gives_the_same_products(
    stream_setting: None, file_t: GGMLType, tiled_t: GGMLType, tile: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    rows = weight_rows(file_t, 64, 512, seed=3)  # without the tiled kernel, its fallback (no fetch)
    w, experts = tile(torch.from_numpy(rows)), tile(torch.from_numpy(rows)).view(4, 16, -1)
    for T in (1, 3, 8, 9):  # the fetch at up to 8 rows; 9 takes the next-tile form either way
        x = activations(T, 512, seed=T)
        ids = torch.arange(2 * T) % 4
        _, _, want = emulate(x.numpy(), rows, file_t)
        got = {}
        for on in (True, False):
            stream.native_stream_ahead(on)
            assert stream.native_stream_ahead() is on
            got[on] = (k_dot.native_k_matmul(x, w, tiled_t), k_dot.native_k_experts_matmul(x, experts, ids, tiled_t))
        assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
        assert_close(got[True][0], torch.from_numpy(want), rel=1e-6)


@pytest.fixture
def amx_setting():
    """Whether the tiled products use AMX, put back as it was after the test."""
    before = k_dot.native_amx()
    yield
    k_dot.native_amx(before)


def _cpu_has_amx() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"amx_tile", "amx_int8"} <= set(flags.split())


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize(("file_t", "tiled_t", "tile"), TILED, ids=lambda v: getattr(v, "name", ""))
def test_amx_tiles_or_dot_instructions_give_the_same_products(
    amx_setting: None, file_t: GGMLType, tiled_t: GGMLType, tile: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Where AMX runs (Q4_K at 16+ activation rows), the same floats as the dot instructions, bit for
    bit: rows in place (16 consecutive) and gathered (an expert's rows; a last group of fewer than 16,
    padded). Where it cannot run, the switch stays off; a native build on a Linux CPU with AMX-INT8
    must have it."""
    k_dot.native_amx(True)
    available = k_dot.native_amx()
    if _cpu_has_amx() and not os.environ.get(native.ARCH_ENV) and k_dot.native_tiles_q4_k():
        assert available, "a native build on a CPU with AMX-INT8 should run the tiled Q4_K products on it"
    rows = weight_rows(file_t, 64, 512, seed=7)
    w, experts = tile(torch.from_numpy(rows)), tile(torch.from_numpy(rows)).view(4, 16, -1)
    for T in (15, 16, 17, 33, 56, 70):
        x = activations(T, 512, seed=T)
        ids = torch.arange(3 * T) % 4  # each expert meets rows from all over x: gathered
        _, _, want = emulate(x.numpy(), rows, file_t)
        got = {}
        for on in (True, False):
            k_dot.native_amx(on)
            assert k_dot.native_amx() is (on and available)
            got[on] = (k_dot.native_k_matmul(x, w, tiled_t), k_dot.native_k_experts_matmul(x, experts, ids, tiled_t))
        assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
        assert_close(got[True][0], torch.from_numpy(want), rel=1e-6)


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q4_1, GGMLType.Q5_0])
def test_fetching_32_weight_rows_ahead_or_not_gives_the_same_products(stream_setting: None, t: GGMLType) -> None:
    rows = torch.from_numpy(random_rows(block_type(t), (70,), 512, seed=5))  # the fetch at one row; 2 never
    for T in (1, 2):
        x = activations(T, 512, seed=T)
        got = {}
        for on in (True, False):
            stream.native_stream_ahead(on)
            got[on] = int8_dot.native_q8_matmul(x, rows, int(t))
        assert torch.equal(got[True], got[False])
        assert_close(got[True], int8_dot.q8_matmul_twin(x, rows, int(t)), rel=1e-5)


@pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")
def test_tune_times_the_largest_streamed_weight_only_when_it_outgrows_the_cache(
    stream_setting: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = for_kernels(
        QuantizedWeight.of(torch.from_numpy(weight_rows(GGMLType.Q4_K, 32, 512, seed=1)), GGMLType.Q4_K)
    )
    larger = QuantizedWeight.of(torch.from_numpy(random_rows(block_type(GGMLType.Q8_0), (96,), 512, seed=2)), 8)
    floats = QuantizedWeight.of(torch.zeros(512, 2048, dtype=torch.uint8), GGMLType.F32)  # larger, not streamed
    held = QuantLinear((small, torch.zeros(512, 8)))
    module = torch.nn.Module()
    module.proj, module.head, module.other = held, larger, floats
    assert [id(w) for w in stream.held_weights(module)] == [id(small), id(larger), id(floats)]  # parts, attributes
    assert [stream.streamed(w) for w in (small, larger, floats)] == [k_dot.native_tiles_q4_k(), True, False]
    stream.native_stream_ahead(False)
    assert stream.tune([small, larger, floats]) is None  # all fit in any last-level cache: not timed
    assert stream.native_stream_ahead() is False  # left as it was
    timed: list[int] = []
    monkeypatch.setattr(stream, "last_level_cache_bytes", lambda: 0)
    real = QuantizedWeight.matmul
    monkeypatch.setattr(QuantizedWeight, "matmul", lambda w, x: timed.append(w.nbytes) or real(w, x))
    keep = stream.tune(stream.held_weights(module), reps=3)
    assert isinstance(keep, bool) and stream.native_stream_ahead() is keep
    assert timed == [larger.nbytes] * 8  # the largest streamed one only: a warm-up and 3 of each, alternating
    assert stream.tune([floats]) is None  # nothing streamed
