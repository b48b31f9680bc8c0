"""The engine runs on the cores other processes leave idle (`IdleCores`), unless --threads is given."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from hybridkv import cli
from hybridkv.engine.threads import IdleCores, Sample, read_sample


def readings(*samples: Sample) -> Iterator[Sample]:
    yield from samples


def governor(cores: int, max_threads: int, others: float, own: float = 0.0) -> IdleCores:
    """An IdleCores on `cores` CPUs whose second reading, 1 s after the first, shows other
    processes using `others` cores and this one `own`."""
    samples = readings(Sample(0.0, 0.0, 0.0), Sample(1.0, others + own, own))
    cores_set = frozenset(range(cores))
    made = IdleCores(max_threads, interval=0, sample=lambda cpus: next(samples))
    made.cpus = cores_set
    return made


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
    cores_governor = governor(cores, max_threads, others, own)
    assert cores_governor.update() == threads
    assert torch.get_num_threads() == threads


def test_a_busy_process_on_our_cores_takes_a_thread_away() -> None:
    cores = IdleCores(interval=0)  # reading this machine's /proc/stat
    if len(cores.cpus) < 2:
        pytest.skip("one core: always one thread")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        cores._last = read_sample(cores.cpus)  # measure from now, the hog running
        time.sleep(0.5)
        assert cores.update() <= len(cores.cpus) - 1
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
