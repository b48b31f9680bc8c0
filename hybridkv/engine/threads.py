"""How many threads the engine's next steps use: the cores that other processes leave idle.

A parallel region ends when its slowest thread does. A thread that shares its core with a busy
process waits for its time slice (milliseconds) in every region, and a decode step runs hundreds
of them: on a 2-core machine with one other CPU-bound process, two threads decoded 7–50× slower
than one. A passive OpenMP wait policy halves the loss but slows every step on an idle machine
(each region then wakes a sleeping thread), so instead the engine counts, every half second, the
CPU time other processes took on this process's cores and runs on the cores they leave:

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
FIRST_LOOK = 0.05  # the shortest window the first look takes (/proc/stat counts in 10 ms ticks)
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
    """Sets torch's thread count, at most every `interval` seconds, to the cores of this process's
    CPU set that other processes left idle since the last look (at least 1, at most `max_threads`,
    torch's count when this is made). Make it before loading the model, so the first look, at the
    first step, covers the load. Call `update()` from the thread that runs the model: OpenMP's thread
    count belongs to the calling thread."""

    def __init__(
        self,
        max_threads: int | None = None,
        interval: float = INTERVAL,
        sample: Callable[[frozenset[int]], Sample] = read_sample,
    ) -> None:
        self.cpus = frozenset(os.sched_getaffinity(0))
        self.max_threads = max_threads or torch.get_num_threads()
        self.interval = interval
        self.threads = self.max_threads
        self._sample = sample
        self._looked = False
        try:
            self._last: Sample | None = sample(self.cpus)
        except (OSError, ValueError) as e:  # no /proc/stat (not Linux): keep torch's count
            log.info("cannot see what other processes use of the cores (%s); using %d threads", e, self.max_threads)
            self._last = None

    def others(self, now: Sample, before: Sample) -> float:
        """Cores' worth of CPU time other processes used between two readings."""
        wall = now.wall - before.wall
        return max(0.0, (now.busy - before.busy) - (now.own - before.own)) / wall if wall > 0 else 0.0

    def update(self) -> int:
        """The thread count for the next step: decided at the first step that comes `FIRST_LOOK`
        seconds after this was made, then again every `interval` seconds."""
        if self._last is None or time.monotonic() - self._last.wall < (self.interval if self._looked else FIRST_LOOK):
            return self.threads
        now = self._sample(self.cpus)
        others = self.others(now, self._last)
        self._last, self._looked = now, True
        threads = max(1, min(self.max_threads, int(len(self.cpus) - others + SLACK)))
        if threads != self.threads:
            log.debug("other processes use %.1f of %d cores: %d thread(s)", others, len(self.cpus), threads)
            self.threads = threads
        if torch.get_num_threads() != threads:  # also on this thread's first step (a new OpenMP thread)
            torch.set_num_threads(threads)
        return threads
