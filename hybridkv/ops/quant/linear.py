"""Projections whose weights stay in the file's blocks: what a model built from a GGUF file holds.

A model's projection is `x @ W` with W stored [in, out] as a float tensor (`ops.matmul.mm`), or a
`QuantLinear`: the same product with W's output features split into parts, each either the file's
blocks (`QuantizedWeight` [out_i, in], multiplied on the blocks) or a float tensor [in, out_i] for
parts whose type has no block kernel (dequantized once at load). Parts are what a fused projection
is made of when its tensors differ in type (a Q4_K_M file keeps a few tensors in Q6_K or F32).
`QuantExperts` is the same per expert, on [E, out_i, in] blocks.

A block part runs its type's integer kernel (each activation row quantized to 8-bit blocks once,
llama.cpp's scheme) for any number of rows: decode and prefill then round activations alike, so a
cached decode step equals a fresh recompute up to summation order. For prefill the other choice,
a tile of the weight dequantized into a float32 GEMM, measured slower here: a [512, 1024] @
Q8_0 [6144, 1024]ᵀ product took 289 ms by the integer kernel and 660 ms dequantizing (PyTorch's
dequantizer: 370 ms of it), against 232 ms for the float32 GEMM (2 loaded Zen 3 cores). Types
without a kernel, and everything under `float_activations()`, dequantize a tile at a time:
`float_activations()` is the float reference the tests compare the integer paths against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridkv.ops import native
from hybridkv.ops.matmul import FLOAT, K_PARTS, PARTS, Q8_PART, mm
from hybridkv.ops.quant.int8_dot import native_q8_experts_matmul, native_q8_matmul
from hybridkv.ops.quant.k_dot import native_k_experts_matmul, native_k_matmul_parts
from hybridkv.ops.quant.traits import GGMLType
from hybridkv.ops.quant.weight import QuantizedWeight
from hybridkv.ops.thread_flag import ThreadFlag

# Rows of a weight dequantized at once for a many-row product: bounds the float32 copy (16 MiB at
# 1024 features) while each tile is a GEMM large enough for MKL.
TILE_ROWS = 4096
_FLOAT = ThreadFlag()


def floating() -> bool:
    """Whether this thread is inside `float_activations()`."""
    return bool(_FLOAT)


def float_activations() -> contextlib.AbstractContextManager[None]:
    """Within this block every block product dequantizes its weight and multiplies in float32."""
    return _FLOAT.set()


def block_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [T, in] @ Wᵀ for a 2-D block weight → [T, out] float32: the type's integer kernel, else
    (and under `float_activations`) the weight dequantized a tile of rows at a time into a GEMM."""
    if w.btype.matmul is not None and not floating():
        return w.btype.matmul(x.float(), w.blocks.contiguous())
    x32 = x.float()
    out = torch.empty(x.shape[0], w.shape[0])
    for n in range(0, w.shape[0], TILE_ROWS):
        tile = QuantizedWeight(w.blocks[n : n + TILE_ROWS], w.btype, (min(TILE_ROWS, w.shape[0] - n), w.shape[1]))
        out[:, n : n + tile.shape[0]] = F.linear(x32, tile.dequantize())
    return out


Part = QuantizedWeight | torch.Tensor


def _float_part(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w for a float part of a projection: float32 by `native.rows_matmul` at any row count
    (its kernel, MKL's GEMM past FEW_ROWS), the call `native.decode_layer` makes for it, so that
    a layer run op by op gives its numbers (an expert layer's router past 32 tokens); else `mm`."""
    if x.dtype == w.dtype == torch.float32 and w.dim() == 2 and native.enabled(x, w):
        return native.rows_matmul(x, w)
    return mm(x, w)


def _part_out(part: Part) -> int:
    return part.shape[-2] if isinstance(part, QuantizedWeight) else part.shape[-1]


def _part_numel(part: Part) -> int:
    n = 1
    for size in part.shape:
        n *= size
    return n


@dataclass(frozen=True, slots=True)
class QuantLinear:
    """x @ W for W [in, out] held as `parts` along out: each a `QuantizedWeight` [out_i, in] or a
    float tensor [in, out_i] (applied with `ops.matmul.mm`)."""

    parts: tuple[Part, ...]
    # Every part a K-quant's blocks, contiguous, with a kernel: (blocks, ggml types) for one call of
    # `native_k_matmul_parts` (the activations quantized once, no concatenation); else None.
    k_parts: tuple[tuple[torch.Tensor, ...], tuple[int, ...]] | None = field(
        init=False, default=None, repr=False, compare=False
    )
    # One part of a 32-weight type (Q8_0, Q5_0, ...) with a kernel: (blocks, ggml type) for a direct
    # `native_q8_matmul` call (the Python of `block_matmul` and the traits table skipped); else None.
    q8_part: tuple[torch.Tensor, int] | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        ins = {p.shape[-1] if isinstance(p, QuantizedWeight) else p.shape[0] for p in self.parts}
        if not self.parts or len(ins) != 1 or any(p.dim() != 2 for p in self.parts if isinstance(p, torch.Tensor)):
            raise ValueError(f"a projection's parts must share their input features, got {self.shapes}")
        blocks = [p for p in self.parts if isinstance(p, QuantizedWeight) and p.has_kernel]
        if len(blocks) == len(self.parts) and all(p.btype.vec_dot_type == GGMLType.Q8_K for p in blocks):
            types = tuple(int(p.btype.ggml_type) for p in blocks)
            object.__setattr__(self, "k_parts", (tuple(p.blocks for p in blocks), types))
        if len(blocks) == len(self.parts) == 1 and blocks[0].btype.vec_dot_type in (GGMLType.Q8_0, GGMLType.Q8_1):
            object.__setattr__(self, "q8_part", (blocks[0].blocks, int(blocks[0].btype.ggml_type)))

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(p.shape) for p in self.parts]

    @property
    def in_features(self) -> int:
        p = self.parts[0]
        return p.shape[-1] if isinstance(p, QuantizedWeight) else p.shape[0]

    @property
    def out_features(self) -> int:
        return sum(_part_out(p) for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def numel(self) -> int:
        return sum(_part_numel(p) for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] @ W → [T, out] in x's dtype."""
        direct = self.k_parts is not None or self.q8_part is not None
        if direct and not floating() and native.enabled(x):
            if self.k_parts is not None:
                return native_k_matmul_parts(x.float(), *self.k_parts).to(x.dtype)
            if self.q8_part is not None:
                return native_q8_matmul(x.float(), *self.q8_part).to(x.dtype)
        ys = [block_matmul(x, p) if isinstance(p, QuantizedWeight) else _float_part(x, p) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat([y.float() for y in ys], dim=-1)
        return y.to(x.dtype)

    def native_plan(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """This projection as `native.decode_layer` reads it (its tensors, its descriptor: see
        `csrc/layer.cpp`): the kernel calls `matmul` makes for few float32 rows, one for all the
        parts or one per part; None where some part has no kernel."""
        if self.k_parts is not None:
            blocks, types = self.k_parts
            return list(blocks), [K_PARTS, len(types), *types]
        if self.q8_part is not None:
            return [self.q8_part[0]], [Q8_PART, self.q8_part[1]]
        ints = [PARTS, len(self.parts)]
        for p in self.parts:  # each part its own kernel, as the loop in `matmul`
            if isinstance(p, QuantizedWeight) and p.has_kernel:
                ints += [K_PARTS if p.btype.vec_dot_type == GGMLType.Q8_K else Q8_PART, int(p.btype.ggml_type)]
            elif isinstance(p, torch.Tensor) and p.dtype in (torch.float32, torch.bfloat16) and p.is_contiguous():
                ints.append(FLOAT)
            else:
                return None
        return [p.blocks if isinstance(p, QuantizedWeight) else p for p in self.parts], ints

    def dequantize(self) -> torch.Tensor:
        """W [in, out] as float32: the reference."""
        return torch.cat([p.dequantize().T if isinstance(p, QuantizedWeight) else p.float() for p in self.parts], 1)


@dataclass(frozen=True, slots=True)
class QuantExperts:
    """E experts' projections x @ W_e, W_e [in, out], held as `parts` along out: each a
    `QuantizedWeight` [E, out_i, in] or a float tensor [E, in, out_i]; `expert(e)` is expert e's."""

    parts: tuple[Part, ...]

    @property
    def num_experts(self) -> int:
        return self.parts[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def numel(self) -> int:
        return sum(_part_numel(p) for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The experts' W [E, in, out] as float32: the reference."""
        return torch.cat([p.dequantize().mT if isinstance(p, QuantizedWeight) else p.float() for p in self.parts], -1)

    def native_plan(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """These experts as `native.decode_layer` reads them (see `csrc/layer.cpp`): each part's
        blocks and (whether a 32-weight type, its ggml type), the kernels `pairs_matmul` calls;
        None where it would not call one per part."""
        parts = [p for p in self.parts if isinstance(p, QuantizedWeight) and p.has_kernel]
        if len(parts) != len(self.parts):
            return None
        ints = [len(parts)]
        for p in parts:
            ints += [int(p.btype.block_elems == 32), int(p.btype.ggml_type)]
        return [p.blocks for p in parts], ints

    def expert(self, e: int) -> QuantLinear:
        return QuantLinear(tuple(_expert_part(p, e) for p in self.parts))

    def pairs_in_one_call(self, x: torch.Tensor) -> bool:
        """Whether `pairs_matmul` runs every part as one kernel call (else pair by pair)."""
        return all(_pairs_kernel(x, p) for p in self.parts)

    def pairs_matmul(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Row p·T/P of x [T, in] times expert ids[p]'s W → [P, out] in x's dtype (P = len(ids) a
        multiple of T: each token's row serves its P/T consecutive pairs, quantized once): every
        (token, expert) pair of a decode step or chunk in one kernel call per part."""
        if x.dim() != 2 or ids.dim() != 1 or (ids.shape[0] % x.shape[0] if x.shape[0] else ids.shape[0]):
            raise ValueError(
                f"pairs_matmul takes x [T, in] and a multiple of T expert ids, got {tuple(x.shape)}, {tuple(ids.shape)}"
            )
        ys = [_pairs_part(x, p, ids) for p in self.parts]
        return (ys[0] if len(ys) == 1 else torch.cat([y.float() for y in ys], dim=-1)).to(x.dtype)


def _expert_part(p: Part, e: int) -> Part:
    return QuantizedWeight(p.blocks[e], p.btype, p.shape[1:]) if isinstance(p, QuantizedWeight) else p[e]


def _pairs_kernel(x: torch.Tensor, part: Part) -> bool:
    """Whether a part's (token, expert) products run in one C++ call."""
    return (
        isinstance(part, QuantizedWeight)
        and part.btype.matmul is not None
        and not floating()
        and native.enabled(x, part.blocks)
    )


def _pairs_part(x: torch.Tensor, part: Part, ids: torch.Tensor) -> torch.Tensor:
    """x [T, in] row p·T/P @ (expert ids[p]'s part)ᵀ, pair by pair → [P, out_i] float32."""
    if _pairs_kernel(x, part) and isinstance(part, QuantizedWeight):
        blocks = part.blocks.contiguous()
        if part.btype.block_elems == 32:  # Q8_0, Q5_0, Q4_0, IQ4_NL
            return native_q8_experts_matmul(x.float(), blocks, ids, int(part.btype.ggml_type))
        return native_k_experts_matmul(x.float(), blocks, ids, int(part.btype.ggml_type))
    # without the kernels (or under float_activations): each pair through its expert's own product
    per = ids.shape[0] // max(x.shape[0], 1)
    rows = [
        QuantLinear((_expert_part(part, e),)).matmul(x[p // per : p // per + 1]).float()
        for p, e in enumerate(ids.tolist())
    ]
    return torch.cat(rows)


def quant_parts(parts: Sequence[Part]) -> tuple[Part, ...]:
    """`parts` with neighbouring block parts of one type joined (one kernel call instead of two);
    joining copies them, so only parts already copied at load should be passed together."""
    out: list[Part] = []
    for p in parts:
        last = out[-1] if out else None
        if isinstance(p, QuantizedWeight) and isinstance(last, QuantizedWeight) and last.btype is p.btype:
            blocks = torch.cat([last.blocks, p.blocks], dim=-2)
            out[-1] = QuantizedWeight(blocks, p.btype, (*p.shape[:-2], last.shape[-2] + p.shape[-2], p.shape[-1]))
        else:
            out.append(p)
    return tuple(out)
