"""Float weights into GGUF blocks, as llama.cpp's reference quantizers write them.

Q8_0 (`quantize_row_q8_0_ref` in ggml-quants.c): per block of 32, d = max|x| / 127 in float32,
q = roundf(x · (1/d)) (halves away from zero; 0 where d = 0), d stored as float16. Bit-identical
to llama.cpp's and gguf-py's (`gguf.quants.quantize`) blocks.
"""

from __future__ import annotations

import torch

from hybridkv.ops.quant.traits import GGMLType

QUANTIZE_TYPES = {"q8_0": GGMLType.Q8_0}
_ROWS_AT_ONCE = 4096  # rows quantized at once: bounds the temporaries


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


def fits(type_id: GGMLType, in_features: int) -> bool:
    """Whether rows of `in_features` weights split into whole blocks of the type."""
    return in_features % {GGMLType.Q8_0: 32}[type_id] == 0


def quantize(w: torch.Tensor, type_id: GGMLType) -> torch.Tensor:
    """w [..., K] → rows of blocks of `type_id` (one of QUANTIZE_TYPES)."""
    if type_id == GGMLType.Q8_0:
        return quantize_q8_0(w)
    raise ValueError(f"cannot quantize to {type_id.name}; hybridkv quantizes to {', '.join(QUANTIZE_TYPES)}")
