"""`hybridkv quantize` writes what llama.cpp writes: the same checkpoints as the checked-in files of
llama.cpp's converter and quantizer (tests/data/gguf, scripts/make_gguf_fixtures.py) give the same
tensors, types and metadata; gguf-py reads our files back; and our loader computes on a written
file exactly what `--quantize` computes at load."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize
from hf_reference import max_rel_err
from safetensors.torch import load_file
from test_gguf_loading import run

from hybridkv.models import load_model
from hybridkv.models.gguf import GGUFFile, file_type_name
from hybridkv.models.gguf_checkpoint import GGUFTensors
from hybridkv.models.gguf_writer import plan, write_quantized

REPO = Path(__file__).parents[2]
DATA = REPO / "tests" / "data" / "gguf"


@cache
def fixtures_script():  # scripts/make_gguf_fixtures.py: how the checked-in files' checkpoints were built
    spec = importlib.util.spec_from_file_location("make_gguf_fixtures", REPO / "scripts" / "make_gguf_fixtures.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BUILDERS: dict[str, Callable[[Path], object]] = {
    "qwen3next-tiny": lambda p: fixtures_script().qwen3next_checkpoint(p),
    "qwen35-tiny": lambda p: fixtures_script().qwen35_checkpoint(p, moe=False),
    "qwen35moe-tiny": lambda p: fixtures_script().qwen35_checkpoint(p, moe=True),
    "qwen35moe-k": lambda p: fixtures_script().qwen35_k_checkpoint(p),
    "qwen3next-wide": lambda p: fixtures_script().qwen3next_wide_checkpoint(p),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The checkpoint directory the fixture `name` was converted from, rebuilt (seeded) once."""
    root = tmp_path_factory.mktemp("checkpoints")

    @cache
    def build(name: str) -> Path:
        BUILDERS[name](root / name)
        return root / name

    return build


def fields(reader: GGUFReader) -> dict[str, tuple[list[GGUFValueType], object]]:
    return {k: (f.types, f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


# Keys that name the source directory or count the MTP block the converter kept (we never write it).
UNCOMPARED = ("general.name", "general.size_label", ".block_count", ".nextn_predict_layers", ".recurrent_layers")


@pytest.mark.parametrize("file_type", ["f32", "q8_0"])
@pytest.mark.parametrize("name", ["qwen3next-tiny", "qwen35-tiny", "qwen35moe-tiny"])
def test_the_converters_files_and_ours_hold_the_same_bytes(name, file_type, checkpoint, tmp_path):
    ours_path = tmp_path / "ours.gguf"
    write_quantized(checkpoint(name), ours_path, file_type)
    ours, theirs = GGUFReader(ours_path), GGUFReader(DATA / f"{name}-{file_type}.gguf")
    mine, converted = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    layers = int(fields(ours)[f"{fields(ours)['general.architecture'][1]}.block_count"][1])
    assert set(converted) - set(mine) == {n for n in converted if n.startswith(f"blk.{layers}.")}  # the MTP block
    for tensor_name, t in mine.items():
        u = converted[tensor_name]
        assert (t.tensor_type.name, list(t.shape)) == (u.tensor_type.name, list(u.shape)), tensor_name
        assert t.data.tobytes() == u.data.tobytes(), f"{tensor_name} ({t.tensor_type.name}) differs"
    a, b = fields(ours), fields(theirs)
    assert {k for k in b if not k.endswith(UNCOMPARED)} == {k for k in a if not k.endswith(UNCOMPARED)}
    for key, (types, value) in b.items():
        if not key.endswith(UNCOMPARED):
            assert a[key] == (types, value), key
    recurrent = next(k for k in a if k.endswith(".recurrent_layers"))
    assert a[recurrent][1] == b[recurrent][1][:layers]


def test_q4_k_m_gives_each_tensor_the_type_llama_quantize_gives_it(checkpoint):
    """The checked-in file is llama.cpp's own Q4_K_M (`llama_model_quantize`) of this checkpoint:
    attn_qkv, attn_v and ffn_down in Q6_K in the layers `use_more_bits` picks, the head Q6_K."""
    _, entries = plan(checkpoint("qwen35moe-k"), "q4_k_m")
    theirs = {t.name: t for t in GGUFReader(DATA / "qwen35moe-k-q4_k_m.gguf").tensors}
    assert {e.name: GGMLQuantizationType(e.type_id).name for e in entries} == {
        n: t.tensor_type.name for n, t in theirs.items()
    }


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))


@pytest.mark.slow
def test_q4_k_m_blocks_are_llama_quantizes_or_as_close_to_the_weights(checkpoint, tmp_path):
    """Same reference algorithms as llama.cpp's: most rows byte for byte, and every tensor as
    close to the float weights (our sums run in another order, so near-ties can go the other way)."""
    write_quantized(checkpoint("qwen35moe-k"), tmp_path / "ours.gguf", "q4_k_m")
    write_quantized(checkpoint("qwen35moe-k"), tmp_path / "f32.gguf", "f32")
    ours = {t.name: t for t in GGUFReader(tmp_path / "ours.gguf").tensors}
    theirs = {t.name: t for t in GGUFReader(DATA / "qwen35moe-k-q4_k_m.gguf").tensors}
    exact = {t.name: t for t in GGUFReader(tmp_path / "f32.gguf").tensors}
    same = total = 0
    for name, t in ours.items():
        if t.tensor_type.name == "F32":
            continue
        u, x = theirs[name], exact[name].data.reshape(-1)
        rows, their_rows = t.data.reshape(-1, t.data.shape[-1]), u.data.reshape(-1, u.data.shape[-1])
        same += int((rows == their_rows).all(-1).sum())
        total += rows.shape[0]
        err, their_err = (rms(gguf_dequantize(q.data, q.tensor_type).reshape(-1) - x) for q in (t, u))
        assert err <= 1.02 * their_err, f"{name}: rms error {err:.3g}, llama.cpp's {their_err:.3g}"
    assert same >= 0.9 * total, f"{same} of {total} quantized rows byte-identical"


@pytest.fixture(scope="module")
def wide_checkpoint(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("qwen3next-wide")


@pytest.mark.parametrize("file_type", ["q8_0", pytest.param("q6_k", marks=pytest.mark.slow), "q4_k"])
def test_a_written_file_computes_what_quantizing_at_load_computes(wide_checkpoint, file_type, tmp_path):
    path = tmp_path / "model.gguf"
    write_quantized(wide_checkpoint, path, file_type)
    tokens = [5, 17, 250, 3, 99, 42, 7, 300, 11, 64]
    from_file = run(load_model(path), tokens)
    at_load = run(load_model(wide_checkpoint, quantize=file_type), tokens)
    assert max_rel_err(from_file, at_load) < 1e-5  # the same blocks; the norms went through 1 + w and back


def test_quantizing_at_load_falls_back_as_a_written_file_does(tmp_path):
    """The default model's 192-wide rows do not fit Q4_K: the file takes llama.cpp's Q5_0 for them,
    and so does `--quantize q4_k`, through the same integer kernels."""
    from hybridkv.default_model import default_model_dir

    path = tmp_path / "model.gguf"
    write_quantized(default_model_dir(), path, "q4_k")
    assert {t.tensor_type.name for t in GGUFReader(path).tensors} == {"F32", "Q4_K", "Q5_0"}
    tokens = [5, 900, 17, 2048, 33, 1, 4000, 12, 77, 310]
    from_file = run(load_model(path), tokens)
    at_load = run(load_model(default_model_dir(), quantize="q4_k"), tokens)
    assert max_rel_err(from_file, at_load) < 1e-5


@pytest.mark.parametrize("file_type", ["f16", "bf16", "q8_0", "q6_k", "q4_k_m"])
def test_gguf_py_reads_a_written_file_as_our_reader_does(checkpoint, file_type, tmp_path):
    """gguf-py, the independent reader, finds every tensor where ours does and dequantizes it to
    the same values, within each type's rounding of the float weights."""
    path = tmp_path / "model.gguf"
    written = {t.name: t for t in write_quantized(checkpoint("qwen3next-tiny"), path, file_type)}
    exact = {t.name: t.data.reshape(-1) for t in GGUFReader(DATA / "qwen3next-tiny-f32.gguf").tensors}
    ours = GGUFTensors(path)
    reader = GGUFReader(path)
    assert [t.name for t in reader.tensors] == list(written)
    for t in reader.tensors:
        want = written[t.name]
        assert (t.tensor_type.name, tuple(reversed(t.shape.tolist()))) == (want.type_name, want.shape)
        values = gguf_dequantize(t.data, t.tensor_type).reshape(-1)
        assert np.array_equal(values, ours.read_float(t.name).reshape(-1).numpy()), t.name
        x = exact[t.name]
        assert np.abs(values - x).max() <= ROUNDING[t.tensor_type.name] * np.abs(x).max(), t.name


# Largest |error| of a type's rounding, as a share of the tensor's largest |weight|.
ROUNDING = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 8e-3, "Q5_0": 0.07, "Q6_K": 0.04, "Q4_K": 0.15}


def test_llama_cpp_computes_on_a_written_file_what_we_compute(wide_checkpoint, tmp_path):
    """The checked-in file is our writer's Q4_K_M of this checkpoint (scripts/gguf_vs_llama_cpp.py
    --fixture), with llama.cpp's own logits on it: both engines round activations to the same
    Q8_K blocks for K-quant weights, so the logits agree to float summation order (4.5e-7 here)."""
    fixture = DATA / "qwen3next-wide-q4_k_m.gguf"
    write_quantized(wide_checkpoint, tmp_path / "again.gguf", "q4_k_m")
    assert (tmp_path / "again.gguf").read_bytes() == fixture.read_bytes()
    golden = load_file(DATA / "qwen3next-wide-q4_k_m.llama_cpp_logits.safetensors")
    ours = run(load_model(fixture), golden["tokens"].tolist())
    theirs = golden["logits"]
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert max_rel_err(ours, theirs) < 1e-4


def test_the_quantize_command_writes_a_file_and_refuses_bad_input_in_one_line(checkpoint, tmp_path, capsys):
    from hybridkv import cli

    out = tmp_path / "tiny-q4_k_m.gguf"
    assert cli.main(["quantize", str(checkpoint("qwen3next-tiny")), str(out), "--type", "Q4_K_M"]) == 0
    err = capsys.readouterr().err
    assert f"wrote {out}" in err and "Q5_0" in err  # 64-wide rows: Q4_K falls back
    with GGUFFile(out) as f:
        assert file_type_name(f.metadata) == "Q4_K_M"
    for args, message in [
        ([str(out), str(tmp_path / "again.gguf")], "already a GGUF file"),
        ([str(checkpoint("qwen3next-tiny")), str(tmp_path / "x.bin")], "must be a .gguf file"),
        ([str(tmp_path / "missing"), str(tmp_path / "y.gguf")], "not found"),
    ]:
        assert cli.main(["quantize", *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # nothing else written


def test_the_default_model_written_as_gguf_tokenizes_and_templates_as_its_files_do(tmp_path):
    from hybridkv.default_model import default_model_dir
    from hybridkv.engine.chat_template import ChatTemplate
    from hybridkv.engine.tokenizer import Tokenizer

    path = tmp_path / "default.gguf"
    write_quantized(default_model_dir(), path, "f32")
    with GGUFFile(path) as f:
        ours, theirs = Tokenizer.from_gguf_metadata(f.metadata), Tokenizer.from_dir(default_model_dir())
        template = ChatTemplate.from_gguf_metadata(f.metadata)
    text = (REPO / "tests" / "data" / "default_model_heldout.txt").read_text(encoding="utf-8")[:20000]
    text += "<|im_start|>user\nnaïve café 123 <|im_end|><|endoftext|>"
    assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "user", "content": "Hello"}]
    reference = ChatTemplate.from_dir(default_model_dir())
    assert template is not None and reference is not None
    assert template.render(messages) == reference.render(messages)


def test_llama_cpps_rules_for_eight_experts_and_rows_that_fit_no_block():
    """The rules no fixture reaches: a model with exactly 8 experts (attention in Q8_0, its output
    Q5_K under Q4_K_M), and rows of 64 (Q4_K → Q5_0, Q5_K → Q5_1) or 48 (F16)."""
    from hybridkv.models.gguf_recipe import file_type, tensor_types

    tensors = [
        ("output.weight", (100, 256)),
        ("token_embd.weight", (100, 256)),
        ("blk.0.attn_k.weight", (128, 256)),
        ("blk.0.attn_output.weight", (256, 256)),
        ("blk.0.attn_q.weight", (512, 256)),
        ("blk.0.attn_v.weight", (128, 256)),
        ("blk.0.ffn_down_exps.weight", (8, 256, 48)),
        ("blk.1.attn_output.weight", (64, 64)),
    ]
    types = {n: t.name for n, t in tensor_types(tensors, file_type("q4_k_m"), n_layers=2, n_experts=8).items()}
    assert types == {
        "output.weight": "Q6_K",
        "token_embd.weight": "Q4_K",
        "blk.0.attn_k.weight": "Q8_0",
        "blk.0.attn_output.weight": "Q5_K",
        "blk.0.attn_q.weight": "Q4_K",
        "blk.0.attn_v.weight": "Q8_0",
        "blk.0.ffn_down_exps.weight": "F16",  # rows of 48: Q4_K, then Q5_0, fit neither
        "blk.1.attn_output.weight": "Q5_1",
    }
    four = {n: t.name for n, t in tensor_types(tensors, file_type("q4_k_m"), n_layers=2, n_experts=4).items()}
    assert four["blk.0.attn_output.weight"] == "Q4_K" and four["blk.1.attn_output.weight"] == "Q5_0"


@pytest.mark.parametrize(("file_type", "ftype"), [("q8_0", 7), ("q6_k", 18), ("q4_k_m", 15)])
def test_on_the_default_model_llama_quantize_picks_our_types_fallbacks_included(file_type, ftype, tmp_path):
    """Runs where llama-cpp-python is installed (the [peers] extra): its `llama_model_quantize` on
    our f32 file of the default model (192 wide: Q5_0 / Q8_0 fallbacks) picks each tensor's type
    as our writer does."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from hybridkv.default_model import default_model_dir

    write_quantized(default_model_dir(), tmp_path / "f32.gguf", "f32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    theirs = tmp_path / "theirs.gguf"
    assert llama_cpp.llama_model_quantize(str(tmp_path / "f32.gguf").encode(), str(theirs).encode(), params) == 0
    _, entries = plan(default_model_dir(), file_type)
    with GGUFFile(theirs) as f:
        assert {e.name: GGMLQuantizationType(e.type_id).name for e in entries} == {
            n: t.type_name for n, t in f.tensors.items()
        }
