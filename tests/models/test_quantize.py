"""`--quantize q8_0`: llama.cpp's blocks, bit for bit, and a model that computes on them exactly as
a float model with the rounded weights would (float products), or by llama.cpp's 8-bit scheme."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny import TinyCache

from hybridkv.default_model import default_model_dir
from hybridkv.models import load_model
from hybridkv.ops.quant import QuantizedWeight
from hybridkv.ops.quant.linear import QuantExperts, QuantLinear, float_activations
from hybridkv.ops.quant.quantize import quantize_q8_0

gguf = pytest.importorskip("gguf")


def test_q8_0_blocks_are_llama_cpps_bit_for_bit():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 256)).astype(np.float32) * rng.uniform(1e-3, 10, (37, 1)).astype(np.float32)
    w[0, :32] = 0  # a zero block: d = 0, q = 0
    w[1, :32] = np.arange(32) - 15.5  # halves after scaling: roundf takes them away from zero
    w[1, 0] = 127.0
    w[2, :32] = 1e-30  # subnormal scale in float16
    want = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    got = quantize_q8_0(torch.from_numpy(w)).numpy()
    assert got.shape == want.shape and np.array_equal(got, want)
    experts = torch.from_numpy(w[:36]).reshape(3, 12, 256)
    assert torch.equal(quantize_q8_0(experts).reshape(36, -1), quantize_q8_0(torch.from_numpy(w[:36])))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(2, 48))


def held(model) -> dict[str, QuantizedWeight | QuantLinear | QuantExperts]:
    out = {}
    for prefix, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, (QuantizedWeight, QuantLinear, QuantExperts)):
                out[f"{prefix}.{attr}".lstrip(".")] = value
    return out


def run(model, tokens: list[int]) -> torch.Tensor:
    cache = TinyCache(model.config, num_seqs=1, max_len=len(tokens))
    out = cache.run(model, [(0, tokens[:-3])])
    return torch.cat([*out, *(cache.run(model, [(0, [t])])[0] for t in tokens[-3:])])


def test_a_quantized_model_computes_on_its_rounded_weights():
    quantized = load_model(default_model_dir(), quantize="q8_0")
    blocks = held(quantized)
    # every projection, the experts and the embedding (tied head); the router stays a float part
    assert "embed" in blocks and isinstance(blocks["layers.0.ffn.gate_up"], QuantExperts)
    assert {n.rsplit(".", 1)[-1] for n in blocks} >= {"in_proj", "out_proj", "qkv_proj", "o_proj", "gate_in", "down"}
    gate_in = blocks["layers.0.ffn.gate_in"]
    assert isinstance(gate_in.parts[0], torch.Tensor) and gate_in.parts[0].shape[1] == quantized.config.num_experts + 1
    numel, nbytes = quantized.weight_sizes()
    assert nbytes < 0.3 * 4 * numel

    # the float model with each quantized weight replaced by its dequantized blocks
    reference = load_model(default_model_dir())
    params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, w in blocks.items():
            params[name].copy_(w.dequantize())
    tokens = [5, 900, 17, 2048, 33, 1, 4000, 12, 77, 310, 8, 64]
    want = run(reference, tokens)
    with float_activations():
        assert (run(quantized, tokens) - want).abs().max() <= 1e-5 * want.abs().max()
    ours = run(quantized, tokens)  # 8-bit activations on the trained model: the same tokens win
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (ours - want).abs().max() <= 0.05 * want.abs().max()


def test_a_type_that_cannot_be_made_is_named():
    with pytest.raises(ValueError, match="--quantize 'q2_k'.*q8_0"):
        load_model(default_model_dir(), quantize="q2_k")


def test_the_cli_and_the_api_run_a_quantized_model(capsys):
    from hybridkv.cli import main
    from hybridkv.engine.llm import LLM

    assert main(["generate", "The function returns", "--max-tokens", "6", "--quantize", "q8_0"]) == 0
    assert capsys.readouterr().out.strip()
    assert LLM(quantize="q8_0").quantization == "Q8_0"
