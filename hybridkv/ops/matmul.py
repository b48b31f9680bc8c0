"""Products with weights stored transposed, [in, out], chosen by how many rows they have.

At decode batch sizes a product only streams its weight from memory, and how fast it streams
depends on the method; prefill products are compute-bound. Float32 ones go to oneDNN's linear
(`torch.ops.mkldnn._linear_pointwise`, what torch.compile's CPU backend calls; `ONEDNN_F32`),
which reads the stored weight as it lies: 1.2-1.9x MKL's `x @ w` at 64 and 512 rows on the
0.8B shape's projections (2 threads, Zen 4, steps alternating); bfloat16 ones to `x @ w`, except
on CPUs without oneDNN's bfloat16 GEMM (no AVX512-BF16 or AMX), where PyTorch's fallback
multiplies at ~1 GFLOP/s (`x @ w`) or ~20 (`F.linear`): those run in float32, the weight widened
a block of columns at a time (~140 GFLOP/s on the same 2-core Zen 3).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from hybridkv.ops import native

# Up to this many rows a product x @ W only streams W from memory.
FEW_ROWS = 32
# Columns (or rows, for mm_t) of a bfloat16 weight widened at once: bounds the float32 copy.
WIDEN_BLOCK = 8192


def _native_bf16_gemm() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


# Whether bfloat16 GEMMs are fast here (oneDNN on AVX512-BF16 / AMX); read once at import.
BF16_GEMM = _native_bf16_gemm()


def _onednn_f32() -> bool:
    """Does oneDNN's float32 linear run here, and agree with MKL on a small product?"""
    try:
        x = torch.linspace(-1, 1, 40 * 64).view(40, 64)
        w = torch.linspace(-2, 3, 64 * 48).view(64, 48)
        y = torch.ops.mkldnn._linear_pointwise(x, w.T, None, "none", [], "")
        return torch.backends.mkldnn.is_available() and torch.allclose(y, x @ w, rtol=1e-5, atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


# Whether float32 prefill products go to oneDNN (else MKL); read once at import.
ONEDNN_F32 = _onednn_f32()


def gemm_t(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ w_t [N, D]ᵀ → [T, N] for many rows of float32 (oneDNN where it runs, else MKL;
    `w_t` may be a transposed view: neither copies it)."""
    if ONEDNN_F32 and x.dtype == torch.float32 and w_t.dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, w_t, None, "none", [], "")
    return F.linear(x, w_t)


def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ w [D, N] → [T, N] in x's dtype.

    Up to FEW_ROWS rows: the C++ kernel (`native.rows_matmul`) reads w once for all rows (AVX2:
    1.2-2.9x MKL at 2-16 rows, measured on Zen 3; AVX-512: register tiles, 1.3-2x). Without it,
    one row at a time on MKL streams w on one core, so split D into one part per thread as one bmm
    and add the parts (~1.5x the bandwidth). More rows: `gemm_t` (bfloat16: see the module
    docstring).
    """
    T, D = x.shape
    if T > FEW_ROWS:
        if w.dtype == torch.bfloat16 and not BF16_GEMM:
            x32 = x.float()
            blocks = [x32 @ w[:, n : n + WIDEN_BLOCK].float() for n in range(0, w.shape[1], WIDEN_BLOCK)]
            return torch.cat(blocks, dim=1).to(x.dtype)
        return gemm_t(x, w.T) if w.dtype == torch.float32 else x @ w
    if native.enabled(x, w):
        y = native.rows_matmul(x, w)
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    parts = torch.get_num_threads()
    if parts == 1 or D % parts or w.dtype != torch.float32:  # (bf16 would round each part)
        return x @ w
    return torch.bmm(x.reshape(T, parts, D // parts).transpose(0, 1), w.view(parts, D // parts, -1)).sum(0)


def mm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, D] @ w [N, D]ᵀ → [T, N] float32: a weight stored [out, in], as a tied lm_head uses the
    embedding [V, D].

    Up to FEW_ROWS rows: the C++ kernel (`native.rows_matmul_t`) reads each row of w once for all
    rows of x (MKL's F.linear reads the weight again per row or two: 1.7-2.9x slower at 2-16 rows)
    and widens bfloat16 weights in registers (a bfloat16 x meets them in AVX512-BF16 pairs where the
    CPU has them). Otherwise F.linear in w's dtype (bfloat16 without a
    fast bfloat16 GEMM: in float32, a block of w's rows widened at a time).
    """
    if x.shape[0] <= FEW_ROWS and native.enabled(x, w):
        return native.rows_matmul_t(x, w)
    if w.dtype == torch.bfloat16 and not BF16_GEMM:
        x32 = x.float()
        return torch.cat([F.linear(x32, w[n : n + WIDEN_BLOCK].float()) for n in range(0, w.shape[0], WIDEN_BLOCK)], 1)
    return gemm_t(x.to(w.dtype), w).float()


class Projection(Protocol):
    """A weight held some other way than a float tensor (`ops.quant.linear.QuantLinear`)."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...

    def native_plan(self) -> tuple[list[torch.Tensor], list[int]] | None: ...


Weight = torch.Tensor | Projection


# How `native.decode_layer` multiplies by a projection (`csrc/layer.cpp`): a float weight by
# `rows_matmul`, K-quant parts by `kq_matmul_parts`, one 32-weight type's blocks by `q8_matmul`;
# parts of those kinds each by its own call, side by side.
FLOAT, K_PARTS, Q8_PART, PARTS = 0, 1, 2, 3


def native_plan(w: Weight) -> tuple[list[torch.Tensor], list[int]] | None:
    """w as `native.decode_layer` reads it: its tensors and its descriptor, the kernel `linear`
    calls for few float32 rows; None where `linear` would not call one kernel."""
    if isinstance(w, torch.Tensor):
        usable = w.dim() == 2 and w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous()
        return ([w], [FLOAT]) if usable else None
    return w.native_plan()


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, D] @ W → [T, N] in x's dtype, for W a float tensor [D, N] (`mm`) or a `Projection`."""
    return mm(x, w) if isinstance(w, torch.Tensor) else w.matmul(x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up [..., 2I] holding gate columns first. Float32 rows: the C++ kernel
    (`native.silu_mul`) in one pass (ATen's two ops on the strided halves took 1.6x its time at 56
    rows of the 0.8B shape, 1.8x at 512)."""
    if gate_up.dim() == 2 and gate_up.dtype == torch.float32 and native.enabled(gate_up):
        return native.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(x: torch.Tensor, gate_up: Weight, down: Weight) -> torch.Tensor:
    """SwiGLU feed-forward with transposed weights: gate_up [D, 2I] gate columns first, down [I, D]."""
    return linear(silu_mul(linear(x, gate_up)), down)
