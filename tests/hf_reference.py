"""Tiny random Qwen3-Next checkpoints written by transformers, and its logits as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=32,
    initializer_range=0.08,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def build_hf_model(seed: int = 0, **overrides: Any) -> Any:
    """A transformers Qwen3NextForCausalLM with every norm weight, A_log and dt_bias perturbed
    away from its init, so that zero-centred and plain norms, decays and gates all matter."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = Qwen3NextConfig(**{**TINY, **overrides})
    model = Qwen3NextForCausalLM(config).eval()
    model.config._attn_implementation = "eager"
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "A_log", "dt_bias")):
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    return model


def save_checkpoint(model: Any, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    model.to(torch.float32)
    return path


def reference_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """All-token logits `[T, V]` of a fresh no-cache forward."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())
