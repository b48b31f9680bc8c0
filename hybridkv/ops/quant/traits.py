"""The traits table: one row per GGUF weight type that hybridkv reads, and the dequantizer driver.

As in llama.cpp's `type_traits`, a row says everything the code needs about a type — block size,
bytes per block, how to dequantize a block, the activation blocks its integer dot pairs with, its
fast few-row product — so the drivers here and in `weight.py` never branch on types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch

from hybridkv.ops.quant import blocks, int8_dot, k_dot


class GGMLType(IntEnum):
    """ggml's type ids, as GGUF tensor infos store them (gguf-py's GGMLQuantizationType)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41
    # hybridkv's own, never in a file: Q4_K with its code bytes repacked at load for the one-row
    # kernel (`blocks.repack_q4_k`).
    Q4_K_R = 1012
    # Q4_K tiled by 16 rows at load for the 16-lane kernel (`blocks.tile_q4_k`): 2-D weights whose
    # row count is a multiple of 16, on CPUs with AVX-512 VNNI and VBMI.
    Q4_K_T = 1013
    # Q6_K tiled likewise (`blocks.tile_q6_k`)
    Q6_K_T = 1014


BlockFn = Callable[[torch.Tensor], torch.Tensor]
MatmulFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class BlockType:
    """How one weight type stores a row: runs of `block_elems` weights in `block_bytes` each.

    dequantize_blocks: uint8 [B, block_bytes] → float32 [B, block_elems], bit-identical to gguf-py.
    vec_dot_type: the 8-bit activation blocks llama.cpp's integer dot pairs this type with (None:
    float activations).
    matmul: x [T, in] float32, rows uint8 [out, row_bytes] → x @ W.T [T, out] float32 for few rows,
    on the blocks as stored; None where not written yet (`QuantizedWeight` then dequantizes).
    """

    ggml_type: GGMLType
    block_elems: int
    block_bytes: int
    dequantize_blocks: BlockFn
    vec_dot_type: GGMLType | None = None
    matmul: MatmulFn | None = None

    @property
    def name(self) -> str:
        return self.ggml_type.name

    def row_bytes(self, row_elems: int) -> int:
        """Bytes of a row of `row_elems` weights (a whole number of blocks)."""
        if row_elems % self.block_elems:
            raise ValueError(f"{self.name} rows hold multiples of {self.block_elems} weights, not {row_elems}")
        return row_elems // self.block_elems * self.block_bytes

    def row_elems(self, row_bytes: int) -> int:
        """Weights in a row of `row_bytes` bytes (a whole number of blocks)."""
        if row_bytes % self.block_bytes:
            raise ValueError(f"{self.name} rows are multiples of {self.block_bytes} bytes, not {row_bytes}")
        return row_bytes // self.block_bytes * self.block_elems


_T = GGMLType
# vec_dot_type as in llama.cpp's ggml-cpu type_traits_cpu: Q8_0 for the 32-weight symmetric types,
# Q8_1 (which carries each block's sum) for the ones with a min, Q8_K for the K-quants.
TRAITS: dict[GGMLType, BlockType] = {
    t.ggml_type: t
    for t in (
        BlockType(_T.F32, 1, 4, blocks.f32),
        BlockType(_T.F16, 1, 2, blocks.f16),
        BlockType(_T.BF16, 1, 2, blocks.bf16),
        BlockType(_T.Q8_0, 32, 34, blocks.q8_0, _T.Q8_0, int8_dot.q8_matmul(_T.Q8_0)),
        BlockType(_T.Q4_0, 32, 18, blocks.q4_0, _T.Q8_0, int8_dot.q8_matmul(_T.Q4_0)),
        BlockType(_T.Q4_1, 32, 20, blocks.q4_1, _T.Q8_1, int8_dot.q8_matmul(_T.Q4_1)),
        BlockType(_T.Q5_0, 32, 22, blocks.q5_0, _T.Q8_0, int8_dot.q8_matmul(_T.Q5_0)),
        BlockType(_T.Q5_1, 32, 24, blocks.q5_1, _T.Q8_1, int8_dot.q8_matmul(_T.Q5_1)),
        BlockType(_T.IQ4_NL, 32, 18, blocks.iq4_nl, _T.Q8_0, int8_dot.q8_matmul(_T.IQ4_NL)),
        BlockType(_T.Q2_K, 256, 84, blocks.q2_k, _T.Q8_K, k_dot.k_matmul(_T.Q2_K)),
        BlockType(_T.Q3_K, 256, 110, blocks.q3_k, _T.Q8_K, k_dot.k_matmul(_T.Q3_K)),
        BlockType(_T.Q4_K, 256, 144, blocks.q4_k, _T.Q8_K, k_dot.k_matmul(_T.Q4_K)),
        BlockType(_T.Q5_K, 256, 176, blocks.q5_k, _T.Q8_K, k_dot.k_matmul(_T.Q5_K)),
        BlockType(_T.Q6_K, 256, 210, blocks.q6_k, _T.Q8_K, k_dot.k_matmul(_T.Q6_K)),
        BlockType(_T.Q4_K_R, 256, 144, blocks.q4_k_r, _T.Q8_K, k_dot.k_matmul(_T.Q4_K_R)),
        BlockType(_T.Q4_K_T, 256, 144, blocks.q4_k_t, _T.Q8_K, k_dot.k_matmul(_T.Q4_K_T)),
        BlockType(_T.Q6_K_T, 256, 210, blocks.q6_k_t, _T.Q8_K, k_dot.k_matmul(_T.Q6_K_T)),
    )
}
# Types that exist only in memory: never read from or written to a file.
IN_MEMORY = frozenset({GGMLType.Q4_K_R, GGMLType.Q4_K_T, GGMLType.Q6_K_T})


class UnsupportedTypeError(ValueError):
    """A tensor's ggml type is not in the traits table (the caller adds the tensor's name)."""


def block_type(type_id: int | GGMLType) -> BlockType:
    """The traits row of a ggml type id; UnsupportedTypeError naming the type if hybridkv cannot read it."""
    try:
        return TRAITS[GGMLType(type_id)]
    except (KeyError, ValueError):
        name = GGMLType(type_id).name if type_id in GGMLType._value2member_map_ else "unknown"
        readable = ", ".join(TRAITS[t].name for t in sorted(TRAITS) if t not in IN_MEMORY)
        raise UnsupportedTypeError(
            f"ggml type {name} (id {int(type_id)}) is not supported; hybridkv reads {readable}"
        ) from None


# Weights dequantized per step: large enough that per-op overhead is small, small enough that the
# temporaries (a few times 4 bytes per weight) stay in the caches.
CHUNK_ELEMS = 1 << 20


def dequantize(rows: torch.Tensor, type_id: int | GGMLType, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of blocks uint8 [..., row_bytes] → float32 [..., row_elems], bit-identical to
    `gguf.quants.dequantize`, a few rows at a time into `out` (contiguous float32, default new).
    Without `out`, F32 rows come back as a view of `rows`."""
    t = block_type(type_id)
    if rows.dtype != torch.uint8:
        raise TypeError(f"{t.name} rows must be uint8 block bytes, not {rows.dtype}")
    if t.ggml_type in (GGMLType.Q4_K_T, GGMLType.Q6_K_T):  # whole tiles of 16 rows: untiled first
        return dequantize(*k_dot.untiled(rows, t.ggml_type), out)
    *lead, row_bytes = rows.shape
    row_elems = t.row_elems(row_bytes)
    if out is None and t.ggml_type == GGMLType.F32:
        return t.dequantize_blocks(rows).view(*lead, row_elems)
    if out is None:
        out = torch.empty(*lead, row_elems, dtype=torch.float32)
    elif out.shape != (*lead, row_elems) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 {(*lead, row_elems)}, got {out.dtype} {tuple(out.shape)}")
    flat, flat_out = rows.reshape(-1, row_bytes), out.view(-1, row_elems)
    step = max(1, CHUNK_ELEMS // max(row_elems, 1))
    for r in range(0, flat.shape[0], step):
        chunk = flat[r : r + step].reshape(-1, t.block_bytes)
        flat_out[r : r + step] = t.dequantize_blocks(chunk).view(-1, row_elems)
    return out
