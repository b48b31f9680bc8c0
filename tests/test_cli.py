"""`hybridkv generate`: what a user sees on stdout, stderr and in the exit status."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from hybridkv import cli
from hybridkv.default_model import IM_END_ID, VOCAB_SIZE, materialize


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("home")
    materialize(home)
    return home


@pytest.fixture(autouse=True)
def _default_model_in_tmp(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_HOME", str(home))


class ScriptedModel:
    """Stands in for `CachedModel`: the k-th forward puts all probability on `script[k]`."""

    def __init__(self, script: Sequence[int]) -> None:
        self.script = list(script)
        self.feeds: list[list[int]] = []
        self.released: list[int] = []

    def new_sequence(self) -> int:
        return 5

    def feed(self, tokens: Mapping[int, list[int]], logits: str) -> dict[int, torch.Tensor]:
        assert logits == "last" and list(tokens) == [5]
        self.feeds.append(list(tokens[5]))
        out = torch.full((1, VOCAB_SIZE), -1e9)
        out[0, self.script[len(self.feeds) - 1]] = 0.0
        return {5: out}

    def release(self, seq: int) -> None:
        self.released.append(seq)


def _scripted(monkeypatch: pytest.MonkeyPatch, script: Sequence[int]) -> ScriptedModel:
    model = ScriptedModel(script)
    monkeypatch.setattr(cli, "_load_model", lambda *args: model)
    return model


def test_streams_the_continuation_and_stops_at_end_of_sequence(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _scripted(monkeypatch, [*"é!".encode(), IM_END_ID, ord("x")])
    assert cli.main(["generate", "Hi"]) == 0
    out, err = capsys.readouterr()
    assert out == "é!"  # only the new text; the end token is not printed
    assert model.feeds == [[ord("H"), ord("i")], [0xC3], [0xA9], [ord("!")]]
    assert model.released == [5]
    assert "end-of-sequence" in err


def test_stops_after_max_tokens_without_feeding_the_last_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _scripted(monkeypatch, list(b"abcdef"))
    assert cli.main(["generate", "--prompt-ids", "1,2", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out == "abc"
    assert model.feeds == [[1, 2], [ord("a")], [ord("b")]]


def test_prompt_and_generated_tokens_fit_max_model_len(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    model = _scripted(monkeypatch, list(b"abcdef"))
    assert cli.main(["generate", "xyz", "--max-model-len", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == "ab"
    assert model.feeds == [list(b"xyz"), [ord("a")]]  # 3 + 2 = 5 tokens in all
    assert "full context" in err


class FlatModel(ScriptedModel):
    """Equal odds for every lowercase letter."""

    def __init__(self) -> None:
        super().__init__([])

    def feed(self, tokens: Mapping[int, list[int]], logits: str) -> dict[int, torch.Tensor]:
        out = torch.full((1, VOCAB_SIZE), -1e9)
        out[0, ord("a") : ord("z") + 1] = 0.0
        return {5: out}


def test_sampling_is_reproducible_with_a_seed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_load_model", lambda *args: FlatModel())

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
        (["generate", "abcdef", "--max-model-len", "6"], "no room left in the context"),
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
    monkeypatch.setattr(cli, "_load_model", lambda *args: pytest.fail("the model was loaded"))
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert message in err and err.startswith("hybridkv: error:") and err.count("\n") == 1


def test_the_installed_command_reports_errors_without_a_traceback(home: Path) -> None:
    env = {"HYBRIDKV_HOME": str(home), "PATH": str(Path(sys.executable).parent)}
    run = subprocess.run(["hybridkv", "generate", ""], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2
    assert run.stderr == "hybridkv: error: the prompt is empty\n"


def test_greedy_output_matches_transformers_on_the_default_model(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    prompt = "The function returns"
    assert cli.main(["generate", prompt, "--max-tokens", "12"]) == 0
    ours = capsys.readouterr().out

    model = transformers.Qwen3NextForCausalLM.from_pretrained(materialize(home))
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert ours == bytes(out[0, ids.shape[1] :].tolist()).decode()
