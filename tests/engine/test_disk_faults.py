"""The disk tier's faults: a process killed between a temp write and its rename, a flipped byte,
a truncated file, another model's file, the budget reached, a real full disk (ENOSPC on a small
tmpfs). Every case answers as a server without a disk tier does, and says what happened in a
log line; a bad file is deleted."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_model import write_chat_model

from hybridkv import CacheConfig
from hybridkv.engine.engine import EngineConfig
from hybridkv.engine.llm import LLM
from hybridkv.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
FIRST = [
    {"role": "system", "content": "You are terse, and you say so at every opportunity you get."},
    {"role": "user", "content": "What comes after the number forty-one, and why?"},
]
ROOT = Path(__file__).resolve().parents[2]
Messages = list[dict[str, str]]


def make_llm(model: Path, cache_dir: Path | None, cache_disk: int | None = None) -> LLM:
    cache = CacheConfig(max_sequences=5, max_model_len=1024, snapshots_per_sequence=16)
    disk = {"cache_dir": cache_dir, "cache_disk": cache_disk} if cache_dir else {"cache_disk": 0}
    return LLM(model, cache=cache, engine=EngineConfig(max_num_seqs=2), **disk)


@pytest.fixture(scope="module")
def reference(chat_model: tuple[Path, Any]) -> Messages:
    """The second turn's messages: the first turn, its answer, a new question."""
    first = make_llm(chat_model[0], None).chat(FIRST, GREEDY)
    return [*FIRST, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And then?"}]


@pytest.fixture
def disk_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="hybridkv.disk"):
        yield caplog


def write_first_turn(model: Path, cache_dir: Path, cache_disk: int | None = None) -> None:
    llm = make_llm(model, cache_dir, cache_disk)
    llm.chat(FIRST, GREEDY)
    llm.close()


def second_turn(model: Path, cache_dir: Path, messages: Messages, cache_disk: int | None = None) -> int:
    """Answer the second turn from `cache_dir` in a fresh LLM and check the answer against a fresh
    recompute of the same prompt ids; returns the prompt tokens it computed."""
    llm = make_llm(model, cache_dir, cache_disk)
    ids, _ = llm.encode_chat(messages)  # the first answer's generated ids when the disk kept them
    out = llm.chat(messages, GREEDY)
    llm.cm.cache.check_integrity()
    llm.close()
    want = make_llm(model, None).generate(ids, GREEDY)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    return out.usage.computed_tokens


def files(cache_dir: Path, suffix: str) -> list[Path]:
    return sorted(p for p in cache_dir.glob(f"*/*{suffix}") if not p.name.startswith("."))


def cached_bytes(cache_dir: Path) -> int:
    return sum(p.stat().st_size for suffix in (".kv", ".state") for p in files(cache_dir, suffix))


def test_the_second_turn_comes_from_disk(chat_model: tuple[Path, Any], tmp_path: Path, reference: Messages) -> None:
    """The baseline the faults are measured against: a good directory saves the first turn."""
    write_first_turn(chat_model[0], tmp_path)
    computed_with_disk = second_turn(chat_model[0], tmp_path, reference)
    computed_without = second_turn(chat_model[0], tmp_path / "elsewhere", reference)
    assert computed_with_disk < computed_without / 2


@pytest.mark.parametrize("fault", ["flipped byte", "truncated", "another model's file"])
@pytest.mark.parametrize("suffix", [".state", ".kv"])
def test_a_bad_file_is_a_miss_deleted_and_logged(
    chat_model: tuple[Path, Any],
    tmp_path: Path,
    reference: Messages,
    disk_logs: pytest.LogCaptureFixture,
    fault: str,
    suffix: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    write_first_turn(chat_model[0], tmp_path)
    bad = files(tmp_path, suffix)
    assert bad
    if fault == "another model's file":
        other_dir = tmp_path_factory.mktemp("other-cache")
        write_first_turn(write_chat_model(tmp_path_factory.mktemp("other-model"), seed=6)[0], other_dir)
        foreign = files(other_dir, suffix)[0]
    for path in bad:
        if fault == "flipped byte":
            data = bytearray(path.read_bytes())
            data[len(data) // 2 + 7] ^= 0x10
            path.write_bytes(bytes(data))
        elif fault == "truncated":
            os.truncate(path, path.stat().st_size // 2)
        else:
            shutil.copyfile(foreign, path)
    computed = second_turn(chat_model[0], tmp_path, reference)
    assert computed > 1  # not all of it came from disk
    why = {"flipped byte": "checksum mismatch", "truncated": "truncated", "another model's file": "another model"}
    logged = [r.getMessage() for r in disk_logs.records if why[fault] in r.getMessage()]
    assert logged and all("deleted" in line and any(str(p) in line for p in bad) for line in logged)


def test_a_write_killed_before_its_rename(
    chat_model: tuple[Path, Any], tmp_path: Path, reference: Messages, disk_logs: pytest.LogCaptureFixture
) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests" / "engine")!r})
        from test_disk_faults import write_first_turn
        write_first_turn(__import__("pathlib").Path(sys.argv[1]), __import__("pathlib").Path(sys.argv[2]))
        """
    )
    env = {**os.environ, "HYBRIDKV_TEST_KILL_BEFORE_RENAME": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    done = subprocess.run([sys.executable, "-c", script, str(chat_model[0]), str(tmp_path)], env=env, timeout=300)
    assert done.returncode == -signal.SIGKILL
    left = list(tmp_path.glob("*/.tmp-*"))
    assert left and not files(tmp_path, ".kv") and not files(tmp_path, ".state")
    second_turn(chat_model[0], tmp_path, reference)
    assert not any(p.exists() for p in left)
    assert any("interrupted write" in r.getMessage() for r in disk_logs.records)


def test_the_budget_reached_evicts_the_least_recently_used(
    chat_model: tuple[Path, Any], tmp_path: Path, reference: Messages, disk_logs: pytest.LogCaptureFixture
) -> None:
    write_first_turn(chat_model[0], tmp_path)
    used = cached_bytes(tmp_path)
    budget = used // 3
    second_turn(chat_model[0], tmp_path, reference, cache_disk=budget)
    # the first write of the second process found the directory over its budget
    assert any("budget reached" in r.getMessage() for r in disk_logs.records)
    assert cached_bytes(tmp_path) <= budget


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk(
    chat_model: tuple[Path, Any], small_tmpfs: Path, reference: Messages, disk_logs: pytest.LogCaptureFixture
) -> None:
    write_first_turn(chat_model[0], small_tmpfs, cache_disk=1 << 30)
    assert any("the disk is full" in r.getMessage() for r in disk_logs.records)
    second_turn(chat_model[0], small_tmpfs, reference, cache_disk=1 << 30)
