"""The engine runs on the cores other processes leave idle (`IdleCores`), unless --threads is given."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from hybridkv import cli
from hybridkv.engine.threads import IdleCores, Sample


def governor(cores: int, max_threads: int, *looks: tuple[float, float]) -> IdleCores:
    """An IdleCores on `cores` CPUs whose readings, 1 s apart, show other processes using
    `others` cores and this one `own`, for each (others, own) in `looks`."""
    samples = [Sample(0.0, 0.0, 0.0)]
    for others, own in looks:
        last = samples[-1]
        samples.append(Sample(last.wall + 1, last.busy + others + own, last.own + own))
    readings = iter(samples)
    return IdleCores(max_threads, 0, 0, lambda cpus: next(readings), frozenset(range(cores)))


@pytest.mark.parametrize(
    ("cores", "max_threads", "others", "own", "threads"),
    [
        (2, 2, 0.0, 2.0, 2),  # idle machine, this process busy on both cores: both stay
        (2, 2, 0.1, 1.0, 2),  # a little background work: not worth a core
        (2, 2, 0.67, 1.3, 1),  # one CPU-bound process sharing the cores with our two threads
        (2, 2, 1.0, 1.0, 1),  # ... and with our one thread: it keeps its core
        (2, 2, 1.9, 0.1, 1),  # both cores busy elsewhere: never fewer than one thread
        (16, 16, 3.5, 8.0, 12),
        (16, 4, 0.0, 4.0, 4),  # never more than torch's count at start
    ],
)
def test_threads_are_the_cores_other_processes_leave_idle(
    cores: int, max_threads: int, others: float, own: float, threads: int
) -> None:
    made = governor(cores, max_threads, (others, own))  # the first look, when made: before the model loads
    assert made.threads == torch.get_num_threads() == threads


def test_the_count_follows_other_processes_as_they_come_and_go() -> None:
    made = governor(2, 2, (0.0, 0.5), (1.0, 1.0), (1.0, 1.0), (0.05, 2.0))
    assert made.threads == 2
    assert [made.update(), made.update(), made.update()] == [1, 1, 2]
    assert torch.get_num_threads() == 2


def test_a_busy_process_on_our_cores_takes_a_thread_away() -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: always one thread")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # the hog running
        cores = IdleCores(first_look=0.5)  # reading this machine's /proc/stat
        assert cores.threads <= len(cores.cpus) - 1
    finally:
        hog.kill()
        hog.wait()


def test_help_states_the_default_thread_count(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("generate", "run", "serve"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        threads = torch.get_num_threads()
        assert f"(default: as many of the {threads} torch would use as other processes leave idle" in out
