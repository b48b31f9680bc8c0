"""`hybridkv generate`: what a user sees on stdout, stderr and in the exit status."""

from __future__ import annotations

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


def greedy_ids(prompt: list[int], n: int) -> list[int]:
    """The default model's greedy continuation, computed without the CLI or the engine."""
    cm = CachedModel.load(default_model_dir(), cache=CacheConfig(max_model_len=256, max_sequences=1))
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
