"""The default model is a valid Qwen3-Next checkpoint, judged by transformers, and is reproducible."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hybridkv.default_model import (
    ENDOFTEXT_ID,
    IM_END_ID,
    VOCAB_SIZE,
    byte_to_unicode,
    default_model_dir,
    materialize,
)
from hybridkv.engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize(tmp_path_factory.mktemp("home"))


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path), "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def test_transformers_loads_it_with_every_weight_and_gets_finite_logits(model_dir: Path) -> None:
    model, info = transformers.Qwen3NextForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    ids = torch.tensor([list(b"def f(x):\n    return x")])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_tensor_names_and_shapes_match_what_transformers_saves(model_dir: Path, tmp_path: Path) -> None:
    config = transformers.Qwen3NextConfig.from_pretrained(model_dir)
    transformers.Qwen3NextForCausalLM(config).save_pretrained(tmp_path)
    assert _tensor_shapes(model_dir / "model.safetensors") == _tensor_shapes(tmp_path / "model.safetensors")


def test_materialising_twice_gives_byte_identical_files(model_dir: Path, tmp_path: Path) -> None:
    again = materialize(tmp_path)
    assert again.name == model_dir.name
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert (model_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_default_dir_lives_under_hybridkv_home_and_is_built_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_HOME", str(tmp_path))
    first = default_model_dir()
    assert first.parent == tmp_path
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written


def test_concurrent_first_uses_leave_one_complete_model(tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(materialize(tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4
    assert list(tmp_path.iterdir()) == [results[0]]  # no temporary directories left behind
    transformers.Qwen3NextForCausalLM.from_pretrained(results[0])


def test_tokenizer_is_byte_level_with_qwen_special_tokens(model_dir: Path) -> None:
    tok = Tokenizer.from_dir(model_dir)
    assert tok.vocab_size == VOCAB_SIZE == 259
    assert tok.encode("héllo") == list("héllo".encode())
    assert tok.decode(list("中文 🙂".encode())) == "中文 🙂"
    assert tok.token_to_id("<|im_end|>") == IM_END_ID
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT_ID
    assert tok.encode("<|im_start|>hi<|im_end|>") == [tok.token_to_id("<|im_start|>"), 104, 105, IM_END_ID]
    assert tok.eos_token_ids == {IM_END_ID, ENDOFTEXT_ID}


def test_transformers_reads_the_same_tokenizer(model_dir: Path) -> None:
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours = Tokenizer.from_dir(model_dir)
    text = "The function returns 42 — ünïcödé\n\t<|im_end|>"
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text)
    assert theirs.eos_token == "<|im_end|>"
    assert theirs.pad_token == "<|endoftext|>"


def test_byte_alphabet_is_the_byte_level_one() -> None:
    from tokenizers import pre_tokenizers

    assert sorted(byte_to_unicode().values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
