"""Qwen3.5 / 3.6 checkpoints as they are released load and equal transformers' own classes
(`Qwen3_5[Moe]ForConditionalGeneration` on text, `Qwen3_5[Moe]ForCausalLM` for flat ones)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from qwen35_reference import qwen35_logits
from test_parity import BF16_MAX_TOL, BF16_MEAN_TOL, assert_close, chunks_mixed_with_decode, random_tokens
from tiny import TinyCache

from hybridkv.errors import NotSupported
from hybridkv.models import ModelConfig, Qwen3_5Model, WeightsError, load_model, weights_nbytes

# name: (make_qwen35 arguments, save_qwen35 arguments)
CHECKPOINTS = {
    # the released 0.8B-4B shape: vision-language wrapper, dense, tied head, visual + mtp tensors
    "vlm_dense_tied": (dict(tie=True), {}),
    # 35B-A3B-like: MoE with fused 3-D experts, untied, in 3 shards
    "vlm_moe_sharded": (dict(moe=True), dict(shards=3)),
    # a text-only fine-tune: flat Qwen3_5ForCausalLM, untied, no mtp
    "text_dense": (dict(vlm=False), dict(mtp=False)),
    # flat MoE with per-expert tensors (transformers writes fused ones; ours are split from them)
    "text_moe_per_expert": (dict(moe=True, vlm=False), dict(per_expert=True)),
    # odd shapes: Hv = 3·Hk, dk != dv, conv kernel 3, attention every 2nd layer, MoE
    "odd_shapes": (
        dict(
            moe=True,
            linear_num_key_heads=2,
            linear_num_value_heads=6,
            linear_key_head_dim=8,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=3,
            layer_types=["linear_attention", "full_attention"] * 2,
        ),
        {},
    ),
    # the two tie flags disagree; the VLM class follows the wrapper's, and so does the file
    "flags_tied_nested_untied": (dict(tie=True, nested_tie=False), {}),
    "flags_untied_nested_tied": (dict(tie=False, nested_tie=True), {}),
}


def checkpoint(make_qwen35_checkpoint, name: str):
    model_args, save_args = CHECKPOINTS[name]
    return make_qwen35_checkpoint(name, save=save_args, **model_args)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_prefill_in_chunks_mixed_with_decode_matches_transformers(make_qwen35_checkpoint, name):
    hf, path = checkpoint(make_qwen35_checkpoint, name)
    model = load_model(path)
    assert isinstance(model, Qwen3_5Model)
    long, short = random_tokens(15, seed=3), random_tokens(6, seed=4)
    ours_long, ours_short = chunks_mixed_with_decode(model, long, short)
    assert_close(ours_long, qwen35_logits(hf, long))
    assert_close(ours_short, qwen35_logits(hf, short))


def test_the_head_is_tied_exactly_when_the_file_has_no_lm_head(make_qwen35_checkpoint):
    for name, tied in (("flags_tied_nested_untied", True), ("flags_untied_nested_tied", False)):
        hf, path = checkpoint(make_qwen35_checkpoint, name)
        hf_tied = hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
        assert hf_tied == tied  # transformers' VLM class, which the parity test above compares against
        assert load_model(path).config.tie_word_embeddings == tied
        assert (load_model(path).lm_head is None) == tied


def test_vision_tower_and_mtp_are_neither_loaded_nor_counted(make_qwen35_checkpoint):
    hf, path = checkpoint(make_qwen35_checkpoint, "vlm_dense_tied")
    model = load_model(path)
    ours = sum(p.numel() for p in model.parameters())
    decoder = sum(p.numel() for p in hf.model.language_model.parameters())  # tied: no separate head
    assert ours == decoder
    assert weights_nbytes(path, torch.float32) == 4 * decoder
    assert weights_nbytes(path, torch.bfloat16) == 2 * decoder
    assert sum(p.numel() for p in hf.model.visual.parameters()) > 0


def test_a_checkpoint_of_another_layout_is_named(make_qwen35_checkpoint, tmp_path):
    """A Qwen3-Next-style grouped in_proj_qkvz under a qwen3_5 config is a missing tensor, not garbage."""
    _, path = checkpoint(make_qwen35_checkpoint, "text_dense")
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    gdn = "model.layers.0.linear_attn."
    tensors[gdn + "in_proj_qkvz.weight"] = tensors.pop(gdn + "in_proj_qkv.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(WeightsError, match="in_proj_qkv"):
        load_model(tmp_path)


def test_bfloat16_stays_within_the_documented_bound(make_qwen35_checkpoint):
    hf, path = make_qwen35_checkpoint("bf16_moe", save=dict(dtype=torch.bfloat16), moe=True)
    model = load_model(path, torch.bfloat16)
    prompt = random_tokens(12, seed=7)
    cache = TinyCache(model.config, num_seqs=1, max_len=16, dtype=torch.bfloat16)
    ours = torch.cat([*cache.run(model, [(0, prompt[:9])]), *(cache.run(model, [(0, [t])])[0] for t in prompt[9:])])
    truth = qwen35_logits(hf, prompt)  # float32 over the same (bf16-representable) weights
    hf_bf16 = qwen35_logits(hf.to(torch.bfloat16), prompt)
    hf.to(torch.float32)
    scale = truth.abs().max()
    assert (ours - truth).abs().mean() <= BF16_MEAN_TOL * scale
    # the worst token: within the cap, or (a router near-tie flipped) within 3x transformers' own bf16 run
    assert (ours - truth).abs().max() <= max(BF16_MAX_TOL * scale, 3 * (hf_bf16 - truth).abs().max())


# -- config.json ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "cls"),
    [("qwen3_5_text", "Qwen3_5TextConfig"), ("qwen3_5_moe_text", "Qwen3_5MoeTextConfig")],
)
def test_missing_keys_take_the_defaults_of_transformers_config_class(model_type, cls):
    ours = ModelConfig.from_dict({"model_type": model_type})
    hf = getattr(transformers, cls)()
    assert ours.family == "qwen3_5"
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
    assert ours.layer_kinds == tuple("linear" if t == "linear_attention" else "attention" for t in hf.layer_types)
    same = (
        "vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads head_dim rms_norm_eps "
        "tie_word_embeddings linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim linear_num_key_heads "
        "linear_num_value_heads"
    )
    for name in same.split():
        assert getattr(ours, name) == getattr(hf, name), name
    if model_type == "qwen3_5_text":
        assert ours.intermediate_size == hf.intermediate_size and not any(ours.moe_layers)
    else:
        assert all(ours.moe_layers) and ours.norm_topk_prob  # every layer sparse, top-k renormalised
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            assert getattr(ours, name) == getattr(hf, name), name


def test_the_vlm_config_reads_its_text_config(make_qwen35_checkpoint):
    hf, path = checkpoint(make_qwen35_checkpoint, "vlm_moe_sharded")
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_moe" and "text_config" in raw
    ours = ModelConfig.from_dict(raw)
    text = hf.config.text_config
    assert (ours.hidden_size, ours.num_experts, ours.rotary_dim) == (text.hidden_size, text.num_experts, 8)
    # norm_topk_prob / mlp_only_layers / decoder_sparse_step in a file change nothing: transformers ignores them
    noisy = {**raw, "text_config": {**raw["text_config"], "norm_topk_prob": False, "mlp_only_layers": [0]}}
    assert ModelConfig.from_dict(noisy) == ours


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "qwen3_5_vl"}, "qwen3_5_vl"),
        ({"architectures": ["Qwen3_5MoeForConditionalGeneration"]}, "Qwen3_5MoeForConditionalGeneration"),
        ({"text_config": None}, "text_config"),
        ({"text_config": {"model_type": "qwen3_next"}}, "text_config.model_type"),
        ({"text_config": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}}, "yarn"),
        ({"text_config": {"quantization_config": {"quant_method": "fp8"}}}, "fp8"),
    ],
)
def test_unsupported_configs_are_refused_naming_what(change, match):
    raw = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {}}
    with pytest.raises((NotSupported, ValueError), match=match):
        ModelConfig.from_dict({**raw, **change})
