"""GGUF weight types against gguf-py (the independent reference), and the integer matmul of the
32-weight types (Q8_0, Q4_0, Q5_0, IQ4_NL; Q4_1, Q5_1 with their min) against its NumPy emulation:
activation blocks and integer block sums exactly, floats to rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from op_checks import assert_close

from hybridkv.ops import native
from hybridkv.ops.quant import (
    TRAITS,
    BlockType,
    GGMLType,
    QuantizedWeight,
    UnsupportedTypeError,
    block_type,
    int8_dot,
    traits,
)
from hybridkv.ops.quant import blocks as block_fns
from hybridkv.ops.quant import dequantize as dequantize_rows

gguf = pytest.importorskip("gguf")
needs_native = pytest.mark.skipif(native.kernels() is None, reason="C++ kernels could not be built here")

# Byte offsets of each block type's fp16 scales: random bytes there could be NaN or inf.
F16_FIELDS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "IQ4_NL": [0]}
F16_FIELDS |= {"Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16}


def random_rows(t: BlockType, lead: tuple[int, ...], row_elems: int, seed: int) -> np.ndarray:
    """Valid rows of type t, uint8 [*lead, row_bytes]: random bytes with finite nonzero random fp16
    scales (any other byte pattern is a valid block); random normal values for the float types."""
    rng = np.random.default_rng(seed)
    if t.block_elems == 1:
        values = rng.standard_normal((*lead, row_elems)).astype(np.float32)
        if t.name == "BF16":
            return torch.from_numpy(values).bfloat16().view(torch.uint8).numpy()
        return values.astype(FLOAT_DTYPES[t.name]).view(np.uint8)
    nb = row_elems // t.block_elems
    blocks = rng.integers(0, 256, (*lead, nb, t.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[t.name]:
        scales = (rng.standard_normal((*lead, nb, 1)) * rng.choice([1e-3, 0.05, 3.0])).astype(np.float16)
        # Nonzero: a block with d = 0 has all-zero weights, from which the emulation cannot read its codes.
        scales[scales == 0] = np.float16(1e-3)
        blocks[..., at : at + 2] = scales.view(np.uint8)
    return blocks.reshape(*lead, nb * t.block_bytes)


def gguf_dequantize(rows: np.ndarray, t: BlockType) -> np.ndarray:
    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(t.ggml_type)))


def assert_bit_identical(actual: torch.Tensor, expected: np.ndarray) -> None:
    assert actual.dtype == torch.float32 and tuple(actual.shape) == expected.shape, (actual.shape, expected.shape)
    differ = (actual.view(torch.int32).numpy() != expected.view(np.int32)).sum()
    assert differ == 0, f"{differ} of {expected.size} weights differ from gguf-py"


TYPES = [t for t in TRAITS.values() if t.ggml_type not in traits.IN_MEMORY]  # the file types


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("lead", [(), (1,), (7,), (3, 5)], ids=["vector", "one-row", "odd-rows", "experts"])
def test_dequantize_is_bit_identical_to_gguf(t: BlockType, lead: tuple[int, ...]) -> None:
    rows = random_rows(t, lead, 3 * max(t.block_elems, 32), seed=sum(lead) + 7 * len(lead))
    assert_bit_identical(dequantize_rows(torch.from_numpy(rows), t.ggml_type), gguf_dequantize(rows, t))


@pytest.mark.parametrize("t", [block_type(GGMLType.Q4_K), block_type(GGMLType.Q5_0)], ids=lambda t: t.name)
def test_dequantize_in_chunks_into_out(t: BlockType, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 3 rows over 13 (a short last chunk); then chunks smaller than one row.
    rows = random_rows(t, (13,), 1024, seed=1)
    want = gguf_dequantize(rows, t)
    for chunk in (3 * 1024, 100):
        monkeypatch.setattr(traits, "CHUNK_ELEMS", chunk)
        out = torch.full((13, 1024), float("nan"))
        assert dequantize_rows(torch.from_numpy(rows), t.ggml_type, out=out) is out
        assert_bit_identical(out, want)
    with pytest.raises(ValueError, match=r"out must be contiguous float32 \(13, 1024\)"):
        dequantize_rows(torch.from_numpy(rows), t.ggml_type, out=torch.empty(13, 512))


@pytest.mark.parametrize(("type_id", "name"), [(16, "IQ2_XXS"), (23, "IQ4_XS"), (39, "MXFP4"), (99, "unknown")])
def test_unsupported_types_are_named(type_id: int, name: str) -> None:
    with pytest.raises(UnsupportedTypeError, match=rf"ggml type {name} \(id {type_id}\) is not supported.*Q6_K"):
        block_type(type_id)
    with pytest.raises(UnsupportedTypeError, match=name):
        QuantizedWeight.of(torch.zeros(2, 84, dtype=torch.uint8), type_id)


def test_weight_shape_must_match_its_blocks() -> None:
    blocks = torch.zeros(4, 3 * 34, dtype=torch.uint8)
    assert QuantizedWeight.of(blocks, GGMLType.Q8_0).shape == (4, 96)
    with pytest.raises(ValueError, match=r"Q8_0 rows are multiples of 34 bytes, not 100"):
        QuantizedWeight.of(torch.zeros(4, 100, dtype=torch.uint8), GGMLType.Q8_0)
    with pytest.raises(ValueError, match=r"Q8_0 weight \(4, 128\) needs blocks \(4, 136\)"):
        QuantizedWeight.of(blocks, GGMLType.Q8_0, (4, 128))
    with pytest.raises(ValueError, match=r"Q4_K rows hold multiples of 256 weights, not 96"):
        QuantizedWeight.of(blocks, GGMLType.Q4_K, (4, 96))
    with pytest.raises(TypeError, match="must be uint8"):
        QuantizedWeight.of(blocks.float(), GGMLType.Q8_0)


def test_expert_weights_dequantize_per_expert() -> None:
    t = block_type(GGMLType.Q6_K)
    rows = random_rows(t, (3, 5), 512, seed=3)
    w = QuantizedWeight.of(torch.from_numpy(rows), GGMLType.Q6_K)
    assert w.shape == (3, 5, 512) and w.bits_per_weight == 6.5625
    assert_bit_identical(w.dequantize(), gguf_dequantize(rows, t))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 3, 40])
def test_reference_matmul_is_a_float64_matmul_up_to_summation_order(t: BlockType, T: int) -> None:
    K = 2 * max(t.block_elems, 32) if t.block_elems > 1 else 96
    rows = random_rows(t, (37,), K, seed=T)
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T))
    want = x.double() @ torch.from_numpy(gguf_dequantize(rows, t)).double().T
    w = QuantizedWeight.of(torch.from_numpy(rows), t.ggml_type)
    assert_close(w.reference_matmul(x), want, rel=1e-6 * K**0.5)
    if t.matmul is None or T > int8_dot.FEW_ROWS:  # otherwise 8-bit activations: the tests below
        assert_close(w.matmul(x), want, rel=1e-6 * K**0.5)


# --- Q8_0, Q4_0, Q5_0, IQ4_NL with 8-bit activations -------------------------------------------

WITH_MIN = [GGMLType.Q4_1, GGMLType.Q5_1]  # weight = d·code + m
TYPES32 = [GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.IQ4_NL, *WITH_MIN]


def emulate_quantize_rows_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The activation blocks, written from the spec in NumPy float32: d = max|x|/127, q = rint(x·(1/d))."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int8)
    return q.reshape(x.shape), d


def emulate_block_sums(xq: np.ndarray, rows: np.ndarray, t: GGMLType = GGMLType.Q8_0) -> np.ndarray:
    """Integer block sums [T, N, nb] of activation blocks with rows of type t, in int64. The weight
    codes come from gguf-py's dequantized values over the block's fp16 d (d·code is exact in float32:
    an 11-bit d times a code of at most 8 bits); for the types with a min (weight = d·code + m) from
    the block's bits, checked against gguf-py's values."""
    T, N = xq.shape[0], rows.shape[0]
    bt = block_type(t)
    blocks = rows.reshape(N, -1, bt.block_bytes)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    w = gguf_dequantize(rows, bt).reshape(N, -1, 32)
    if t in WITH_MIN:
        m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[..., 4:20] if t == GGMLType.Q4_1 else blocks[..., 8:24]
        wq = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
        if t == GGMLType.Q5_1:
            qh = blocks[..., 4:8].copy().view(np.uint32)
            wq |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
        assert np.array_equal((wq * d + m).astype(np.float32), w)
    else:
        wq = np.rint(w / d).astype(np.int64)
        assert np.array_equal((wq * d).astype(np.float32), w) and np.abs(wq).max() <= 128
    return np.einsum("tbk,nbk->tnb", xq.reshape(T, -1, 32).astype(np.int64), wq)


def activations(T: int, K: int, seed: int) -> torch.Tensor:
    """Random rows with the cases that matter: a zero block, exact rounding ties, mixed scales."""
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-3, 1, K)
    x[0, :32] = 0
    if K >= 64:
        x[0, 32:64] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5] + [3.0] * 25)  # d = 1: ties
    return x


def rows32(N: int, K: int, seed: int, quantized: bool, t: GGMLType = GGMLType.Q8_0) -> np.ndarray:
    """Rows of type t by gguf-py's quantizer (where it has one), or random blocks (every code)."""
    if quantized:
        w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
        try:
            return gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(t)))
        except NotImplementedError:
            pass
    return random_rows(block_type(t), (N,), K, seed)


SHAPES = [(1, 32, 1), (1, 608, 37), (3, 96, 5), (7, 256, 17), (5, 256, 9), (32, 608, 9), (70, 96, 91)]
# (T, K, N). 608 = 19 blocks: 2 x 8 and 3. 70 x 91: two tiles of activation rows against 5 groups of
# 16 weight rows (two chunks: 4 + 1), then a group of 8 and 3 single rows; N = 9 and 17 the tails alone.
# 5 x 256 x 9: the tail row's 5 activation rows as 4 + 1, the last one on 512-bit block pairs


@pytest.mark.parametrize(("T", "K"), [(1, 32), (5, 96), (7, 608)])
def test_activation_blocks_match_the_emulation(T: int, K: int) -> None:
    x = activations(T, K, seed=K)
    want_q, want_d = emulate_quantize_rows_q8(x.numpy())
    got = int8_dot.quantize_rows_q8(x)
    assert np.array_equal(got.q.numpy(), want_q) and np.array_equal(got.d.numpy(), want_d)
    if K >= 64:
        assert got.q[0, 32:39].tolist() == [127, 0, 2, 2, 0, -2, -2]  # ties to even
    if native.kernels() is not None:
        got = int8_dot.native_quantize_rows_q8(x)
        assert np.array_equal(got.q.numpy(), want_q) and np.array_equal(got.d.numpy(), want_d)


@pytest.mark.parametrize("t", TYPES32, ids=lambda t: t.name)
@pytest.mark.parametrize(("T", "K", "N"), SHAPES)
@pytest.mark.parametrize("quantized", [True, False], ids=["gguf-quantized", "random-blocks"])
def test_block_sums_equal_the_emulation_exactly(t: GGMLType, T: int, K: int, N: int, quantized: bool) -> None:
    x = activations(T, K, seed=N)
    rows = rows32(N, K, seed=T, quantized=quantized, t=t)
    xq = int8_dot.quantize_rows_q8(x)
    want = emulate_block_sums(xq.q.numpy(), rows, t)
    w = torch.from_numpy(rows)
    assert np.array_equal(int8_dot.block_sums(xq, int8_dot.split_rows(w, t)).numpy(), want)
    for isa in int8_dot.available_isas():
        assert np.array_equal(int8_dot.native_block_sums(xq, w, t, isa).numpy(), want), isa


@pytest.mark.parametrize("t", TYPES32, ids=lambda t: t.name)
@pytest.mark.parametrize(("T", "K", "N"), SHAPES)
@pytest.mark.parametrize("quantized", [True, False], ids=["gguf-quantized", "random-blocks"])
def test_q8_matmul_twin_against_float64_on_dequantized_blocks(
    t: GGMLType, T: int, K: int, N: int, quantized: bool
) -> None:
    # Exactly the integer path's math in float64: dequantized activation blocks @ gguf's weights.
    x = activations(T, K, seed=N)
    rows = rows32(N, K, seed=T, quantized=quantized, t=t)
    xq = int8_dot.quantize_rows_q8(x)
    x_blocks = xq.q.double().reshape(T, -1, 32) * xq.d.double()[..., None]
    w = torch.from_numpy(gguf_dequantize(rows, block_type(t))).double()
    want = x_blocks.reshape(T, K) @ w.T
    got = int8_dot.q8_matmul_twin(x, torch.from_numpy(rows), t)
    assert_close(got, want, rel=1e-6 * K**0.5)
    # Against float activations: off by the activations' rounding (up to 1/254 of a block's max, each).
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(K))
    assert_close(int8_dot.q8_matmul_twin(x, torch.from_numpy(rows), t), x.double() @ w.T, rel=3e-2)


@needs_native
@pytest.mark.parametrize("t", TYPES32, ids=lambda t: t.name)
@pytest.mark.parametrize(("T", "K", "N"), SHAPES)
@pytest.mark.parametrize("quantized", [True, False], ids=["gguf-quantized", "random-blocks"])
def test_native_q8_matmul_equals_the_twin(t: GGMLType, T: int, K: int, N: int, quantized: bool) -> None:
    x = activations(T, K, seed=N)
    rows = torch.from_numpy(rows32(N, K, seed=T, quantized=quantized, t=t))
    want = int8_dot.q8_matmul_twin(x, rows, t)
    for isa in int8_dot.available_isas():
        assert_close(int8_dot.native_q8_matmul(x, rows, t, isa), want, rel=1e-6)


@pytest.mark.parametrize("t", [t.ggml_type for t in TRAITS.values()], ids=lambda t: t.name)
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "pytorch"])
def test_weight_rows_are_the_dequantized_rows_bit_for_bit(
    t: GGMLType, use_native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An embedding lookup on a file's blocks (`QuantizedWeight.rows`; one C++ call for the types
    with a kernel): exactly gguf-py's rows, by the kernel and by the twin."""
    monkeypatch.setattr(native, "disabled", not use_native)
    V, K = 16 if t in (GGMLType.Q4_K_T, GGMLType.Q6_K_T) else 13, 512  # tiled rows come 16 at a time
    file_t = {GGMLType.Q4_K_R: GGMLType.Q4_K, GGMLType.Q4_K_T: GGMLType.Q4_K, GGMLType.Q6_K_T: GGMLType.Q6_K}.get(t, t)
    rows = random_rows(block_type(file_t), (V,), K, seed=V)
    w = QuantizedWeight.of(torch.from_numpy(rows), file_t)
    if t == GGMLType.Q4_K_R:
        w = QuantizedWeight(block_fns.repack_q4_k(w.blocks), block_type(t), w.shape)
    if t == GGMLType.Q4_K_T:
        w = QuantizedWeight(block_fns.tile_q4_k(w.blocks), block_type(t), w.shape)
    if t == GGMLType.Q6_K_T:
        w = QuantizedWeight(block_fns.tile_q6_k(w.blocks), block_type(t), w.shape)
    ids = torch.tensor([12, 0, 7, 7, V - 1])
    want = torch.from_numpy(gguf_dequantize(rows[ids.numpy()], block_type(file_t))).float().view(len(ids), K)
    assert torch.equal(w.rows(ids), want)
    if use_native and native.kernels() is not None and block_type(t).matmul is not None:
        with pytest.raises(RuntimeError, match=f"row {V} out of range for {V} rows"):
            w.rows(torch.tensor([V]))


@needs_native
@pytest.mark.parametrize("t", TYPES32, ids=lambda t: t.name)
def test_native_q8_experts_matmul_equals_each_experts_product(t: GGMLType) -> None:
    E, N, K = 3, 9, 96
    rows = torch.from_numpy(np.stack([rows32(N, K, seed=e, quantized=False, t=t) for e in range(E)]))
    x, ids = activations(5, K, seed=3), torch.tensor([2, 0, 2, 1, 0])
    want = torch.cat([int8_dot.q8_matmul_twin(x[p : p + 1], rows[e], t) for p, e in enumerate(ids.tolist())])
    for isa in int8_dot.available_isas():
        assert_close(int8_dot.native_q8_experts_matmul(x, rows, ids, t, isa), want, rel=1e-6)
        # each token's row for its k = 2 pairs, quantized once: as given the row k times
        pairs = torch.tensor([2, 0, 1, 1, 0, 2, 1, 0, 2, 2])
        assert torch.equal(
            int8_dot.native_q8_experts_matmul(x, rows, pairs, t, isa),
            int8_dot.native_q8_experts_matmul(x.repeat_interleave(2, 0), rows, pairs, t, isa),
        )
    with pytest.raises(RuntimeError, match="multiple of x's 5 rows"):
        int8_dot.native_q8_experts_matmul(x, rows, ids[:4], t)


@needs_native
def test_native_q8_names_what_does_not_match() -> None:
    x, rows = torch.randn(2, 64), torch.zeros(3, 68, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="activations of 96 features need Q8_0 rows of 102 bytes"):
        int8_dot.native_q8_matmul(torch.randn(2, 96), rows)
    with pytest.raises(RuntimeError, match="activations of 64 features need Q5_0 rows of 44 bytes"):
        int8_dot.native_q8_matmul(x, rows, GGMLType.Q5_0)
    with pytest.raises(RuntimeError, match="isa 'sse' is not available"):
        int8_dot.native_q8_matmul(x, rows, GGMLType.Q8_0, "sse")
    with pytest.raises(RuntimeError, match="ggml type 12 has no 8-bit-activation kernel"):
        int8_dot.native_q8_matmul(x, rows, GGMLType.Q4_K)


@pytest.mark.parametrize("t", TYPES32, ids=lambda t: t.name)
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "pytorch"])
def test_32_weight_matmul_takes_the_integer_path_for_few_rows(
    t: GGMLType, use_native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if use_native and native.kernels() is None:
        pytest.skip("C++ kernels could not be built here")
    monkeypatch.setattr(native, "disabled", not use_native)
    rows = torch.from_numpy(rows32(9, 256, seed=0, quantized=True, t=t))
    w = QuantizedWeight.of(rows, t)
    few, many = activations(3, 256, seed=1), activations(int8_dot.FEW_ROWS + 1, 256, seed=2)
    assert_close(w.matmul(few), int8_dot.q8_matmul_twin(few, rows, t), rel=1e-6)
    assert torch.equal(w.matmul(many), w.reference_matmul(many))
