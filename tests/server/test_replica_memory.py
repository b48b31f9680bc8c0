"""`serve --replicas` reads the machine's memory once, before any worker loads, and gives every
worker the same share of it (`MemoryShare`): read by each worker after the others had loaded, each
would size its default cache as if it were alone. A worker that cannot fit says so in the flags a
user can change."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from hybridkv import cli
from hybridkv.models.weights import MemoryShare
from hybridkv.server.auth import Access
from hybridkv.server.replicas import Worker, plan_workers


def serve_args(*flags: str) -> argparse.Namespace:
    return cli._parser().parse_args(["serve", "--replicas", "2", *flags])


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[list[Worker], list[str]]]]:
    """plan_workers' result for each call, its sockets closed afterwards; MemAvailable reads counted."""
    reads: list[int] = []

    def available() -> int:
        reads.append(1)
        return 48 << 30

    monkeypatch.setattr("hybridkv.models.weights.available_memory", available)
    plans: list[tuple[list[Worker], list[str]]] = []
    yield plans
    assert len(reads) == len(plans)  # once per plan, before any worker starts
    for workers, _ in plans:
        for w in workers:
            w.sock.close()


def share_of(command: list[str]) -> MemoryShare:
    assert command.count("--memory-share") == 1
    return MemoryShare.parse(command[command.index("--memory-share") + 1])


def test_every_worker_and_the_spare_plan_in_one_share(planned: list[tuple[list[Worker], list[str]]]) -> None:
    for flags, copies in (((), 3), (("--no-spare",), 2)):
        workers, spawner = plan_workers(serve_args(*flags), Access(), None)
        planned.append((workers, spawner.command))
        assert share_of(spawner.command) == MemoryShare(48 << 30, copies=copies, caches=2)


def test_a_worker_takes_its_share_from_the_command_line(planned: list[tuple[list[Worker], list[str]]]) -> None:
    workers, spawner = plan_workers(serve_args("--cache-memory", "2GiB"), Access(), None)
    planned.append((workers, spawner.command))
    worker = cli._parser().parse_args(spawner.command[spawner.command.index("serve") :])
    assert worker.standby and worker.memory_share == MemoryShare(48 << 30, 3, 2)
    assert worker.cache_memory == str(1 << 30)  # the budget split between the replicas, as before


def test_a_worker_whose_share_is_too_small_names_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli._parser().parse_args(["serve", "--standby", "--memory-share", f"{64 << 20},3,2"])
    with pytest.raises(cli.UsageError) as e:
        cli.llm_from_args(args)  # refused before the weights load
    message = str(e.value)
    assert "3 copies of the weights" in message and "2 caches" in message and "fewer --replicas" in message
    assert "--no-spare" in message


def test_a_malformed_share_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli._parser().parse_args(["serve", "--standby", "--memory-share", "lots"])
    assert e.value.code == 2 and "AVAILABLE_BYTES,COPIES,CACHES" in capsys.readouterr().err
