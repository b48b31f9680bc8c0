"""Errors of the engine flags name the flags a user typed, not the settings they map to."""

from __future__ import annotations

import pytest

from hybridkv import cli


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("hybridkv: error:") and err.count("\n") == 1
    return err


def test_a_cache_memory_too_small_for_one_sequence_says_how_much_is_needed(capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(["generate", "a", "--cache-memory", "1KiB", "--max-model-len", "4096"], capsys)
    assert "--cache-memory 1KiB is too small" in err and "--max-model-len 4096" in err
    assert "CacheConfig" not in err and "kv_bytes" not in err
    least = err.split("give --cache-memory ")[1].split()[0]
    assert cli.main(["generate", "a", "--cache-memory", least, "--max-model-len", "4096", "--max-tokens", "1"]) == 0
    capsys.readouterr()
    smaller = f"{int(least.removesuffix('MiB')) - 1}MiB"
    assert "is too small" in error_of(["generate", "a", "--cache-memory", smaller, "--max-model-len", "4096"], capsys)


def test_a_cache_memory_beyond_this_machine_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    err = error_of(["generate", "a", "--cache-memory", "1000000GiB"], capsys)
    assert "more than 90% of available memory" in err and "lower --cache-memory" in err
    assert "cache budget" not in err


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--num-speculative-tokens", "17", "--num-speculative-tokens must be an int in 1..16"),
        ("--speculative-budget", "0", "--speculative-budget must be a positive int"),
    ],
)
def test_bad_speculation_flags_name_the_flag(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = error_of(["generate", "a", "--speculative", "ngram", flag, value], capsys)
    assert says in err and "draft_budget" not in err and "num_speculative_tokens" not in err


def test_speculation_flags_reach_the_engine_config() -> None:
    from hybridkv.engine.speculative import SpeculativeConfig

    args = cli._parser().parse_args(["serve", "--speculative", "auto", "--speculative-budget", "4"])
    assert cli.speculative_config(args) == SpeculativeConfig("auto", None, draft_budget=4)
    args = cli._parser().parse_args(["run", "--speculative", "mtp", "--num-speculative-tokens", "2"])
    assert cli.speculative_config(args) == SpeculativeConfig("mtp", 2)
