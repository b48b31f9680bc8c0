"""`--quantize`: a float model's projections into GGUF blocks after loading, computed on as a GGUF
file's are (`ops.quant.linear`).

What is quantized follows llama.cpp's choices for a whole-file type: every projection, the
experts, the embedding and the head; the norms, the Gated DeltaNet's small tensors (conv, A, dt,
norm) and the MoE router with its shared-expert gate stay float (llama.cpp keeps `ffn_gate_inp*`
in F32). A projection whose rows do not split into whole blocks of the type (256 weights for the
K-quants) falls back as llama.cpp's files do (Q4_K → Q5_0, Q6_K → Q8_0), so `--quantize q4_k`
computes what `hybridkv quantize … q4_k` writes; rows that are not a multiple of 32 stay float.
"""

from __future__ import annotations

import torch

from hybridkv.models.gguf_recipe import fallback
from hybridkv.models.qwen3_next import DenseMLP, GatedAttention, GatedDeltaNet, Qwen3NextModel, SparseMoE
from hybridkv.ops.quant import QuantizedWeight
from hybridkv.ops.quant.linear import Part, QuantExperts, QuantLinear
from hybridkv.ops.quant.quantize import QUANTIZE_TYPES, quantize
from hybridkv.ops.quant.traits import GGMLType
from hybridkv.ops.quant.weight import for_kernels


def quantize_type(name: str) -> GGMLType:
    """The ggml type of a `--quantize` name; ValueError listing the choices."""
    try:
        return QUANTIZE_TYPES[name.lower()]
    except KeyError:
        raise ValueError(f"--quantize {name!r} is not supported; choose one of {', '.join(QUANTIZE_TYPES)}") from None


def _blocks(w: torch.Tensor, type_id: GGMLType) -> Part:
    """A float weight [.., in, out] (our layout) → `QuantizedWeight` [.., out, in] in the type, or
    in llama.cpp's fallback where rows do not fit it (every fallback type has a kernel); float where
    rows fit no block type (the fallback is F16)."""
    type_id = fallback(type_id, w.shape[-2])
    if type_id == GGMLType.F16:
        return w
    rows = w.detach().transpose(-1, -2)
    return for_kernels(QuantizedWeight.of(quantize(rows, type_id), type_id, tuple(rows.shape)))


def _replace(module: torch.nn.Module, attr: str, held: object) -> None:
    del module._parameters[attr]
    setattr(module, attr, held)


def _linear(module: torch.nn.Module, attr: str, type_id: GGMLType, keep_float: int = 0) -> None:
    """Quantize parameter `attr` [in, out]; its first `keep_float` output features stay float."""
    w = getattr(module, attr)
    if not isinstance(w, torch.nn.Parameter):
        return
    parts: list[Part] = [w.detach()[:, :keep_float].contiguous()] if keep_float else []
    parts.append(_blocks(w.detach()[:, keep_float:], type_id))
    if all(isinstance(p, torch.Tensor) for p in parts):
        return
    _replace(module, attr, QuantLinear(tuple(parts)))


def _experts(module: torch.nn.Module, attr: str, type_id: GGMLType) -> None:
    w = getattr(module, attr)
    if not isinstance(w, torch.nn.Parameter):
        return
    part = _blocks(w.detach(), type_id)
    if isinstance(part, QuantizedWeight):
        _replace(module, attr, QuantExperts((part,)))


def quantize_model(model: Qwen3NextModel, type_id: GGMLType) -> Qwen3NextModel:
    """Quantize `model`'s weights in place (see the module docstring), one tensor at a time."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, GatedDeltaNet):
                _linear(module, "in_proj", type_id)
                _linear(module, "out_proj", type_id)
            elif isinstance(module, GatedAttention):
                _linear(module, "qkv_proj", type_id)
                _linear(module, "o_proj", type_id)
            elif isinstance(module, DenseMLP):
                _linear(module, "gate_up", type_id)
                _linear(module, "down", type_id)
            elif isinstance(module, SparseMoE):
                _linear(module, "gate_in", type_id, keep_float=module.E + 1)  # router | shared gate
                _experts(module, "gate_up", type_id)
                _experts(module, "down", type_id)
                _linear(module, "shared_down", type_id)
        if model.lm_head is not None:
            _linear(model, "lm_head", type_id)
        embed = model.embed
        if isinstance(embed, torch.nn.Parameter):
            part = _blocks(embed.detach().T, type_id)  # [V, D] as the file keeps it
            if isinstance(part, QuantizedWeight):
                _replace(model, "embed", part)
    return model
