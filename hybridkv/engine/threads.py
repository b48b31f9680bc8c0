"""How many threads the engine's next steps use: the cores that other processes leave idle.

A parallel region ends when its slowest thread does. A thread that shares its core with a busy
process waits for its time slice (milliseconds) in every region, and a decode step runs hundreds
of them: on this 2-core machine, with one other CPU-bound process, torch's default of two threads
decoded 4–17× slower than one thread, and 10–50× with other work on the cores too. A passive
OpenMP wait policy (OMP_WAIT_POLICY, read when torch loads libgomp) comes close to one thread
there, but each region then wakes a sleeping thread: on an idle machine it decoded 2–4× slower
than the default. So the engine counts the CPU time other processes took on this process's cores
and runs on the cores they leave, looking again every half second:

    others = (busy time of our cores in /proc/stat − this process's CPU time) / wall time
    threads = floor(cores − others + 1/4), between 1 and torch's thread count at start
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

log = logging.getLogger("hybridkv.engine")

INTERVAL = 0.5  # seconds between two looks at the cores
FIRST_LOOK = 0.1  # the window of the first look, when made (/proc/stat counts in 10 ms ticks)
SLACK = 0.25  # a core counts as free while others use at most this share of it


class Sample(NamedTuple):
    """A reading: the clock, seconds the CPUs in our set were busy, seconds this process ran."""

    wall: float
    busy: float
    own: float


def read_sample(cpus: frozenset[int]) -> Sample:
    """Now, from /proc/stat's per-CPU lines (user, nice, system, irq, softirq and steal count as busy;
    idle and iowait do not) and this process's CPU time."""
    wall, own = time.monotonic(), time.process_time()
    ticks = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                values = [int(v) for v in fields[:8]]
                ticks += sum(values) - values[3] - values[4]  # all but idle and iowait
    return Sample(wall, ticks / os.sysconf("SC_CLK_TCK"), own)


class IdleCores:
    """Sets torch's thread count to the cores of this process's CPU set that other processes left
    idle (at least 1, at most `max_threads`: torch's count when this is made): first over a
    `first_look` window when made (so the model loads on that count: before the load, with two
    threads against a busy process, it took 2-7 s instead of 1), then at a step every `interval`
    seconds, over the time since the last look. Call `update()` from the thread that runs the
    model: OpenMP's thread count belongs to the calling thread."""

    def __init__(
        self,
        max_threads: int | None = None,
        interval: float = INTERVAL,
        first_look: float = FIRST_LOOK,
        sample: Callable[[frozenset[int]], Sample] = read_sample,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.cpus = cpus or frozenset(os.sched_getaffinity(0))
        self.max_threads = max_threads or torch.get_num_threads()
        self.interval = interval
        self.threads = self.max_threads
        self._sample = sample
        self._applied = False
        try:
            self._last: Sample | None = sample(self.cpus)
        except (OSError, ValueError) as e:  # no /proc/stat (not Linux): keep torch's count
            log.info("cannot see what other processes use of the cores (%s); using %d threads", e, self.max_threads)
            self._last = None
            return
        time.sleep(first_look)
        self._look()

    def others(self, now: Sample, before: Sample) -> float:
        """Cores' worth of CPU time other processes used between two readings."""
        wall = now.wall - before.wall
        return max(0.0, (now.busy - before.busy) - (now.own - before.own)) / wall if wall > 0 else 0.0

    def update(self) -> int:
        """The thread count for the next step, looked at again once `interval` seconds have passed."""
        if self._last is None or time.monotonic() - self._last.wall < self.interval:
            return self.threads
        return self._look()

    def _look(self) -> int:
        assert self._last is not None
        now = self._sample(self.cpus)
        others = self.others(now, self._last)
        self._last = now
        threads = max(1, min(self.max_threads, int(len(self.cpus) - others + SLACK)))
        if threads != self.threads:
            log.debug("other processes use %.1f of %d cores: %d thread(s)", others, len(self.cpus), threads)
            self.threads = threads
        # Set also when torch's count is the same, the first time: an explicit count decoded 5-8% faster
        # than torch's implicit default of the same count (it also fixes MKL's threads, no dynamic
        # adjustment). Checked at every look: a new thread (the server's engine) has its own count.
        if not self._applied or torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            self._applied = True
        return threads
