"""`hybridkv quantize`: a safetensors checkpoint written once as a GGUF file, in llama.cpp's layout.

The inverse of `gguf_checkpoint` (what llama.cpp's `convert_hf_to_gguf.py` does, then what
`llama-quantize` does, in one pass): Hugging Face tensors → llama.cpp's names and layouts, each
quantized as llama.cpp's rules say (`gguf_recipe`) by our quantizers (`ops.quant.quantize`):

    model.embed_tokens, lm_head, model.norm       token_embd, output, output_norm (stored 1 + w)
    input_layernorm, post_attention_layernorm      attn_norm, post_attention_norm (1 + w)
    self_attn.{q,k,v,o}_proj, {q,k}_norm           attn_q (per head [q | gate]), attn_k, attn_v,
                                                   attn_output, attn_{q,k}_norm (1 + w)
    Qwen3-Next linear_attn.in_proj_qkvz            attn_qkv [q all heads | k all | v all] + attn_gate
    Qwen3-Next linear_attn.in_proj_ba              ssm_ba (as is)
    Qwen3.5 in_proj_qkv, in_proj_z, in_proj_b/a    attn_qkv, attn_gate, ssm_beta, ssm_alpha
    conv1d [C, 1, K], A_log, dt_bias, norm         ssm_conv1d [C, K], ssm_a = −exp(A_log), ssm_dt.bias,
                                                   ssm_norm (as is: the one norm not stored 1 + w)
    out_proj                                       ssm_out
    mlp.gate, experts (fused or one per expert)    ffn_gate_inp, ffn_{gate,up,down}_exps [E, ...]
    shared_expert.*, shared_expert_gate            ffn_{gate,up,down}_shexp, ffn_gate_inp_shexp
    mlp.{gate,up,down}_proj (dense)                ffn_gate, ffn_up, ffn_down

Qwen3.5's value heads are reordered from grouped (head k·r + v) to llama.cpp's tiled order
(head v·Hk + k) in attn_qkv's v rows, attn_gate, ssm_beta/alpha, ssm_a, ssm_dt, ssm_conv1d's v
channels and ssm_out's columns. The multi-token-prediction block and a vision tower are not
written (as the converter's `--no-mtp`). Metadata: the converter's `{arch}.*` keys and the
tokenizer (`gguf_vocab`). Tensors are read, transformed and quantized one at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.models.config import ModelConfig
from hybridkv.models.gguf import GGML_TYPES
from hybridkv.models.gguf_container import BOOL, INT32, TensorEntry, Value, array, f32, string, u32, write_gguf
from hybridkv.models.gguf_recipe import FileType, file_type, tensor_types
from hybridkv.models.gguf_vocab import tokenizer_metadata
from hybridkv.models.qwen3_5 import TEXT_PREFIX, VLM_PREFIX
from hybridkv.models.registry import FAMILIES
from hybridkv.models.weights import Checkpoint, WeightsError
from hybridkv.ops.quant.quantize import quantize
from hybridkv.ops.quant.traits import GGMLType

Read = Callable[[], torch.Tensor]
QUANTIZATION_VERSION = 2  # GGML_QNT_VERSION
_QWEN35_MROPE_SECTION = [11, 11, 10]  # the converter's default when the config has none


@dataclass(frozen=True, slots=True)
class WrittenTensor:
    """One tensor of a written file: its name, torch shape and ggml type name."""

    name: str
    shape: tuple[int, ...]
    type_name: str


def architecture(config: ModelConfig) -> str:
    if config.family == "qwen3_next":
        return "qwen3next"
    return "qwen35moe" if config.num_experts else "qwen35"


def _tile(t: torch.Tensor, dim: int, Hk: int, r: int, head_dim: int) -> torch.Tensor:
    """Grouped value-head order (head k·r + v) → llama.cpp's tiled order (head v·Hk + k) along `dim`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], Hk, r, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


def hf_tensors(config: ModelConfig, checkpoint: Checkpoint) -> dict[str, tuple[tuple[int, ...], Read]]:
    """GGUF name → (torch shape, read as float32 in llama.cpp's layout), for every tensor written."""
    c, names = config, checkpoint.names
    prefix = VLM_PREFIX if VLM_PREFIX + "embed_tokens.weight" in names else TEXT_PREFIX
    out: dict[str, tuple[tuple[int, ...], Read]] = {}

    def read(name: str) -> Read:  # checked now, read when written
        if name not in names:
            raise WeightsError(f"{checkpoint.description}: tensor {name!r} is missing")
        return lambda: checkpoint.read(name).float()

    def put(gguf: str, shape: tuple[int, ...], fn: Read) -> None:
        out[gguf] = (shape, fn)

    def put_as_is(gguf: str, hf: str) -> None:
        fn = read(hf)
        put(gguf, checkpoint.shape(hf), fn)

    def put_norm(gguf: str, hf: str) -> None:  # llama.cpp's RMSNorm multiplies by the weight: 1 + w
        fn = read(hf)
        put(gguf, checkpoint.shape(hf), lambda: fn() + 1.0)

    put_as_is("token_embd.weight", prefix + "embed_tokens.weight")
    if not c.tie_word_embeddings:
        put_as_is("output.weight", "lm_head.weight")
    put_norm("output_norm.weight", prefix + "norm.weight")
    for i, kind in enumerate(c.layer_kinds):
        g, hf = f"blk.{i}.", f"{prefix}layers.{i}."
        put_norm(g + "attn_norm.weight", hf + "input_layernorm.weight")
        put_norm(g + "post_attention_norm.weight", hf + "post_attention_layernorm.weight")
        if kind == "attention":
            a = hf + "self_attn."
            for ours, theirs in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
                put_as_is(g + theirs + ".weight", a + ours + "_proj.weight")
            put_norm(g + "attn_q_norm.weight", a + "q_norm.weight")
            put_norm(g + "attn_k_norm.weight", a + "k_norm.weight")
        else:
            _linear_attention(c, checkpoint, g, hf + "linear_attn.", put, read)
        m = hf + "mlp."
        if c.moe_layers[i]:
            _experts(c, checkpoint, g, m, put, read)
        else:
            for ours, theirs in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
                put_as_is(g + theirs + ".weight", m + ours + "_proj.weight")
    return out


def _linear_attention(
    c: ModelConfig, ckpt: Checkpoint, g: str, hf: str, put: Callable[..., None], read: Callable[[str], Read]
) -> None:
    D, Hk, Hv = c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, K = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
    r, qk = Hv // Hk, 2 * Hk * dk
    C = qk + Hv * dv
    qwen35 = c.family == "qwen3_5"

    def tiled(fn: Read, head_dim: int, dim: int = 0) -> Read:
        return (lambda: _tile(fn(), dim, Hk, r, head_dim)) if qwen35 and r > 1 else fn

    def tiled_after_qk(fn: Read) -> Read:  # conv channels and qkv rows: only the v part moves
        return (lambda: torch.cat([(t := fn())[:qk], _tile(t[qk:], 0, Hk, r, dv)])) if qwen35 and r > 1 else fn

    if qwen35:
        put(g + "attn_qkv.weight", (C, D), tiled_after_qk(read(hf + "in_proj_qkv.weight")))
        put(g + "attn_gate.weight", (Hv * dv, D), tiled(read(hf + "in_proj_z.weight"), dv))
        put(g + "ssm_beta.weight", (Hv, D), tiled(read(hf + "in_proj_b.weight"), 1))
        put(g + "ssm_alpha.weight", (Hv, D), tiled(read(hf + "in_proj_a.weight"), 1))
    else:
        qkvz = read(hf + "in_proj_qkvz.weight")

        def split(t: torch.Tensor) -> list[torch.Tensor]:  # per key head [q | k | v | z] → each part, all heads
            return [p.reshape(-1, D) for p in t.view(Hk, -1, D).split([dk, dk, r * dv, r * dv], dim=1)]

        put(g + "attn_qkv.weight", (C, D), lambda: torch.cat(split(qkvz())[:3]))
        put(g + "attn_gate.weight", (Hv * dv, D), lambda: split(qkvz())[3])
        put(g + "ssm_ba.weight", (2 * Hv, D), read(hf + "in_proj_ba.weight"))
    conv = read(hf + "conv1d.weight")
    put(g + "ssm_conv1d.weight", (C, K), tiled_after_qk(lambda: conv().reshape(C, K)))
    a_log = read(hf + "A_log")
    put(g + "ssm_a", (Hv,), tiled(lambda: -torch.exp(a_log()), 1))
    put(g + "ssm_dt.bias", (Hv,), tiled(read(hf + "dt_bias"), 1))
    put(g + "ssm_norm.weight", (dv,), read(hf + "norm.weight"))
    put(g + "ssm_out.weight", (D, Hv * dv), tiled(read(hf + "out_proj.weight"), dv, dim=1))


def _experts(
    c: ModelConfig, ckpt: Checkpoint, g: str, m: str, put: Callable[..., None], read: Callable[[str], Read]
) -> None:
    D, E, I, Is = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    x = m + "experts."
    put(g + "ffn_gate_inp.weight", (E, D), read(m + "gate.weight"))
    if x + "gate_up_proj" in ckpt.names:  # transformers 5: fused [E, 2I, D] and [E, D, I]
        gate_up = read(x + "gate_up_proj")
        put(g + "ffn_gate_exps.weight", (E, I, D), lambda: gate_up()[:, :I])
        put(g + "ffn_up_exps.weight", (E, I, D), lambda: gate_up()[:, I:])
        put(g + "ffn_down_exps.weight", (E, D, I), read(x + "down_proj"))
    else:  # one tensor per expert, stacked as the converter does
        for ours, theirs, shape in (("gate", "gate", (E, I, D)), ("up", "up", (E, I, D)), ("down", "down", (E, D, I))):
            parts = [read(f"{x}{e}.{theirs}_proj.weight") for e in range(E)]
            put(g + f"ffn_{ours}_exps.weight", shape, lambda parts=parts: torch.stack([p() for p in parts]))
    put(g + "ffn_gate_inp_shexp.weight", (1, D), read(m + "shared_expert_gate.weight"))
    for ours, shexp in (("gate", (Is, D)), ("up", (Is, D)), ("down", (D, Is))):
        put(g + f"ffn_{ours}_shexp.weight", shexp, read(m + f"shared_expert.{ours}_proj.weight"))


def _text_config(model_dir: Path) -> dict[str, Any]:
    raw = json.loads((model_dir / "config.json").read_text())
    return dict(raw.get("text_config") or raw)


def model_metadata(config: ModelConfig, model_dir: Path, ftype: FileType) -> dict[str, Value]:
    """`general.*` and `{arch}.*` keys, as the converter writes them."""
    c, raw = config, _text_config(model_dir)
    arch = architecture(c)
    meta: dict[str, Value] = {
        "general.architecture": string(arch),
        "general.type": string("model"),
        "general.name": string(model_dir.resolve().name),
    }

    def put(key: str, value: Value) -> None:
        meta[f"{arch}.{key}"] = value

    put("block_count", u32(c.num_hidden_layers))
    put("context_length", u32(c.max_position_embeddings))
    put("embedding_length", u32(c.hidden_size))
    if "intermediate_size" in raw:
        put("feed_forward_length", u32(c.intermediate_size))
    put("attention.head_count", u32(c.num_attention_heads))
    put("attention.head_count_kv", u32(c.num_key_value_heads))
    if c.family == "qwen3_5":
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        sections = list(rope.get("mrope_section") or _QWEN35_MROPE_SECTION)
        put("rope.dimension_sections", array(INT32, sections + [0] * (4 - len(sections))))
    put("rope.freq_base", f32(c.rope_theta))
    put("attention.layer_norm_rms_epsilon", f32(c.rms_norm_eps))
    if c.num_experts:
        put("expert_count", u32(c.num_experts))
        put("expert_used_count", u32(c.num_experts_per_tok))
    put("attention.key_length", u32(c.head_dim))
    put("attention.value_length", u32(c.head_dim))
    meta["general.file_type"] = u32(ftype.ftype)
    if c.num_experts:
        put("expert_feed_forward_length", u32(c.moe_intermediate_size))
        put("expert_shared_feed_forward_length", u32(c.shared_expert_intermediate_size))
    put("ssm.conv_kernel", u32(c.linear_conv_kernel_dim))
    put("ssm.state_size", u32(c.linear_key_head_dim))
    put("ssm.group_count", u32(c.linear_num_key_heads))
    put("ssm.time_step_rank", u32(c.linear_num_value_heads))
    put("ssm.inner_size", u32(c.linear_value_head_dim * c.linear_num_value_heads))
    put("attention.recurrent_layers", array(BOOL, [k == "linear" for k in c.layer_kinds]))
    put("full_attention_interval", u32(raw.get("full_attention_interval", 4)))
    put("rope.dimension_count", u32(int(c.head_dim * c.partial_rotary_factor)))
    meta["general.quantization_version"] = u32(QUANTIZATION_VERSION)
    return meta


def _file_order(name: str) -> tuple[int, str]:
    """llama.cpp's tensor order (`weight_name_comparer`): by layer (others first), then by name."""
    match = re.match(r"blk\.(\d+)\.", name)
    return (int(match[1]) if match else -1, name)


def _encode(t: torch.Tensor, type_id: GGMLType) -> torch.Tensor:
    if type_id == GGMLType.F32:
        return t.float().contiguous()
    if type_id == GGMLType.F16:
        return t.half().contiguous()
    if type_id == GGMLType.BF16:
        return t.bfloat16().view(torch.int16).contiguous()  # the bits, as GGUF stores them
    return quantize(t, type_id)


def plan(model_dir: str | Path, type_name: str) -> tuple[dict[str, Value], list[TensorEntry]]:
    """The metadata and the tensors (not yet computed) of `model_dir` written as `type_name`."""
    model_dir = Path(model_dir)
    ftype = file_type(type_name)
    config = ModelConfig.from_dir(model_dir)
    checkpoint = Checkpoint(model_dir)
    config = FAMILIES[config.family].for_checkpoint(config, checkpoint.names)
    tensors = hf_tensors(config, checkpoint)
    order = sorted(tensors, key=_file_order)
    types = tensor_types([(n, tensors[n][0]) for n in order], ftype, config.num_hidden_layers, config.num_experts)
    entries = []
    for name in order:
        shape, read = tensors[name]

        def produce(name: str = name, read: Read = read, shape: tuple[int, ...] = shape) -> torch.Tensor:
            t = read()
            if tuple(t.shape) != shape and t.numel() == torch.Size(shape).numel():
                t = t.reshape(shape)  # ffn_gate_inp_shexp [D] in some checkpoints, [1, D] in others
            if tuple(t.shape) != shape:
                raise ValueError(f"{model_dir}: a tensor for {name} has shape {tuple(t.shape)}, expected {shape}")
            return _encode(t, types[name])

        entries.append(TensorEntry(name, shape, int(types[name]), produce))
    metadata = model_metadata(config, model_dir, ftype) | tokenizer_metadata(
        model_dir, config.family, config.vocab_size
    )
    return metadata, entries


def write_quantized(model_dir: str | Path, out: str | Path, type_name: str) -> list[WrittenTensor]:
    """Write the checkpoint in `model_dir` as the GGUF file `out` of file type `type_name`
    (`gguf_recipe.FILE_TYPES`); returns what was written, tensor by tensor."""
    metadata, entries = plan(model_dir, type_name)
    write_gguf(out, metadata, entries)
    return [WrittenTensor(e.name, e.shape, GGML_TYPES[e.type_id].name) for e in entries]
