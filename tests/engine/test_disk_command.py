"""The disk tier from the command line: `run` and `serve` keep one unless `--cache-disk 0`, its
directory and files private; `hybridkv cache ls` lists it per model and `clear` deletes it."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest

from hybridkv import cli
from hybridkv.engine.sampling import SamplingParams


def llm_for(*flags: str) -> Any:
    return cli.llm_from_args(cli._parser().parse_args(["run", *flags]))


def test_run_keeps_a_private_disk_cache_that_ls_lists_and_clear_deletes(
    chat_model: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_dir = tmp_path / "prefix"
    llm = llm_for("--model", str(chat_model[0]), "--cache-dir", str(cache_dir), "--cache-disk", "64MiB")
    assert llm.engine.disk is not None and llm.engine.disk.store.budget == 64 << 20
    llm.chat([{"role": "user", "content": "Something to keep on disk for later."}], SamplingParams(max_tokens=3))
    llm.close()
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    kept = [p for p in cache_dir.rglob("*") if p.is_file()]
    assert kept and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in kept)

    assert cli.main(["cache", "ls", "--cache-dir", str(cache_dir)]) == 0
    listed = capsys.readouterr().out
    assert "1 model(s)" in listed and chat_model[0].name in listed and " 0 states" not in listed
    assert cli.main(["cache", "clear", "--cache-dir", str(cache_dir)]) == 0
    assert not list(cache_dir.glob("*/*.kv")) and not list(cache_dir.glob("*/*.state"))
    cli.main(["cache", "ls", "--cache-dir", str(cache_dir)])
    assert "0 blocks, 0 states" in capsys.readouterr().out


def test_cache_disk_0_turns_it_off(chat_model: tuple[Path, Any], tmp_path: Path) -> None:
    llm = llm_for("--model", str(chat_model[0]), "--cache-dir", str(tmp_path / "unused"), "--cache-disk", "0")
    assert llm.engine.disk is None and not (tmp_path / "unused").exists()


def test_a_bad_cache_disk_size_is_a_usage_error(chat_model: tuple[Path, Any]) -> None:
    with pytest.raises(cli.UsageError, match="--cache-disk 'lots'"):
        llm_for("--model", str(chat_model[0]), "--cache-disk", "lots")
