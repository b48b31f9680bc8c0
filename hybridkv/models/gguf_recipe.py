"""Which ggml type each tensor of a written GGUF file gets: llama.cpp's rules, per file type.

`hybridkv quantize --type NAME` names a file type (`FILE_TYPES`). The rules are those of
`llama-quantize` without an importance matrix (`src/llama-quant.cpp` of the llama.cpp that
llama-cpp-python 0.3.36 vendors, `llama_tensor_get_type` and what it calls), for the file types
written here:

- Only 2-D and 3-D tensors named `*weight` are quantized, never `*_norm.weight`, the router
  `ffn_gate_inp.weight` or `ssm_conv1d`; those stay F32 (what the converter writes them as).
- `q8_0`, `q6_k`, `q4_k_m` are llama.cpp's mixtures (`LLAMA_FTYPE_MOSTLY_*`):
  - `output.weight` (or `token_embd.weight` when the head is tied) is Q6_K unless the file type
    is Q8_0, and Q8_0 when its rows are not a multiple of the default type's block;
  - Q4_K_M: `attn_v` and `attn_qkv` (one counter over both, in file order) get Q6_K where
    `use_more_bits(i, n)` holds, and so does `ffn_down*` by layer; everything else Q4_K;
  - models with exactly 8 experts get `attn_v`/`attn_qkv`/`attn_k` in Q8_0 (any mixture) and
    `attn_output` in Q5_K (Q4_K_M).
- `q4_k` is the pure type (`llama-quantize --pure`: no mixture rule, not even the head's).
- `f32`, `f16`, `bf16`: every quantizable tensor in that type.
- Fallbacks for rows that do not split into the type's blocks (`tensor_type_fallback`): Q4_K →
  Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, and F16 where rows are not a multiple of 32 either. So a
  model 192 wide written as Q4_K_M is mostly Q5_0, with Q8_0 where Q6_K was chosen.

Not implemented: the rules of other file types (Q2_K, Q3_K_*, IQ*, ...), importance matrices,
`--tensor-type` overrides, and the 70B / Falcon special cases (not these architectures).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hybridkv.ops.quant.traits import GGMLType

_T = GGMLType


@dataclass(frozen=True, slots=True)
class FileType:
    """A whole-file quantization: `ftype` is llama.cpp's `general.file_type`, `default` the type
    of every quantizable tensor before the mixture's rules (`mixture`) and the fallbacks."""

    name: str
    ftype: int
    default: GGMLType
    mixture: bool


FILE_TYPES: dict[str, FileType] = {
    f.name: f
    for f in (
        FileType("f32", 0, _T.F32, False),
        FileType("f16", 1, _T.F16, False),
        FileType("bf16", 32, _T.BF16, False),
        FileType("q8_0", 7, _T.Q8_0, True),
        FileType("q6_k", 18, _T.Q6_K, True),
        FileType("q4_k_m", 15, _T.Q4_K, True),
        FileType("q4_k", 14, _T.Q4_K, False),  # what `llama-quantize --pure ... Q4_K_S` writes
    )
}
_BLOCK = {_T.F32: 1, _T.F16: 1, _T.BF16: 1, _T.Q8_0: 32, _T.Q5_0: 32, _T.Q5_1: 32}
_BLOCK |= {_T.Q4_K: 256, _T.Q5_K: 256, _T.Q6_K: 256}
_FALLBACK = {_T.Q4_K: _T.Q5_0, _T.Q5_K: _T.Q5_1, _T.Q6_K: _T.Q8_0}
_FLOATS = (_T.F32, _T.F16, _T.BF16)
_LAYER = re.compile(r"^blk\.(\d+)\.")


def file_type(name: str) -> FileType:
    """The file type called `name`; ValueError listing the choices."""
    try:
        return FILE_TYPES[name.lower()]
    except KeyError:
        raise ValueError(f"--type {name!r} is not supported; choose one of {', '.join(FILE_TYPES)}") from None


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """llama.cpp's `tensor_allows_quantization` for these models (`shape` in torch order)."""
    dims = len(shape) - next((i for i, n in enumerate(shape) if n > 1), len(shape))  # ggml_n_dims
    excluded = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d")
    return dims >= 2 and name.endswith("weight") and not any(e in name for e in excluded)


def _category(name: str) -> str:
    """llama.cpp's `tensor_get_category`, first match wins."""
    if name == "output.weight":
        return "output"
    if name == "token_embd.weight":
        return "token_embd"
    for key, category in (
        ("attn_qkv.weight", "attn_v"),  # attn_v-like (`category_is_attn_v`)
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if key in name:
            return category
    return "other"


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers a mixture gives more bits: the first and last eighth and
    every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def fallback(type_id: GGMLType, row: int) -> GGMLType:
    """The type llama.cpp writes for rows of `row` weights when `type_id`'s blocks do not fit."""
    if row % _BLOCK[type_id] == 0:
        return type_id
    fitted = _FALLBACK.get(type_id, type_id)
    return fitted if row % _BLOCK[fitted] == 0 else _T.F16


def tensor_types(
    tensors: list[tuple[str, tuple[int, ...]]], ftype: FileType, n_layers: int, n_experts: int
) -> dict[str, GGMLType]:
    """Each tensor's type, for `tensors` (name, torch shape) in file order (which the mixtures'
    counters follow, as llama.cpp's do: layer by layer, by name within a layer)."""
    names = {name for name, _ in tensors}
    tied = "output.weight" not in names
    n_wv = sum(_category(name) == "attn_v" for name in names)
    i_wv = i_down = 0
    types: dict[str, GGMLType] = {}
    for name, shape in tensors:
        if not allows_quantization(name, shape):
            types[name] = _T.F32
            continue
        new = ftype.default
        if ftype.default in _FLOATS:
            types[name] = new
            continue
        category, row = _category(name), shape[-1]
        if ftype.mixture:
            if category == "output" or (tied and category == "token_embd"):
                if row % _BLOCK[new]:
                    new = _T.Q8_0
                elif new != _T.Q8_0:
                    new = _T.Q6_K
            elif category == "attn_v":
                if ftype.name == "q4_k_m" and use_more_bits(i_wv, n_wv):
                    new = _T.Q6_K
                if n_experts == 8:
                    new = _T.Q8_0
                i_wv += 1
            elif category == "attn_k" and n_experts == 8:
                new = _T.Q8_0
            elif category == "ffn_down":
                match = _LAYER.match(name)
                layer = int(match[1]) if n_experts > 1 and match else i_down
                if ftype.name == "q4_k_m" and use_more_bits(layer, n_layers):
                    new = _T.Q6_K
                i_down += 1
            elif category == "attn_output" and n_experts == 8 and ftype.name == "q4_k_m":
                new = _T.Q5_K
        types[name] = fallback(new, row)
    return types
