"""`hybridkv generate`: what a user sees on stdout, stderr and in the exit status."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridkv import CacheConfig, CachedModel, cli
from hybridkv.default_model import default_model_dir
from hybridkv.engine.tokenizer import Tokenizer

TOKENIZER = Tokenizer.from_dir(default_model_dir())
VOCAB_SIZE = TOKENIZER.vocab_size


def greedy_ids(prompt: list[int], n: int, kv_dtype: torch.dtype | None = None) -> list[int]:
    """The default model's greedy continuation, computed without the CLI or the engine."""
    config = CacheConfig(max_model_len=256, max_sequences=1, kv_dtype=kv_dtype)
    cm = CachedModel.load(default_model_dir(), cache=config)
    seq, ids = cm.new_sequence(), []
    logits = cm.feed({seq: prompt}, logits="last")[seq]
    for _ in range(n):
        ids.append(int(logits[-1].argmax()))
        logits = cm.feed({seq: ids[-1:]}, logits="last")[seq]
    return ids


def test_stdout_is_only_the_continuation_up_to_max_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = TOKENIZER.encode("The function returns")
    assert cli.main(["generate", "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == TOKENIZER.decode(greedy_ids(prompt, 5))
    assert "5 generated" in err and "stopped at --max-tokens" in err


def test_kv_dtype_stores_the_cache_as_asked(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = TOKENIZER.encode("def main():")
    argv = ["generate", "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "12", "--kv-dtype", "float16"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == TOKENIZER.decode(greedy_ids(prompt, 12, torch.float16))
    # The same tokens may come from a float32 cache: the flag must reach the cache itself.
    args = cli._parser().parse_args(["generate", "a", "--kv-dtype", "float16"])
    assert cli.llm_from_args(args).cm.cache.tensors.key[0].dtype == torch.float16
    with pytest.raises(SystemExit):
        cli.main(["generate", "a", "--kv-dtype", "int8"])
    err = capsys.readouterr().err
    assert "argument --kv-dtype: invalid choice: 'int8'" in err and "float16" in err


def test_prompt_and_generated_tokens_fit_max_model_len(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = TOKENIZER.encode("The function returns a value")[:3]
    assert len(prompt) == 3
    assert cli.main(["generate", "--prompt-ids", ",".join(map(str, prompt)), "--max-model-len", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == TOKENIZER.decode(greedy_ids(prompt, 2))  # 3 + 2 = 5 tokens in all
    assert "full context" in err


def test_sampling_is_reproducible_with_a_seed(capsys: pytest.CaptureFixture[str]) -> None:
    def run(seed: int) -> str:
        assert cli.main(["generate", "a", "--temperature", "1", "--seed", str(seed), "--max-tokens", "20"]) == 0
        return capsys.readouterr().out

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", ""], "the prompt is empty"),
        (["generate", "--prompt-ids", ""], "the prompt is empty"),
        (["generate", "--prompt-ids", "1,2,3,4,5,6", "--max-model-len", "6"], "no room left in the context"),
        (["generate", "a", "--prompt-ids", "1"], "not both"),
        (["generate"], "not both or neither"),
        (["generate", "--prompt-ids", "1,x"], "comma-separated integers"),
        (["generate", "--prompt-ids", f"1,{VOCAB_SIZE}"], "outside the vocabulary"),
        (["generate", "a", "--model", "/nonexistent/model"], "no such directory"),
        (["generate", "a", "--max-tokens", "0"], "--max-tokens must be >= 1"),
    ],
)
def test_usage_errors_exit_2_with_one_line_and_never_load_the_model(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_load_llm", lambda *args: pytest.fail("the model was loaded"))
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert message in err and err.startswith("hybridkv: error:") and err.count("\n") == 1


def test_the_installed_command_reports_errors_without_a_traceback() -> None:
    env = {"PATH": str(Path(sys.executable).parent)}
    run = subprocess.run(["hybridkv", "generate", ""], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2
    assert run.stderr == "hybridkv: error: the prompt is empty\n"


def test_greedy_output_matches_transformers_on_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    transformers = pytest.importorskip("transformers")
    prompt = "The function returns"
    assert cli.main(["generate", prompt, "--max-tokens", "12"]) == 0
    ours = capsys.readouterr().out

    model = transformers.Qwen3NextForCausalLM.from_pretrained(default_model_dir())
    ids = torch.tensor([TOKENIZER.encode(prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    new = [t for t in out[0, ids.shape[1] :].tolist() if t not in TOKENIZER.eos_token_ids]
    assert ours == TOKENIZER.decode(new)
    assert len(ours.split()) >= 3  # a trained model: words, not an immediate end of text


def _model_copy(path: Path, generation_config: dict[str, object] | None = None) -> Path:
    """The default model's files in `path` (weights linked), with another generation_config.json if given."""
    path.mkdir()
    for file in default_model_dir().iterdir():
        if file.suffix == ".safetensors":
            (path / file.name).symlink_to(file)
        else:
            shutil.copy(file, path / file.name)
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def _damaged(tmp_path: Path, kind: str) -> Path:
    """A model, or something given as one, that cannot load: what `kind` says."""
    if kind == "a file that is not a model":
        return Path(shutil.copy(default_model_dir() / "config.json", tmp_path))
    if kind == "a directory that holds no model":
        return tmp_path
    if kind == "a truncated GGUF file":
        data = (Path(__file__).parent / "data" / "gguf" / "qwen35-tiny-f32.gguf").read_bytes()
        (tmp_path / "tiny.gguf").write_bytes(data[: len(data) // 2])
        return tmp_path / "tiny.gguf"
    model = _model_copy(tmp_path / "model")
    weights = (default_model_dir() / "model.safetensors").read_bytes()
    if kind == "a truncated safetensors file":
        (model / "model.safetensors").unlink()
        (model / "model.safetensors").write_bytes(weights[: len(weights) // 3])
    elif kind == "a safetensors file with a corrupt header":
        (model / "model.safetensors").unlink()
        (model / "model.safetensors").write_bytes(weights[:8] + b"{garbage" + weights[16:])
    elif kind == "a truncated tokenizer.json":
        (model / "tokenizer.json").write_text('{"version": "1.0", "trunc')
    else:
        assert kind == "a truncated config.json"
        (model / "config.json").write_text('{"model_type": ')
    return model


@pytest.mark.parametrize("command", ["generate", "run"])
@pytest.mark.parametrize(
    ("kind", "named", "message"),
    [
        ("a truncated safetensors file", "model.safetensors", "not a valid safetensors file, truncated or corrupt"),
        ("a safetensors file with a corrupt header", "model.safetensors", "not a valid safetensors file"),
        ("a truncated GGUF file", "tiny.gguf", "truncated or corrupt"),
        ("a truncated tokenizer.json", "tokenizer.json", "not a valid tokenizer.json"),
        ("a truncated config.json", "config.json", "not valid JSON"),
        ("a directory that holds no model", "", "is not a model: it has no config.json and no .gguf file"),
        ("a file that is not a model", "config.json", "is not a model: a model is a directory with config.json"),
    ],
)
def test_a_damaged_model_or_no_model_is_one_line_naming_the_file(
    command: str, kind: str, named: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _damaged(tmp_path, kind)
    assert cli.main([command, "hi", "--model", str(model), "--max-tokens", "2", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridkv: error:") and err.count("\n") == 1, err
    assert message in err
    if named:
        assert f"{next(p for p in [model, *model.rglob('*')] if p.name == named)}" in err
    if "is not a model" in message:
        assert "config.json, tokenizer.json and model.safetensors" in err and ".gguf file" in err


def test_generate_and_run_sample_as_the_models_generation_config_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sampling = _model_copy(tmp_path / "sampling", {"do_sample": True, "temperature": 1.0, "eos_token_id": []})

    prompts = {"generate": "The function returns", "run": "Tell me about lists."}

    def output(command: str, seed: int, model: Path | None = None) -> str:
        argv = [command, prompts[command], "--max-tokens", "12", "--seed", str(seed), "--threads", "1"]
        assert cli.main(argv + (["--model", str(model)] if model else [])) == 0
        return capsys.readouterr().out

    greedy = TOKENIZER.decode(greedy_ids(TOKENIZER.encode(prompts["generate"]), 12))
    assert output("generate", 1) == greedy  # the default model says greedy
    assert output("run", 1) == output("run", 2)
    assert output("generate", 1, sampling) != output("generate", 2, sampling)
    assert output("run", 1, sampling) != output("run", 2, sampling)


@pytest.mark.parametrize("command", ["generate", "run"])
def test_help_shows_the_sampling_defaults(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: as the model's generation_config.json says, as in the server: greedy for the default" in out
    assert "sampling seed (default: random)" in out
