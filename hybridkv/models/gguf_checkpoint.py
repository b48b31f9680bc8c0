"""A GGUF file (llama.cpp's or ollama's converter) seen as the Hugging Face checkpoint it came from.

The families' checkpoint layouts know Hugging Face names and layouts only; this adapter gives them
that view of a GGUF file, so a new weight format touches neither the models nor the cache:

    metadata  {arch}.block_count, .embedding_length, ...   ->  a config.json dict (`hf_config`)
    tensors   token_embd, blk.N.attn_qkv, ssm_a, ...       ->  model.embed_tokens.weight, ...

Tensors are dequantized to float32 as they are read; `models.gguf_blocks` keeps the projections in
their blocks instead and reads only the rest through here. What the converters changed is undone
exactly:

    norms stored as 1 + w (all but ssm_norm)        ->  w
    ssm_a = -exp(A_log)                             ->  A_log = log(-ssm_a)
    ssm_conv1d [C, K]                               ->  conv1d.weight [C, 1, K]
    qwen3next attn_qkv + attn_gate (flat q|k|v, z)  ->  in_proj_qkvz, grouped per key head
    qwen35 value heads in tiled order (head v·Hk+k) ->  grouped order (head k·r+v), in every
                                                        tensor that has a value-head axis (kept
                                                        tiled with `keep_tiled`: `gguf_blocks`)
    experts ffn_{gate,up,down}_exps [E, ...]        ->  mlp.experts.gate_up_proj / down_proj (fused)
    MTP layers appended as blk.N (N >= layers)      ->  not read

Which semantics a file has is decided by its tensor names, not its architecture string alone:
ollama writes Qwen3-Next as `qwen35moe`, but only Qwen3-Next has `ssm_ba` (or legacy `ssm_in`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hybridkv.errors import NotSupported
from hybridkv.models.gguf import GGUFFile
from hybridkv.models.weights import WeightsError
from hybridkv.ops.quant import UnsupportedTypeError, block_type, dequantize

ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")


class GGUFSource(Protocol):
    """What the adapter reads: metadata as plain values, tensor shapes in torch order (outermost
    first), and each tensor dequantized to float32."""

    path: Path
    metadata: Mapping[str, Any]

    def tensor_names(self) -> set[str]: ...

    def tensor_shape(self, name: str) -> tuple[int, ...]: ...

    def read_float(self, name: str) -> torch.Tensor: ...


Read = Callable[[], torch.Tensor]
_ATTENTION = (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"))


class GGUFTensors:
    """`GGUFSource` over our GGUF reader (memory-mapped) and the block dequantizers."""

    def __init__(self, path: str | Path) -> None:
        self.file = GGUFFile(path)
        self.path = Path(path)
        self.metadata: Mapping[str, Any] = self.file.metadata

    def tensor_names(self) -> set[str]:
        return set(self.file.tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.file.tensors[name].shape)

    def check_type(self, name: str) -> None:
        """NotSupported naming the tensor when its ggml type cannot be read."""
        try:
            block_type(self.file.tensors[name].type_id)
        except UnsupportedTypeError as e:
            raise NotSupported(f"{self.path}: tensor {name!r}: {e}") from None

    def read_float(self, name: str) -> torch.Tensor:
        info = self.file.tensors[name]
        self.check_type(name)
        view = self.file.data(name)
        rows = view.view(np.uint8) if view.dtype != np.uint8 else view  # typed F32/F16/BF16 rows as bytes
        with warnings.catch_warnings():  # the mapping is read-only; dequantize never writes to it
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.from_numpy(rows)
        return dequantize(blocks, info.type_id).reshape(info.shape)


class GGUFCheckpoint:
    """`Checkpoint`'s interface (names, shape, dtype_name, read, numel, file_of, description) over
    a GGUF file, with Hugging Face names and layouts; `hf_config` is the matching config.json."""

    def __init__(self, source: GGUFSource, keep_tiled: bool = False) -> None:
        self.source = source
        self.description = str(source.path)
        self.hf_config = hf_config(source)
        r = self.hf_config["linear_num_value_heads"] // self.hf_config["linear_num_key_heads"]
        # qwen35's value heads stay in the file's tiled order (the model must read them so)
        self.tiled = keep_tiled and self.hf_config["model_type"] != "qwen3_next" and r > 1
        self._reads: dict[str, tuple[tuple[int, ...], Read]] = _tensor_map(source, self.hf_config, keep_tiled)
        self.file_of = dict.fromkeys(self._reads, source.path)
        if isinstance(source, GGUFTensors):  # every type the model reads is known before any is read
            layers = self.hf_config["num_hidden_layers"]
            for name in source.tensor_names():
                if not name.startswith("blk.") or int(name.split(".")[1]) < layers:
                    source.check_type(name)

    @property
    def names(self) -> set[str]:
        return set(self._reads)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reads[name][0]

    def numel(self, name: str) -> int:
        n = 1
        for size in self.shape(name):
            n *= size
        return n

    def dtype_name(self, name: str) -> str:
        return "F32"  # dequantized as it is read

    def read(self, name: str) -> torch.Tensor:
        return self._reads[name][1]()


# -- metadata -> config.json -----------------------------------------------------------------------


def hf_config(source: GGUFSource) -> dict[str, Any]:
    """The config.json of the checkpoint a GGUF file was converted from, from its metadata."""
    metadata, names, where = source.metadata, source.tensor_names(), str(source.path)
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise NotSupported(
            f"{where}: GGUF architecture {arch!r} is not supported; hybridkv reads {', '.join(ARCHITECTURES)}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise WeightsError(f"{where}: GGUF metadata key {arch}.{name} is missing")
        return value

    blocks = int(key("block_count"))
    layers = blocks - int(key("nextn_predict_layers", 0))  # MTP layers come after the decoder's
    head_dim = int(key("attention.key_length"))
    hidden = int(key("embedding_length"))
    Hv = int(key("ssm.time_step_rank"))
    kv_heads = key("attention.head_count_kv")
    layer_types = _layer_types(metadata, arch, layers, kv_heads, where)
    if isinstance(kv_heads, list):  # ollama: 0 for a recurrent layer
        kv_heads = max(int(h) for h in kv_heads[:layers])
    qwen3_next = any(n.endswith(("ssm_ba.weight", "ssm_in.weight")) for n in names)
    moe = any(n.endswith("ffn_gate_inp.weight") for n in names)
    if "token_embd.weight" not in names:
        raise WeightsError(f"{where}: no token_embd.weight tensor; is this a language model GGUF?")
    config: dict[str, Any] = {
        "vocab_size": source.tensor_shape("token_embd.weight")[0],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "layer_types": layer_types,
        "num_attention_heads": int(key("attention.head_count")),
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(key("context_length")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(key("rope.freq_base")),
            "partial_rotary_factor": int(key("rope.dimension_count")) / head_dim,
        },
        "linear_conv_kernel_dim": int(key("ssm.conv_kernel")),
        "linear_key_head_dim": int(key("ssm.state_size")),
        "linear_num_key_heads": int(key("ssm.group_count")),
        "linear_num_value_heads": Hv,
        "linear_value_head_dim": int(key("ssm.inner_size")) // Hv,
        "tie_word_embeddings": "output.weight" not in names,
    }
    if moe:
        config |= {
            "num_experts": int(key("expert_count")),
            "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(key("expert_shared_feed_forward_length")),
        }
    else:
        config["intermediate_size"] = int(key("feed_forward_length"))
    if qwen3_next:
        if not moe:
            raise NotSupported(f"{where}: a Qwen3-Next GGUF without experts (ffn_gate_inp) is not supported")
        # llama.cpp's qwen3next graph always renormalises the top-k weights
        return {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "norm_topk_prob": True} | config
    model_type = "qwen3_5_moe_text" if moe else "qwen3_5_text"
    return {"model_type": model_type} | config


def _layer_types(metadata: Mapping[str, Any], arch: str, layers: int, kv_heads: Any, where: str) -> list[str]:
    recurrent = metadata.get(f"{arch}.attention.recurrent_layers")
    if isinstance(recurrent, list):
        flags = [bool(r) for r in recurrent[:layers]]
    elif isinstance(kv_heads, list):
        flags = [int(h) == 0 for h in kv_heads[:layers]]
    else:
        interval = int(metadata.get(f"{arch}.full_attention_interval", 4))
        flags = [(i + 1) % interval != 0 for i in range(layers)]
    if len(flags) != layers:
        raise WeightsError(f"{where}: the per-layer metadata covers {len(flags)} layers, the model has {layers}")
    return ["linear_attention" if r else "full_attention" for r in flags]


# -- tensors -----------------------------------------------------------------------------------------


def _tensor_map(
    source: GGUFSource, config: dict[str, Any], keep_tiled: bool = False
) -> dict[str, tuple[tuple[int, ...], Read]]:
    names = source.tensor_names()
    c = config
    r = c["linear_num_value_heads"] // c["linear_num_key_heads"]
    Hk = c["linear_num_key_heads"]
    qwen3_next = c["model_type"] == "qwen3_next"
    if qwen3_next or r == 1:
        keep_tiled = False  # nothing is tiled
    where = str(source.path)
    out: dict[str, tuple[tuple[int, ...], Read]] = {}

    def has(name: str) -> bool:
        return name in names

    def raw(name: str) -> Read:
        if not has(name):
            raise WeightsError(f"{where}: tensor {name!r} is missing")
        return lambda: source.read_float(name)

    def put(hf: str, read: Read, shape: tuple[int, ...]) -> None:
        out[hf] = (shape, read)

    def put_as_is(hf: str, name: str) -> None:
        read = raw(name)
        put(hf, read, source.tensor_shape(name))

    def put_norm(hf: str, name: str) -> None:  # stored 1 + w
        read = raw(name)
        put(hf, lambda: read() - 1.0, source.tensor_shape(name))

    def grouped(read: Read, head_dim: int, dim: int = 0) -> Read:
        """Undo qwen35's tiled value-head order along `dim` (heads of `head_dim` rows)."""
        if qwen3_next or r == 1 or keep_tiled:
            return read
        return lambda: _untile(read(), dim, Hk, r, head_dim)

    put_as_is("model.embed_tokens.weight", "token_embd.weight")
    if has("output.weight"):
        put_as_is("lm_head.weight", "output.weight")
    put_norm("model.norm.weight", "output_norm.weight")
    for i, kind in enumerate(c["layer_types"]):
        g, hf = f"blk.{i}.", f"model.layers.{i}."
        put_norm(hf + "input_layernorm.weight", g + "attn_norm.weight")
        put_norm(hf + "post_attention_layernorm.weight", g + "post_attention_norm.weight")
        if kind == "full_attention":
            a = hf + "self_attn."
            for ours, theirs in (
                ("q_proj", "attn_q"),
                ("k_proj", "attn_k"),
                ("v_proj", "attn_v"),
                ("o_proj", "attn_output"),
            ):
                put_as_is(a + ours + ".weight", g + theirs + ".weight")
            put_norm(a + "q_norm.weight", g + "attn_q_norm.weight")
            put_norm(a + "k_norm.weight", g + "attn_k_norm.weight")
        else:
            _linear_attention(source, out, g, hf + "linear_attn.", c, grouped, raw, keep_tiled)
        m = hf + "mlp."
        if "num_experts" in c:
            _experts(source, out, g, m, raw)
        else:
            for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                put_as_is(m + ours + ".weight", g + theirs + ".weight")
    return out


def _linear_attention(
    source: GGUFSource,
    out: dict[str, tuple[tuple[int, ...], Read]],
    g: str,
    hf: str,
    c: dict[str, Any],
    grouped: Callable[..., Read],
    raw: Callable[[str], Read],
    keep_tiled: bool,
) -> None:
    names = source.tensor_names()
    D, Hk, Hv = c["hidden_size"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    r, qk = Hv // Hk, 2 * Hk * dk
    C = qk + Hv * dv

    if c["model_type"] == "qwen3_next":
        if g + "ssm_in.weight" in names:  # llama.cpp's first files: HF's grouped in_proj_qkvz as is
            out[hf + "in_proj_qkvz.weight"] = ((C + Hv * dv, D), raw(g + "ssm_in.weight"))
        else:
            qkv, z = raw(g + "attn_qkv.weight"), raw(g + "attn_gate.weight")
            out[hf + "in_proj_qkvz.weight"] = ((C + Hv * dv, D), lambda: _regroup_qkvz(qkv(), z(), Hk, dk, r * dv))
        out[hf + "in_proj_ba.weight"] = ((2 * Hv, D), raw(g + "ssm_ba.weight"))
    else:
        qkv = raw(g + "attn_qkv.weight")
        untiled_qkv = qkv if keep_tiled else lambda: _untile_rows_after(qkv(), qk, Hk, r, dv)
        out[hf + "in_proj_qkv.weight"] = ((C, D), untiled_qkv)
        out[hf + "in_proj_z.weight"] = ((Hv * dv, D), grouped(raw(g + "attn_gate.weight"), dv))
        out[hf + "in_proj_b.weight"] = ((Hv, D), grouped(raw(g + "ssm_beta.weight"), 1))
        out[hf + "in_proj_a.weight"] = ((Hv, D), grouped(raw(g + "ssm_alpha.weight"), 1))
    conv = raw(g + "ssm_conv1d.weight")
    if c["model_type"] == "qwen3_next":
        out[hf + "conv1d.weight"] = ((C, 1, c["linear_conv_kernel_dim"]), lambda: conv()[:, None, :])
    else:
        untiled = conv if keep_tiled else lambda: _untile_rows_after(conv(), qk, Hk, r, dv)
        out[hf + "conv1d.weight"] = ((C, 1, c["linear_conv_kernel_dim"]), lambda: untiled()[:, None, :])
    ssm_a = grouped(raw(g + "ssm_a"), 1)
    out[hf + "A_log"] = ((Hv,), lambda: torch.log(-ssm_a()))
    dt = g + ("ssm_dt.bias" if g + "ssm_dt.bias" in names else "ssm_dt")  # ollama: no .bias
    out[hf + "dt_bias"] = ((Hv,), grouped(raw(dt), 1))
    out[hf + "norm.weight"] = ((dv,), raw(g + "ssm_norm.weight"))  # the one norm stored as is
    out[hf + "out_proj.weight"] = ((D, Hv * dv), grouped(raw(g + "ssm_out.weight"), dv, dim=1))


def _experts(
    source: GGUFSource, out: dict[str, tuple[tuple[int, ...], Read]], g: str, m: str, raw: Callable[[str], Read]
) -> None:
    names = source.tensor_names()
    out[m + "gate.weight"] = (source.tensor_shape(g + "ffn_gate_inp.weight"), raw(g + "ffn_gate_inp.weight"))
    if g + "ffn_gate_up_exps.weight" in names:
        E, I2, D = source.tensor_shape(g + "ffn_gate_up_exps.weight")
        out[m + "experts.gate_up_proj"] = ((E, I2, D), raw(g + "ffn_gate_up_exps.weight"))
    else:
        gate, up = raw(g + "ffn_gate_exps.weight"), raw(g + "ffn_up_exps.weight")
        E, I, D = source.tensor_shape(g + "ffn_gate_exps.weight")
        out[m + "experts.gate_up_proj"] = ((E, 2 * I, D), lambda: torch.cat([gate(), up()], dim=1))
    out[m + "experts.down_proj"] = (source.tensor_shape(g + "ffn_down_exps.weight"), raw(g + "ffn_down_exps.weight"))
    shared_gate = raw(g + "ffn_gate_inp_shexp.weight")
    D = source.tensor_shape(g + "ffn_gate_inp_shexp.weight")[-1]
    out[m + "shared_expert_gate.weight"] = ((1, D), lambda: shared_gate().reshape(1, D))
    for ours, theirs in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
        name = g + theirs + ".weight"
        out[m + "shared_expert." + ours + ".weight"] = (source.tensor_shape(name), raw(name))


def _regroup_qkvz(qkv: torch.Tensor, z: torch.Tensor, Hk: int, dk: int, rdv: int) -> torch.Tensor:
    """llama.cpp's [q all | k all | v all] + z back to HF's per-key-head [q | k | v | z] groups."""
    D = qkv.shape[-1]
    q, k, v = qkv.split([Hk * dk, Hk * dk, Hk * rdv])
    parts = [q.view(Hk, dk, D), k.view(Hk, dk, D), v.view(Hk, rdv, D), z.view(Hk, rdv, D)]
    return torch.cat(parts, dim=1).reshape(-1, D)


def _untile(t: torch.Tensor, dim: int, Hk: int, r: int, head_dim: int) -> torch.Tensor:
    """Tiled value-head order (head v·Hk + k) back to grouped order (head k·r + v) along `dim`."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], r, Hk, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape).contiguous()


def _untile_rows_after(t: torch.Tensor, start: int, Hk: int, r: int, head_dim: int) -> torch.Tensor:
    """`_untile` on rows `start:` (the value channels after q and k)."""
    return torch.cat([t[:start], _untile(t[start:], 0, Hk, r, head_dim)])
