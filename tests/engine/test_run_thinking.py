"""`hybridkv run` with a thinking model: reasoning set apart from the answer (marked, dimmed on a
terminal, or hidden) and thinking switched on and off with --think/--no-think and /think."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import make_hf_model, save_checkpoint
from qwen35_tokenizer import COMPACT_VOCAB, write_qwen35_tokenizer

from hybridkv import cli
from hybridkv.chat import HELP, AnswerPrinter
from hybridkv.engine.tokenizer import Tokenizer

# Each token's successor in the scripted model's greedy answers.
SCRIPT = ["\n", "h", "m", "</think>", "\n\n", "O", "K", "<|im_end|>"]
PLAIN = "Thinking...\nhm\n...done thinking.\n\nOK"


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-Next with the Qwen3.5 template (thinking on by default) and a fixed greedy
    answer: every block's output projection is zero, so the last hidden state is the last token's
    embedding, and embeddings and LM head make a bigram table that follows SCRIPT. A prompt ending
    "<think>\\n" gets "hm</think>\\n\\nOK", one ending "</think>\\n\\n" (thinking off) gets "OK"."""
    path = write_qwen35_tokenizer(tmp_path_factory.mktemp("qwen35-thinking"), template="3.5", compact=True)
    tokenizer = Tokenizer.from_dir(path)
    ids = [tokenizer.encode(text) for text in SCRIPT]
    assert all(len(i) == 1 for i in ids), ids
    model = make_hf_model(seed=3, vocab_size=COMPACT_VOCAB)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")):
                param.zero_()
        model.model.norm.weight.zero_()  # Qwen3-Next scales by (1 + w)
        model.lm_head.weight.zero_()
        for dim, ([token], [successor]) in enumerate(zip(ids[:-1], ids[1:], strict=True)):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(dim), 64).float()
            model.lm_head.weight[successor, dim] = 1.0
    save_checkpoint(model, path)
    write_qwen35_tokenizer(path, template="3.5", compact=True)  # its generation_config.json, not transformers'
    return path


def run(capsys: pytest.CaptureFixture[str], model: Path, *args: str, stdin: str | None = None) -> tuple[str, str]:
    argv = ["run", "--model", str(model), "--max-tokens", "12", "--temperature", "0", *args]
    if stdin is not None:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "stdin", io.StringIO(stdin))
            assert cli.main(argv) == 0
    else:
        assert cli.main(argv) == 0
    return capsys.readouterr()


def prompt_tokens(stderr: str) -> list[int]:
    return [int(n) for n in re.findall(r"\[prompt (\d+) tokens", stderr)]


def hf_prompt_tokens(model: Path, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    """The prompt's length as transformers renders and tokenizes it."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(hf.encode(text, add_special_tokens=False))


def test_reasoning_is_marked_off_from_the_answer(capsys: pytest.CaptureFixture[str], thinking_model: Path) -> None:
    out, err = run(capsys, thinking_model, "Hi")
    assert out == PLAIN
    assert prompt_tokens(err) == [hf_prompt_tokens(thinking_model, [{"role": "user", "content": "Hi"}])]


def test_a_terminal_shows_reasoning_dimmed(capsys: pytest.CaptureFixture[str], thinking_model: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.stdout, "isatty", lambda: True)
        out, _ = run(capsys, thinking_model, "Hi")
    assert out == "\033[2mhm\033[0m\n\nOK"


def test_hide_thinking_prints_only_the_answer(capsys: pytest.CaptureFixture[str], thinking_model: Path) -> None:
    out, err = run(capsys, thinking_model, "Hi", "--hide-thinking")
    assert out == "OK"
    assert "7 generated" in err  # the reasoning was generated, just not shown


def test_no_think_renders_the_closed_think_block(capsys: pytest.CaptureFixture[str], thinking_model: Path) -> None:
    off, off_err = run(capsys, thinking_model, "Hi", "--no-think")
    on, on_err = run(capsys, thinking_model, "Hi", "--think")
    assert (off, on) == ("OK", PLAIN)
    messages = [{"role": "user", "content": "Hi"}]
    assert prompt_tokens(off_err) == [hf_prompt_tokens(thinking_model, messages, enable_thinking=False)]
    assert prompt_tokens(on_err) == [hf_prompt_tokens(thinking_model, messages)]
    assert prompt_tokens(off_err)[0] == prompt_tokens(on_err)[0] + 2  # "\n\n</think>\n\n" for "\n"


def test_think_command_switches_thinking_from_the_next_answer(
    capsys: pytest.CaptureFixture[str], thinking_model: Path
) -> None:
    out, err = run(capsys, thinking_model, stdin="Hi\n/think off\nAgain\n/think maybe\n/think on\n/reset\nHi\n")
    assert out.replace("> ", "") == PLAIN + "OK" + PLAIN
    first, second, third = prompt_tokens(err)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "hm</think>\n\nOK"},  # the template drops the old reasoning
        {"role": "user", "content": "Again"},
    ]
    assert second == hf_prompt_tokens(thinking_model, history, enable_thinking=False)
    assert first == third
    assert "(thinking off from the next answer)" in err and "(usage: /think on|off)" in err
    assert "/think on|off" in HELP


def test_a_template_without_the_switch_says_so(
    capsys: pytest.CaptureFixture[str], chat_model: tuple[Path, Any]
) -> None:
    _, err = run(capsys, chat_model[0], "Hi", "--no-think")
    assert "no enable_thinking switch" in err


@pytest.mark.parametrize(
    ("thinking", "want"),
    [("plain", PLAIN), ("dim", "\033[2mhm\033[0m\n\nOK"), ("hide", "OK")],
)
def test_printer_splits_tags_cut_across_pieces(capsys: pytest.CaptureFixture[str], thinking: Any, want: str) -> None:
    printer = AnswerPrinter(reasoning=True, thinking=thinking)
    for piece in ["\nh", "m\n</th", "ink", ">\n", "\nO", "K"]:
        printer.push(piece)
    printer.finish()
    assert capsys.readouterr().out == want


def test_printer_closes_reasoning_cut_short(capsys: pytest.CaptureFixture[str]) -> None:
    printer = AnswerPrinter(reasoning=True, thinking="dim")
    printer.push("still thinking")
    printer.finish()
    assert capsys.readouterr().out == "\033[2mstill thinking\033[0m\n\n"  # the terminal is not left dim
