"""The independent reference: tiny random transformers Qwen3-Next models, saved as checkpoints,
and their no-cache logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import transformers.models.qwen3_next.modeling_qwen3_next as qwen3_next_modeling
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


@contextlib.contextmanager
def attention_reads(
    stored: Sequence[tuple[torch.Tensor, torch.Tensor]], seen: list[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[None]:
    """transformers' Qwen3-Next attention reading, in its i-th call, the keys (normed, rotated) and
    values `stored[i]` ([L, Hkv, hd] each: what a cache holds for the sequence) instead of its own,
    which go to `seen` in the same form. A cache that stores K/V in a narrower type rounds them
    once: the logits must then equal the reference reading the same rounded values, and what it
    stored must be the reference's own K/V rounded (comparing against transformers rounding its
    own instead would fail on every float32 difference that lands a value on the other side of a
    rounding step, amplified through the layers after it)."""
    eager = qwen3_next_modeling.eager_attention_forward
    calls = iter(stored)

    def swapped(module, query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        k, v = next(calls)
        seen.append((key[0].transpose(0, 1).clone(), value[0].transpose(0, 1).clone()))
        k, v = (t.transpose(0, 1)[None].to(key.dtype) for t in (k, v))
        return eager(module, query, k, v, *args, **kwargs)

    qwen3_next_modeling.eager_attention_forward = swapped
    try:
        yield
    finally:
        qwen3_next_modeling.eager_attention_forward = eager
