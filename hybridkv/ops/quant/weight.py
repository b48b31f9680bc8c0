"""A weight kept in a GGUF block type, with its product x @ W.T."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.ops import native
from hybridkv.ops.quant.int8_dot import FEW_ROWS, native_q8_dequantize_rows
from hybridkv.ops.quant.k_dot import (
    native_k_dequantize_rows,
    native_repack_q4_k,
    native_tile_q4_k,
    native_tile_q6_k,
    native_tiles_q4_k,
    untiled,
)
from hybridkv.ops.quant.traits import BlockType, GGMLType, block_type, dequantize


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """A linear weight W [out, in] (experts: [E, out, in]) stored as the file stores it: `blocks`
    uint8 [out, row_bytes] ([E, out, row_bytes]), each output row a run of `btype` blocks along
    `in` (a GGUF tensor's ne0). Build it with `of`; `blocks` may be a view of a memory-mapped file.
    """

    blocks: torch.Tensor
    btype: BlockType
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        t, b = self.btype, self.blocks
        if b.dtype != torch.uint8:
            raise TypeError(f"{t.name} weight blocks must be uint8, not {b.dtype}")
        if len(self.shape) not in (2, 3) or b.dim() != len(self.shape):
            raise ValueError(
                f"a weight is [out, in] or [E, out, in]: got shape {self.shape} for blocks {tuple(b.shape)}"
            )
        want = (*self.shape[:-1], t.row_bytes(self.shape[-1]))
        if tuple(b.shape) != want:
            raise ValueError(f"{t.name} weight {self.shape} needs blocks {want}, got {tuple(b.shape)}")

    @classmethod
    def of(cls, blocks: torch.Tensor, type_id: int | GGMLType, shape: tuple[int, ...] | None = None) -> QuantizedWeight:
        """A weight of ggml type `type_id`; `shape` defaults to the one the row bytes imply."""
        t = block_type(type_id)
        if shape is None:
            shape = (*blocks.shape[:-1], t.row_elems(blocks.shape[-1]))
        return cls(blocks, t, tuple(shape))

    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def nbytes(self) -> int:
        """The bytes of its blocks (as a tensor's `nbytes`)."""
        return int(self.blocks.nbytes)

    @property
    def has_kernel(self) -> bool:
        """A C++ block kernel computes on these blocks in place: the type has one (`btype.matmul`)
        and the blocks are contiguous."""
        return self.btype.matmul is not None and self.blocks.is_contiguous()

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.btype.block_bytes / self.btype.block_elems

    def dequantize(self) -> torch.Tensor:
        """W as float32 [*shape], bit-identical to `gguf.quants.dequantize`."""
        return dequantize(self.blocks, self.btype.ggml_type)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a 2-D W as float32 [len(ids), in] (an embedding lookup), the same numbers
        as `dequantize()[ids]`: one C++ call for the types with a block kernel (the twin's dozen
        PyTorch ops took 0.3–0.4 ms of a 0.8B decode step), else the looked-up rows dequantized."""
        t, blocks = self.btype, self.blocks
        if len(self.shape) == 2 and self.has_kernel and native.enabled(ids):
            if t.vec_dot_type == GGMLType.Q8_K:  # the K-quants
                return native_k_dequantize_rows(blocks, ids, int(t.ggml_type))
            return native_q8_dequantize_rows(blocks, ids, int(t.ggml_type))  # the 32-weight types
        if t.ggml_type in (GGMLType.Q4_K_T, GGMLType.Q6_K_T):  # rows interleaved 16 at a time: looked up once untiled
            blocks, file_type = untiled(blocks, t.ggml_type)
            t = block_type(file_type)
        picked = QuantizedWeight(blocks.index_select(0, ids), t, (ids.shape[0], *self.shape[1:]))
        return picked.dequantize()

    def reference_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ W.T → [T, out] float32 on the dequantized weight: the readable twin."""
        return x.float() @ self.dequantize().T

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ W.T → [T, out] float32 (2-D weights). Up to FEW_ROWS rows, the type's own
        product on the blocks where it has one (Q8_0 on Q8_0 activations, the K-quants on Q8_K:
        integer block dots); else dequantize and multiply."""
        if len(self.shape) != 2 or x.dim() != 2 or x.shape[1] != self.shape[1]:
            raise ValueError(f"x {tuple(x.shape)} @ W.T needs x [T, {self.shape[-1]}] and a 2-D W, W is {self.shape}")
        if x.shape[0] <= FEW_ROWS and self.btype.matmul is not None:
            return self.btype.matmul(x.float(), self.blocks.contiguous())
        return self.reference_matmul(x)


def for_kernels(w: QuantizedWeight) -> QuantizedWeight:
    """w in the form the C++ kernels read fastest where they run. Q4_K is repacked (`blocks.repack_q4_k`,
    by its C++ twin; a copy, so the caller releases the file's pages), the one-row product then
    taking each sub-block's scale per vector lane (Zen 4, 2 threads: 1.1-1.5x from the caches,
    1.07-1.17x from memory). On a CPU with the 16-lane kernel (AVX-512 VNNI and VBMI), a weight of
    16·n rows is tiled by 16 rows instead (`blocks.tile_q4_k`): each 64-byte load then 8 weights of
    16 rows, no unpacking. Experts [E, 16·n, ·] tile each expert's rows alike (`kq_experts_matmul`;
    moe-mini's chat turn 1.22x); an embedding too (a lookup untiles its rows, `kq_dequantize_rows`:
    a few KiB a token, where a tied head's product reads them all, decode at batch 1 1.01x). Q6_K
    is tiled alike (`blocks.tile_q6_k`; Zen 4, 2 threads, from the caches: 1.05-1.4x at one row,
    1.3-1.9x at 2-9, ~1.0-1.2x at 56) and otherwise kept. Anything else, or without the kernels: w
    itself."""
    if w.btype.ggml_type not in (GGMLType.Q4_K, GGMLType.Q6_K) or not native.enabled():
        return w
    if len(w.shape) in (2, 3) and w.shape[-2] % 16 == 0 and native_tiles_q4_k():
        rows = w.blocks.reshape(-1, w.blocks.shape[-1])  # experts [E, N, ·]: each expert's rows alike
        if w.btype.ggml_type == GGMLType.Q6_K:
            return QuantizedWeight(native_tile_q6_k(rows).view(w.blocks.shape), block_type(GGMLType.Q6_K_T), w.shape)
        return QuantizedWeight(native_tile_q4_k(rows).view(w.blocks.shape), block_type(GGMLType.Q4_K_T), w.shape)
    if w.btype.ggml_type == GGMLType.Q6_K:  # only tiled: its one-row kernel reads the file's order
        return w
    return QuantizedWeight(native_repack_q4_k(w.blocks), block_type(GGMLType.Q4_K_R), w.shape)
