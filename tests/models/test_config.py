"""config.json parsing: both styles, transformers' defaults, and clear refusals."""

from __future__ import annotations

import json

import pytest
from tiny import make_hf_model
from transformers import Qwen3NextConfig

from hybridkv.errors import NotSupported
from hybridkv.models import ModelConfig


def new_style(tiny_checkpoint) -> dict:
    return json.loads((tiny_checkpoint[1] / "config.json").read_text())


def to_old_style(raw: dict, full_attention_interval: int) -> dict:
    """What older transformers wrote (and released checkpoints carry): top-level rope keys, an interval."""
    raw = dict(raw)
    rope = raw.pop("rope_parameters")
    del raw["layer_types"]
    return {
        **raw,
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": rope["partial_rotary_factor"],
        "rope_scaling": None,
        "full_attention_interval": full_attention_interval,
    }


def write_config(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_old_and_new_style_config_json_parse_to_the_same_config(tiny_checkpoint, tmp_path):
    raw = new_style(tiny_checkpoint)
    new = ModelConfig.from_dir(tiny_checkpoint[1])
    old = ModelConfig.from_dir(write_config(tmp_path, to_old_style(raw, full_attention_interval=4)))
    assert old == new
    assert new.layer_kinds == ("linear", "linear", "linear", "attention")


def test_missing_keys_take_transformers_defaults():
    ours = ModelConfig.from_dict({"model_type": "qwen3_next"})
    hf = Qwen3NextConfig()
    assert ours.head_dim == hf.head_dim == 256
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert ours.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
    assert ours.layer_kinds == tuple("linear" if t == "linear_attention" else "attention" for t in hf.layer_types)
    same = (
        "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "rms_norm_eps tie_word_embeddings linear_conv_kernel_dim linear_key_head_dim linear_value_head_dim "
        "linear_num_key_heads linear_num_value_heads decoder_sparse_step moe_intermediate_size "
        "shared_expert_intermediate_size num_experts_per_tok num_experts norm_topk_prob"
    )
    for name in same.split():
        assert getattr(ours, name) == getattr(hf, name), name


def test_layer_kinds_moe_layers_and_sizes_agree_with_transformers():
    hf = make_hf_model(
        num_hidden_layers=6,
        layer_types=["linear_attention", "full_attention"] * 3,
        mlp_only_layers=[2],
        decoder_sparse_step=2,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    )
    ours = ModelConfig.from_dict(hf.config.to_dict())
    layers = hf.model.layers
    assert ours.layer_kinds == tuple("linear" if hasattr(lay, "linear_attn") else "attention" for lay in layers)
    assert ours.moe_layers == tuple(hasattr(lay.mlp, "experts") for lay in layers)
    assert ours.moe_layers == (False, True, False, True, False, True)
    assert ours.attention_layers == (1, 3, 5) and ours.linear_layers == (0, 2, 4)
    assert ours.conv_channels == layers[0].linear_attn.conv1d.weight.shape[0]
    assert ours.rotary_dim == 2 * hf.model.rotary_emb.inv_freq.numel() == 16


def test_other_model_types_are_refused_naming_the_type_and_file(tmp_path):
    path = write_config(tmp_path, {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]})
    with pytest.raises(NotSupported, match="qwen3_moe") as e:
        ModelConfig.from_dir(path)
    assert str(path / "config.json") in str(e.value)


def test_quantized_checkpoints_are_refused(tiny_checkpoint, tmp_path):
    raw = {
        **new_style(tiny_checkpoint),
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    with pytest.raises(NotSupported, match=r"quantiz.*fp8"):
        ModelConfig.from_dir(write_config(tmp_path, raw))


def test_rope_scaling_is_refused_in_either_style(tiny_checkpoint):
    raw = new_style(tiny_checkpoint)
    old = {**to_old_style(raw, 4), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(NotSupported, match="rope_scaling"):
        ModelConfig.from_dict(old)
    new = {**raw, "rope_parameters": {**raw["rope_parameters"], "rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(NotSupported, match="yarn"):
        ModelConfig.from_dict(new)


def test_inconsistent_sizes_say_what_to_change(tiny_checkpoint):
    raw = new_style(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads"):
        ModelConfig.from_dict({**raw, "linear_num_value_heads": 3})
    with pytest.raises(ValueError, match="layer_types has 4 entries but num_hidden_layers is 5"):
        ModelConfig.from_dict({**raw, "num_hidden_layers": 5})


def test_a_directory_without_config_json_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
