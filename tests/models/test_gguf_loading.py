"""GGUF files written by llama.cpp's own converter (tests/data/gguf, scripts/make_gguf_fixtures.py)
load as the checkpoints they came from: float files give transformers' logits on the original
weights; quantized files give transformers' logits on their dequantized weights."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import load_file, save_file
from test_parity import assert_close
from tiny import TinyCache

from hybridkv.errors import NotSupported
from hybridkv.models import load_model, read_checkpoint, weights_nbytes
from hybridkv.models.gguf_checkpoint import GGUFCheckpoint, GGUFTensors
from hybridkv.ops import native
from hybridkv.ops.quant.linear import float_activations

DATA = Path(__file__).parent.parent / "data" / "gguf"
MODELS = {"qwen3next-tiny": "qwen3_next", "qwen35-tiny": "qwen3_5", "qwen35moe-tiny": "qwen3_5"}


def golden(name: str) -> tuple[list[int], torch.Tensor]:
    """The token ids and transformers' float32 logits on the checkpoint the files were converted
    from; `name` is the model's or one of its files' (`qwen35-tiny-q8_0.gguf`)."""
    name = re.sub(r"-(f32|bf16|q8_0|q4_k_m|q2_k)\.gguf$", "", name)
    data = load_file(DATA / f"{name}.logits.safetensors")
    return data["tokens"].tolist(), data["logits"]


def run(model, tokens: list[int]) -> torch.Tensor:
    """Our logits: a prefill of all but 3 tokens, then 3 decode steps."""
    cache = TinyCache(model.config, num_seqs=1, max_len=len(tokens))
    out = cache.run(model, [(0, tokens[:-3])])
    return torch.cat([*out, *(cache.run(model, [(0, [t])])[0] for t in tokens[-3:])])


@pytest.mark.parametrize("name", MODELS)
def test_a_float32_file_gives_transformers_logits_on_the_original_weights(name):
    model = load_model(DATA / f"{name}-f32.gguf")
    assert model.config.family == MODELS[name]
    tokens, logits = golden(name)
    assert_close(run(model, tokens), logits)


def dequantized_checkpoint(gguf_path: Path, out: Path) -> Path:
    """The Hugging Face checkpoint of a GGUF file's dequantized weights, for transformers to run."""
    checkpoint = GGUFCheckpoint(GGUFTensors(gguf_path))
    save_file({n: checkpoint.read(n).contiguous() for n in checkpoint.names}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(checkpoint.hf_config))
    return out


@pytest.mark.parametrize(
    "file",
    [
        "qwen3next-tiny-q8_0.gguf",
        "qwen3next-tiny-bf16.gguf",
        "qwen35-tiny-q8_0.gguf",
        "qwen35moe-tiny-q8_0.gguf",
        "qwen35moe-k-q4_k_m.gguf",  # llama.cpp's own Q4_K_M: Q4_K and Q6_K blocks
        "qwen35moe-k-q2_k.gguf",  # llama.cpp's own Q2_K: Q2_K, Q3_K and Q6_K blocks
    ],
)
def test_a_quantized_file_gives_transformers_logits_on_its_dequantized_weights(file, tmp_path):
    """Its blocks multiplied in float32 (`float_activations`; the 8-bit activation products are
    `test_gguf_blocks`'), and everything dequantized at load."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(dequantized_checkpoint(DATA / file, tmp_path)).eval()
    tokens, original = golden(file)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    with float_activations():
        ours = run(load_model(DATA / file), tokens)
    assert_close(ours, want)
    assert_close(run(load_model(DATA / file, keep_blocks=False), tokens), want)
    # and near the float model (a tiny random model has small margins: 8-bit rounding flips a few;
    # at 2-4 bits most, so the K-quant files are held to transformers on their own weights only)
    if "_k" not in file:
        assert (ours.argmax(-1) == original.argmax(-1)).float().mean() >= 0.6


def test_dequantization_agrees_with_gguf_py_tensor_by_tensor():
    """The independent reference for every stored tensor of a quantized file (before any remapping)."""
    path = DATA / "qwen35moe-tiny-q8_0.gguf"
    source = GGUFTensors(path)
    types = set()
    for tensor in GGUFReader(path).tensors:
        want = gguf_dequantize(tensor)
        got = source.read_float(tensor.name)
        assert torch.equal(got, want), tensor.name
        types.add(tensor.tensor_type.name)
    assert {"F32", "Q8_0"} <= types


def gguf_dequantize(tensor) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(tuple(int(n) for n in reversed(tensor.shape)))


def test_mtp_layers_are_not_read_nor_counted():
    config, checkpoint = read_checkpoint(DATA / "qwen35-tiny-f32.gguf")
    assert all(not n.startswith("mtp.") for n in checkpoint.names)
    counted = weights_nbytes(DATA / "qwen35-tiny-f32.gguf", torch.float32)
    model = load_model(DATA / "qwen35-tiny-f32.gguf")
    assert counted == 4 * sum(p.numel() for p in model.parameters())
    assert config.tie_word_embeddings == (model.lm_head is None)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType | None]]) -> Path:
    writer = GGUFWriter(str(path), arch)
    for name, (data, raw_type) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rewrite(src: Path, dst: Path, arch: str | None = None, keys=None, tensors=None) -> Path:
    """A copy of GGUF file `src` written by gguf-py, as another converter would lay it out:
    `arch` renames the architecture (and its key prefix); `keys(name, value)` returns the new
    (name, value) or None to drop it; `tensors(name, data, type)` returns [(name, data, type)]."""
    reader = GGUFReader(src)
    old = str(reader.fields["general.architecture"].contents())
    arch = arch or old
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        name = arch + field.name[len(old) :] if field.name.startswith(old + ".") else field.name
        changed = keys(name, field.contents()) if keys else (name, field.contents())
        if changed is None:
            continue
        name, value = changed
        if isinstance(value, list) and field.types[0] != GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        for name, out, kind in (
            tensors(tensor.name, data, tensor.tensor_type) if tensors else [(tensor.name, data, None)]
        ):
            writer.add_tensor(name, out, raw_dtype=kind or tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_ollamas_own_layout_of_qwen3_next_loads(tmp_path):
    """ollama's converter: arch qwen35moe for a Qwen3-Next, per-layer head_count_kv (0 = recurrent)
    instead of recurrent_layers, ssm_dt without .bias."""

    def keys(name: str, value):
        if name.endswith("attention.recurrent_layers"):
            return None
        if name.endswith("attention.head_count_kv"):
            return name, [0, 0, 0, value]  # the fixture: attention in layer 3 of 4
        return name, value

    def tensors(name: str, data, kind):
        return [(name.removesuffix(".bias") if name.endswith("ssm_dt.bias") else name, data, kind)]

    path = rewrite(DATA / "qwen3next-tiny-f32.gguf", tmp_path / "ollama.gguf", "qwen35moe", keys, tensors)
    model = load_model(path)
    assert model.config.family == "qwen3_next" and model.config.layer_kinds[3] == "attention"
    tokens, logits = golden("qwen3next-tiny")
    assert_close(run(model, tokens), logits)


def test_llama_cpps_first_qwen3_next_layout_with_ssm_in_loads(tmp_path):
    """The first llama.cpp files kept HF's grouped in_proj_qkvz as one `ssm_in` tensor."""
    metadata = GGUFReader(DATA / "qwen3next-tiny-f32.gguf").fields
    Hk = int(metadata["qwen3next.ssm.group_count"].contents())
    dk = int(metadata["qwen3next.ssm.state_size"].contents())
    value_dim = int(metadata["qwen3next.ssm.inner_size"].contents())
    held: dict[str, np.ndarray] = {}

    def tensors(name: str, data, kind):
        if name.endswith(("attn_qkv.weight", "attn_gate.weight")):
            held[name.rsplit(".", 2)[1]] = data
            if len(held) < 2:
                return []
            qkv, z = held.pop("attn_qkv"), held.pop("attn_gate")
            q, k, v = np.split(qkv, [Hk * dk, 2 * Hk * dk])
            groups = [
                np.concatenate(
                    [q[h * dk : (h + 1) * dk], k[h * dk : (h + 1) * dk], v[h * w : (h + 1) * w], z[h * w : (h + 1) * w]]
                )
                for h in range(Hk)
                for w in [value_dim // Hk]
            ]
            return [(name.rsplit(".", 2)[0] + ".ssm_in.weight", np.concatenate(groups), kind)]
        return [(name, data, kind)]

    model = load_model(rewrite(DATA / "qwen3next-tiny-f32.gguf", tmp_path / "legacy.gguf", tensors=tensors))
    tokens, logits = golden("qwen3next-tiny")
    assert_close(run(model, tokens), logits)


def test_what_cannot_be_read_is_named(tmp_path):
    with pytest.raises(NotSupported, match="llama"):
        load_model(
            write_gguf(tmp_path / "llama.gguf", "llama", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
        )

    # a tensor of a type hybridkv does not read: named with its type, before any weight is read
    def iq2(name: str, data, kind):
        if name == "blk.0.ffn_down.weight":
            return [(name, np.zeros((data.shape[0], 66), np.uint8), GGMLQuantizationType.IQ2_XXS)]  # one block a row
        return [(name, data, kind)]

    bad = rewrite(DATA / "qwen35-tiny-f32.gguf", tmp_path / "iq2.gguf", tensors=iq2)
    with pytest.raises(NotSupported, match=r"blk\.0\.ffn_down\.weight.*IQ2_XXS"):
        load_model(bad)


# The 32-weight types older files and llama.cpp's fallbacks hold (rows not a multiple of 256).
LEGACY = [
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.IQ4_NL,
]


def iq4_nl_blocks(x: np.ndarray) -> np.ndarray:
    """Valid IQ4_NL rows (gguf-py cannot quantize to it): per 32 weights f16 d = max|x| / 113 and
    each weight's nearest level, packed as Q4_0's nibbles (weight j low, j + 16 high)."""
    from hybridkv.ops.quant.blocks import IQ4_NL_LEVELS

    levels = np.array(IQ4_NL_LEVELS, np.float32)
    b = x.reshape(-1, 32)
    d = (np.abs(b).max(axis=1) / 113).astype(np.float16)
    codes = np.abs(b[:, :, None] - d.astype(np.float32)[:, None, None] * levels).argmin(-1).astype(np.uint8)
    packed = codes[:, :16] | (codes[:, 16:] << 4)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), packed], axis=1)
    return out.reshape(*x.shape[:-1], x.shape[-1] // 32 * 18)


def kept_block_types(model) -> set[str]:
    """The ggml type names of the blocks a loaded model holds."""
    from hybridkv.ops.quant import QuantizedWeight
    from hybridkv.ops.quant.linear import QuantExperts, QuantLinear

    held = [v for m in model.modules() for v in vars(m).values()]
    parts = [p for v in held if isinstance(v, (QuantLinear, QuantExperts)) for p in v.parts]
    return {w.btype.name for w in held + parts if isinstance(w, QuantizedWeight)}


def test_a_file_of_the_32_weight_types_gives_transformers_logits_on_its_dequantized_weights(tmp_path, monkeypatch):
    """Every matrix whose rows fit (embeddings, head, attention, Gated DeltaNet, routed and shared
    experts) in Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL in turn (gguf-py's quantizer), on the MoE fixture:
    computed on its blocks, equal to transformers on the dequantized weights; with 8-bit activations
    (the default) the same next tokens, and the same logits as the kernels' PyTorch twins."""
    import gguf

    chosen: dict[str, GGMLQuantizationType] = {}

    def tensors(name: str, data, kind):
        if data.ndim < 2 or data.shape[-1] % 32 or name.endswith(("ssm_conv1d.weight", "ffn_gate_inp_shexp.weight")):
            return [(name, data, kind)]
        kind = LEGACY[len(chosen) % len(LEGACY)]
        chosen[name] = kind
        blocks = iq4_nl_blocks(data) if kind == GGMLQuantizationType.IQ4_NL else gguf.quants.quantize(data, kind)
        return [(name, blocks, kind)]

    path = rewrite(DATA / "qwen35moe-tiny-f32.gguf", tmp_path / "legacy.gguf", tensors=tensors)
    assert set(chosen.values()) == set(LEGACY) and len(chosen) > 20
    reader = {t.name: t for t in GGUFReader(path).tensors}
    for name in chosen:  # our reading of each block type is gguf-py's
        assert torch.equal(GGUFTensors(path).read_float(name), gguf_dequantize(reader[name])), name
    model = load_model(path)
    assert kept_block_types(model) == {t.name for t in LEGACY}  # computed on, not dequantized at load
    hf = transformers.AutoModelForCausalLM.from_pretrained(dequantized_checkpoint(path, tmp_path)).eval()
    tokens, _ = golden("qwen35moe-tiny")
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    with float_activations():
        assert_close(run(model, tokens), want)
    int8 = run(model, tokens)  # 8-bit activations: the next tokens, and the PyTorch twins' numbers
    assert torch.equal(int8.argmax(-1), want.argmax(-1))
    monkeypatch.setattr(native, "disabled", True)
    assert_close(int8, run(model, tokens), tol=1e-5)
