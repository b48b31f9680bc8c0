"""`hybridkv run`: one answer, or a chat whose later turns reuse the cache (as stderr reports)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

COMMAND = [sys.executable, "-m", "hybridkv.cli", "run", "--max-tokens", "5", "--temperature", "0"]


def run(chat_model: tuple[Path, Any], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, "--model", str(chat_model[0]), *args], input=stdin, capture_output=True, text=True, timeout=120
    )


def turns(stderr: str) -> list[tuple[int, int, int]]:
    """(prompt tokens, reused, computed) per answered turn."""
    found = re.findall(r"\[prompt (\d+) tokens: (\d+) reused, (\d+) computed", stderr)
    return [(int(a), int(b), int(c)) for a, b, c in found]


def test_one_prompt_streams_one_answer(chat_model: tuple[Path, Any]) -> None:
    result = run(chat_model, "Hello there")
    assert result.returncode == 0, result.stderr
    assert result.stdout  # the answer, and nothing else, on stdout
    [(prompt, reused, computed)] = turns(result.stderr)
    assert reused == 0 and computed == prompt == 19 + len("Hello there")  # ChatML around the message


def test_interactive_chat_reuses_the_cache_and_handles_commands(chat_model: tuple[Path, Any]) -> None:
    result = run(chat_model, stdin="hi\nhow are you\n/regenerate\n/stats\n/reset\nhi\n/bogus\n")
    assert result.returncode == 0, result.stderr
    first, second, regenerated, after_reset = turns(result.stderr)
    assert first == (21, 0, 21)
    assert second[1] == 21 + 5 - 1  # the first turn's prompt and answer, all but its last token
    assert regenerated == (second[0], second[0] - 1, 1)  # only the token whose logits are needed
    assert after_reset == (21, 20, 1)  # the same opening message as turn 1
    assert "requests finished 3" in result.stderr
    assert "unknown command /bogus" in result.stderr


def test_bad_flags_exit_2_without_a_traceback(chat_model: tuple[Path, Any]) -> None:
    result = run(chat_model, "hi", "--cache-memory", "lots")
    assert result.returncode == 2
    assert "cache-memory" in result.stderr and "Traceback" not in result.stderr
