"""Qwen3.5 and Qwen3.6 (dense and MoE): the Qwen3-Next decoder with three differences in the
checkpoint, none in the forward pass once loaded.

    1. Gated DeltaNet input projections are split and flat: `in_proj_qkv` [q all key heads |
       k all key heads | v all value heads], then `in_proj_z`, `in_proj_b`, `in_proj_a` in
       value-head order. That is already our `in_proj` row order, so no de-interleave.
    2. The feed-forward is a dense SwiGLU in every layer (dense models) or the sparse block in
       every layer with renormalised top-k (MoE); `config.py` fixes both.
    3. RoPE is interleaved M-RoPE; for text the three position axes are equal and it is the same
       1-D partial RoPE (`config.py`). Image and video inputs are not supported.

Released checkpoints are vision-language: the decoder under `model.language_model.`, the vision
tower under `model.visual.` and the multi-token-prediction block under `mtp.` (neither loaded nor
counted). Text-only fine-tunes name the decoder `model.`. The head is tied exactly when the file
has no `lm_head.weight`, which is what transformers' vision-language class does.
"""

from __future__ import annotations

import dataclasses

from hybridkv.models.config import ModelConfig
from hybridkv.models.qwen3_next import Qwen3NextModel, decoder_layout, gdn_layout, rows
from hybridkv.models.weights import Layout, Piece

VLM_PREFIX, TEXT_PREFIX = "model.language_model.", "model."
_UNUSED = ("mtp.", "model.visual.")


class Qwen3_5Model(Qwen3NextModel):
    """Qwen3.5 / 3.6 causal LM: the same layers as Qwen3-Next (see the module docstring)."""


def for_checkpoint(config: ModelConfig, names: set[str]) -> ModelConfig:
    """The config as the checkpoint's files have it: tied exactly when `lm_head.weight` is absent."""
    return dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in names)


def is_ignored(config: ModelConfig, name: str) -> bool:
    """Tensors text decoding does not use: the vision tower and the multi-token-prediction block."""
    return name.startswith(_UNUSED)


def checkpoint_layout(config: ModelConfig, names: set[str]) -> Layout:
    """Our parameter name → the checkpoint tensors that fill it (see the module docstring); the
    expert layout (fused 3-D or per expert) follows `names` as for Qwen3-Next."""
    prefix = VLM_PREFIX if VLM_PREFIX + "embed_tokens.weight" in names else TEXT_PREFIX
    return decoder_layout(config, names, prefix, _linear_layout)


def _linear_layout(c: ModelConfig, hf: str) -> Layout:
    D, Hv, dv, C = c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim, c.conv_channels
    z, b, a = C, C + Hv * dv, C + Hv * dv + Hv
    in_proj = [
        Piece(hf + "in_proj_qkv.weight", (C, D), rows(0, C)),
        Piece(hf + "in_proj_z.weight", (Hv * dv, D), rows(z, b)),
        Piece(hf + "in_proj_b.weight", (Hv, D), rows(b, a)),
        Piece(hf + "in_proj_a.weight", (Hv, D), rows(a, a + Hv)),
    ]
    return gdn_layout(c, hf, in_proj)
