"""The independent reference: tiny random transformers Qwen3-Next models, saved as checkpoints,
and their no-cache logits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

TINY = dict(
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
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    initializer_range=0.1,  # larger than the default 0.02 so activations are O(1)
)


def make_hf_model(seed: int = 0, **overrides: object) -> Qwen3NextForCausalLM:
    """A tiny random transformers Qwen3-Next, eager attention, with every norm weight, A_log and
    dt_bias moved away from their init values (which hide (1 + w) vs w mix-ups)."""
    config = Qwen3NextConfig(**{**TINY, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "A_log", "dt_bias")):
                param.add_(torch.empty_like(param).uniform_(-0.5, 0.5))
    return model


def save_checkpoint(model: Qwen3NextForCausalLM, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    model.to(dtype).save_pretrained(path)
    model.to(torch.float32)
    return path


def hf_logits(model: Qwen3NextForCausalLM, tokens: Sequence[int]) -> torch.Tensor:
    """transformers' no-cache logits for one sequence: [len(tokens), V] float32."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([list(tokens)]), use_cache=False)
    return out.logits[0].float()


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| relative to max |want|: the parity measure of every test."""
    return float((got - want).abs().max() / want.abs().max())
