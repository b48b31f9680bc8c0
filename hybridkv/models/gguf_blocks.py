"""A GGUF model's projections kept in the file's blocks: GGUF tensors → our parameters.

`gguf_checkpoint` shows a GGUF file as the Hugging Face checkpoint it came from, dequantized; this
module is the other path, for the weights a step spends its time reading. Each projection the
model fuses (`qwen3_next`'s module docstring: in_proj [q | k | v | z | b | a], qkv_proj
[q | gate | k | v], gate_in [router | shared gate | shared gate_up], gate_up [gate | up]) becomes a
`QuantLinear` whose parts are the file's tensors, in our output order:

    whole tensors in order           attn_qkv, attn_gate, attn_k, attn_v, ffn_gate, ffn_up, ...
    output rows permuted (a copy)    attn_q (per head [q | gate] → all q, all gate), qwen3next
                                     ssm_ba (per key head [b | a] → all b, all a), legacy ssm_in
    neighbouring parts of one type   joined into one part (one kernel call; a copy)

Only rows move, never columns, so every block stays whole. qwen35 files store value heads in
llama.cpp's tiled order (head v·Hk + k), which would need ssm_out's columns moved — across the
256-wide K-quant blocks. So those models keep the tiled order everywhere (`keep_tiled`) and their
Gated DeltaNet layers read key head h % Hk for value head h (`GatedDeltaNet.tiled_heads`).

A part is kept in blocks when its type has an integer kernel (`BlockType.matmul`: Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); the float types (F32, F16, BF16) are read
into the compute dtype. A projection with no block part is loaded the float way.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.models.config import ModelConfig
from hybridkv.models.gguf_checkpoint import GGUFTensors
from hybridkv.ops.quant import QuantizedWeight, block_type
from hybridkv.ops.quant.linear import Part, QuantExperts, QuantLinear, quant_parts
from hybridkv.ops.quant.weight import for_kernels


@dataclass(frozen=True, slots=True)
class Rows:
    """Output rows taken from GGUF tensor `name`: all in order, or the rows `index` (a copy)."""

    name: str
    index: torch.Tensor | None = None


def kept_in_blocks(type_id: int) -> bool:
    """Whether a tensor of this ggml type is multiplied on its blocks (else dequantized at load)."""
    return block_type(type_id).matmul is not None


def block_layout(file: GGUFTensors, config: ModelConfig) -> dict[str, list[Rows]]:
    """Our projection parameter → the GGUF tensor rows that make it, in our output order."""
    c = config
    names = file.tensor_names()
    layout: dict[str, list[Rows]] = {"embed": [Rows("token_embd.weight")]}
    if not c.tie_word_embeddings:
        layout["lm_head"] = [Rows("output.weight")]
    for i, kind in enumerate(c.layer_kinds):
        g, ours = f"blk.{i}.", f"layers.{i}."
        if kind == "linear":
            layout[ours + "mixer.in_proj"] = _gdn_in_proj(c, g, names)
            layout[ours + "mixer.out_proj"] = [Rows(g + "ssm_out.weight")]
        else:
            H, hd = c.num_attention_heads, c.head_dim
            q_gate = torch.arange(2 * H * hd).view(H, 2, hd).transpose(0, 1).flatten()
            layout[ours + "mixer.qkv_proj"] = [
                Rows(g + "attn_q.weight", q_gate),
                Rows(g + "attn_k.weight"),
                Rows(g + "attn_v.weight"),
            ]
            layout[ours + "mixer.o_proj"] = [Rows(g + "attn_output.weight")]
        f = ours + "ffn."
        if c.moe_layers[i]:
            layout[f + "gate_in"] = [
                Rows(g + "ffn_gate_inp.weight"),
                Rows(g + "ffn_gate_inp_shexp.weight"),
                Rows(g + "ffn_gate_shexp.weight"),
                Rows(g + "ffn_up_shexp.weight"),
            ]
            fused = g + "ffn_gate_up_exps.weight"
            gate_up = [fused] if fused in names else [g + "ffn_gate_exps.weight", g + "ffn_up_exps.weight"]
            layout[f + "gate_up"] = [Rows(n) for n in gate_up]
            layout[f + "down"] = [Rows(g + "ffn_down_exps.weight")]
            layout[f + "shared_down"] = [Rows(g + "ffn_down_shexp.weight")]
        else:
            layout[f + "gate_up"] = [Rows(g + "ffn_gate.weight"), Rows(g + "ffn_up.weight")]
            layout[f + "down"] = [Rows(g + "ffn_down.weight")]
    return layout


def _gdn_in_proj(c: ModelConfig, g: str, names: set[str]) -> list[Rows]:
    Hk, Hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = Hv // Hk
    if g + "ssm_ba.weight" in names or g + "ssm_in.weight" in names:  # Qwen3-Next: b, a grouped per key head
        ba = torch.arange(2 * Hv).view(Hk, 2, r).transpose(0, 1).flatten()
        if g + "ssm_in.weight" in names:  # per key head [q dk | k dk | v r·dv | z r·dv], as in_proj_qkvz
            rows = torch.arange(2 * Hk * dk + 2 * Hv * dv).view(Hk, -1)
            qkvz = [rows[:, a:b].flatten() for a, b in _bounds([dk, dk, r * dv, r * dv])]
            return [Rows(g + "ssm_in.weight", torch.cat(qkvz)), Rows(g + "ssm_ba.weight", ba)]
        return [Rows(g + "attn_qkv.weight"), Rows(g + "attn_gate.weight"), Rows(g + "ssm_ba.weight", ba)]
    # qwen35: flat q | k | v, z, b, a, value heads tiled (kept so: see the module docstring)
    return [Rows(g + n) for n in ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")]


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for s in sizes:
        out.append((at, at + s))
        at += s
    return out


def raw_blocks(file: GGUFTensors, name: str) -> torch.Tensor:
    """A tensor's bytes in the mapped file as uint8 [*shape[:-1], row_bytes] (no copy)."""
    view = file.file.data(name)
    rows = view.view(np.uint8).reshape(*view.shape[:-1], -1) if view.dtype != np.uint8 else view
    with warnings.catch_warnings():  # the mapping is read-only; nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(rows)


def _part(file: GGUFTensors, rows: Rows, dtype: torch.dtype) -> Part:
    info = file.file.tensors[rows.name]
    shape = tuple(info.shape) if len(info.shape) > 1 else (1, *info.shape)  # ffn_gate_inp_shexp is [D]
    if kept_in_blocks(info.type_id):
        blocks = raw_blocks(file, rows.name)
        if rows.index is not None:
            blocks = blocks.index_select(-2, rows.index)
        return for_kernels(QuantizedWeight.of(blocks, info.type_id, shape))
    w = file.read_float(rows.name).reshape(shape)
    if rows.index is not None:
        w = w.index_select(-2, rows.index)
    return w.transpose(-1, -2).to(dtype).contiguous()  # [.., in, out]: the float layout `mm` reads


def build(file: GGUFTensors, pieces: list[Rows], dtype: torch.dtype) -> QuantLinear | QuantExperts | None:
    """The projection made of `pieces`, or None when none of them is kept in blocks. Tensors copied
    (permuted, joined or dequantized) have their file pages released, so the weights are resident
    once."""
    if not any(kept_in_blocks(file.file.tensors[p.name].type_id) for p in pieces):
        return None
    parts = [_part(file, p, dtype) for p in pieces]
    joined = quant_parts(parts)
    for piece, part in zip(pieces, parts, strict=True):
        copied = not isinstance(part, QuantizedWeight) or part.btype.ggml_type != file.file.tensors[piece.name].type_id
        if copied or piece.index is not None or len(joined) < len(parts):
            file.file.release(piece.name)
    experts = len(file.file.tensors[pieces[0].name].shape) == 3
    return QuantExperts(joined) if experts else QuantLinear(joined)


def attach(model: torch.nn.Module, file: GGUFTensors, config: ModelConfig, dtype: torch.dtype) -> set[str]:
    """Replace `model`'s projection parameters by the file's blocks where it has them (the rest
    stay parameters, for the float loader); returns the names replaced. The embedding stays one
    `QuantizedWeight` [V, D] (rows dequantized as looked up; a tied head multiplies on it)."""
    replaced = set()
    for name, pieces in block_layout(file, config).items():
        held: QuantizedWeight | QuantLinear | QuantExperts | None = None
        if name == "embed":
            info = file.file.tensors[pieces[0].name]
            if kept_in_blocks(info.type_id):
                held = for_kernels(QuantizedWeight.of(raw_blocks(file, info.name), info.type_id))
                if held.btype.ggml_type != info.type_id:  # repacked or tiled: a copy
                    file.file.release(info.name)
        else:
            held = build(file, pieces, dtype)
        if held is None:
            continue
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        del owner._parameters[attr]
        setattr(owner, attr, held)
        replaced.add(name)
    return replaced
