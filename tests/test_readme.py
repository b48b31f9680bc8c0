"""The README's code runs as written: every ```python block, and every ```sh block (with
`.venv/bin/` standing for the environment running the tests), each in a fresh process in a
temporary directory, offline.

A block that cannot run here — it blocks (`serve`), needs the network, a GPU, llama.cpp, an
ollama store or a model of the reader's own — carries `<!-- illustration -->` on the line before
its opening fence; one that runs for minutes carries `<!-- slow -->` and runs under `pytest -m slow`.
Blocks in other languages (text, output, none) are never run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\S*)\s*$")
MARKERS = {"<!-- illustration -->": "illustration", "<!-- slow -->": "slow"}
LANGUAGES = {"python": "python", "py": "python", "sh": "shell", "bash": "shell", "shell": "shell"}
HOW_TO_MARK = (
    "if this block cannot run in a test (it blocks like `serve`, needs the network, a GPU, llama.cpp, an "
    "ollama store or a model the reader brings), put <!-- illustration --> on the line just before its "
    "opening fence; if it runs for minutes, <!-- slow --> (it then runs under `pytest -m slow`)"
)


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    language: str  # "python", "shell", or the fence's own word ("" for none)
    code: str
    marker: str | None  # "illustration", "slow" or None

    def __str__(self) -> str:
        return f"README.md:{self.line} ({self.language or 'no language'})"


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of `text`, each with the marker on the line before its fence (if any)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"README.md:{i + 1}: a fence that is never closed"
        marker = MARKERS.get(lines[i - 1].strip()) if i else None
        word = opening[1]
        blocks.append(Block(i + 1, LANGUAGES.get(word, word), "\n".join(lines[i + 1 : end]) + "\n", marker))
        i = end + 1
    return blocks


BLOCKS = readme_blocks(README.read_text())
RUNNABLE = [b for b in BLOCKS if b.language in ("python", "shell") and b.marker != "illustration"]


def test_markers_sit_right_before_a_fence() -> None:
    lines = README.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if line.strip() in MARKERS:
            following = lines[number] if number < len(lines) else ""
            assert FENCE.match(following), f"README.md:{number}: {line.strip()} must be followed by a ``` fence"


def test_the_reader_can_find_the_blocks() -> None:
    # guards the parser: the README has Python and shell blocks and some are run
    assert {"python", "shell"} <= {b.language for b in RUNNABLE}
    assert any(b.marker == "illustration" for b in BLOCKS)


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, id=f"line{b.line}", marks=[pytest.mark.slow] if b.marker == "slow" else []) for b in RUNNABLE],
)
def test_readme_block_runs(block: Block, tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    if block.language == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code.replace(".venv/bin/", f"{bin_dir}/")]
    limit = 1800 if block.marker == "slow" else 300
    try:
        result = subprocess.run(
            command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block} ran for more than {limit} s; {HOW_TO_MARK}")
    tail = "\n".join(result.stderr.strip().splitlines()[-12:])
    assert result.returncode == 0, f"{block} failed (exit {result.returncode}):\n{tail}\n\n{HOW_TO_MARK}"


def test_the_bench_durations_agree_between_readme_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv import cli

    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    in_help = re.search(r"about (\d+) s instead of about (\d+) s", help_text)
    in_readme = re.search(r"hybridkv bench .*# about (\d+) s \(--quick: about (\d+) s\)", README.read_text())
    assert in_help and in_readme, "the bench's durations are no longer stated in `bench --help` and README.md"
    assert (in_help[1], in_help[2]) == (in_readme[2], in_readme[1])  # (quick, full) in both
