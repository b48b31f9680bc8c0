"""The independent reference for Qwen3.5 / 3.6: tiny random transformers models saved the way
released checkpoints look (vision-language wrapper with `model.visual.*` and `mtp.*` tensors,
or a flat text-only `Qwen3_5ForCausalLM`; fused or per-expert MoE; sharded or not)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

TINY_TEXT: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    initializer_range=0.1,  # larger than the default 0.02 so activations are O(1)
    # As released: interleaved M-RoPE over a quarter... here half of the head (sections sum to rd/2).
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
)
TINY_MOE: dict[str, Any] = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
)
TINY_VISION: dict[str, Any] = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)


def make_qwen35(
    moe: bool = False, vlm: bool = True, seed: int = 0, tie: bool = False, nested_tie: bool | None = None, **text: Any
) -> Any:
    """A tiny random transformers Qwen3.5 (`Qwen3_5[Moe]ForConditionalGeneration` when `vlm`, else
    `Qwen3_5[Moe]ForCausalLM`), eager attention, with norm weights, A_log and dt_bias moved away
    from their init values (which hide (1 + w) vs w mix-ups). `nested_tie` sets text_config's own
    tie flag differently from the wrapper's (transformers' VLM follows the wrapper's)."""
    text_config = {**TINY_TEXT, **(TINY_MOE if moe else {}), **text}
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    if vlm:
        text_config["tie_word_embeddings"] = tie if nested_tie is None else nested_tie
        config = getattr(transformers, prefix + "Config")(
            text_config=text_config, vision_config=TINY_VISION, tie_word_embeddings=tie
        )
        cls = getattr(transformers, prefix + "ForConditionalGeneration")
    else:
        config = getattr(transformers, prefix + "TextConfig")(**text_config, tie_word_embeddings=tie)
        cls = getattr(transformers, prefix + "ForCausalLM")
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" not in name and name.endswith(("norm.weight", "layernorm.weight", "A_log", "dt_bias")):
                param.add_(torch.empty_like(param).uniform_(-0.5, 0.5))
    return model


def save_qwen35(
    model: Any,
    path: Path,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
    mtp: bool = True,
    per_expert: bool = False,
) -> Path:
    """Save as a released checkpoint would be: `mtp.*` tensors added (transformers drops the block),
    optionally per-expert MoE tensors instead of the fused ones, in `shards` files."""
    path.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(path)
    model.to(torch.float32)
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
        file.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    D = model.config.get_text_config().hidden_size
    if mtp:  # the shapes of the real block's first tensors; their values are never read
        tensors["mtp.fc.weight"] = torch.randn(D, 2 * D).to(dtype)
        tensors["mtp.norm.weight"] = torch.randn(D).to(dtype)
    if per_expert:
        tensors = _split_experts(tensors)
    write_shards(tensors, path, shards)
    return path


def _split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, I = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :I].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, I:].clone()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def write_shards(tensors: dict[str, torch.Tensor], path: Path, shards: int) -> None:
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def qwen35_logits(model: Any, tokens: Sequence[int]) -> torch.Tensor:
    """transformers' no-cache logits for one text-only sequence: [len(tokens), V] float32."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)]), use_cache=False)
    return out.logits[0].float()


def write_qwen35_chat_model(
    path: Path, template: str = "3.5", compact: bool = True, seed: int = 5, **model: Any
) -> tuple[Path, Any]:
    """A released-style Qwen3.5 checkpoint with the test tokenizer and Qwen's chat template in
    `path` (see qwen35_tokenizer.py; `compact=False` gives the real 248,320-row vocabulary)."""
    from qwen35_tokenizer import COMPACT_VOCAB, QWEN35_VOCAB, write_qwen35_tokenizer

    hf = make_qwen35(seed=seed, vocab_size=COMPACT_VOCAB if compact else QWEN35_VOCAB, **model)
    save_qwen35(hf, path)
    write_qwen35_tokenizer(path, template, compact)  # type: ignore[arg-type]
    return path, hf
