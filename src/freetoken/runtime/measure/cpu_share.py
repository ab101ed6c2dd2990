"""CPU threads that share the machine: as many as the cores this process may run on, fewer while other
processes keep some of those cores busy.

OpenMP threads (torch's and the expert kernel's) spin at their barriers; when another process holds one
of the cores, every barrier waits for the thread that lost its core, and a 2-core machine decodes at a
third of its speed. Sleeping waits cost the quiet case as much. So the engine measures instead, at safe
points: the busy time of its allowed cores (/proc/stat) less its own CPU time (os.times) is what other
processes used; the threads are the allowed cores less those, at least one, at most what was asked.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# /proc/stat columns after the cpu name: user nice system idle iowait irq softirq steal guest guest_nice
IDLE_COLUMNS = (3, 4)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def allowed_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


@functools.cache
def default_threads() -> int:
    """torch's own default thread count (the physical cores), taken before anything changed it."""
    import torch

    return torch.get_num_threads()


def clamp_threads(asked: int | None) -> int:
    """Threads for CPU compute: `asked` (None: torch's default, one per physical core), at most the
    allowed cores (a warning when it asks for more)."""
    cores = len(allowed_cores())
    if asked is None:
        return max(1, min(cores, default_threads()))
    if asked > cores:
        warnings.warn(
            f"--moe-cpu-threads {asked} is above the {cores} cores this process may use; using {cores}",
            stacklevel=2,
        )
        return cores
    return asked


def read_busy_ticks(cores: tuple[int, ...], stat: Path = Path("/proc/stat")) -> int | None:
    """Busy clock ticks (all but idle and iowait) summed over `cores`; None where /proc/stat is missing."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cores}
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name in wanted:
            values = [int(v) for v in fields[:8]]
            busy += sum(values) - sum(values[i] for i in IDLE_COLUMNS)
    return busy


def own_cpu_seconds() -> float:
    """User + system CPU time of this process, all its threads."""
    t = os.times()
    return t.user + t.system


@dataclass
class CoreShare:
    """Samples, at most every `interval_s`, how many of the allowed cores other processes leave."""

    cores: tuple[int, ...]
    interval_s: float = 0.5
    busy_ticks: Callable[[tuple[int, ...]], int | None] = read_busy_ticks
    own_seconds: Callable[[], float] = own_cpu_seconds
    clock: Callable[[], float] = time.monotonic
    ticks_per_s: float = CLOCK_TICKS
    _last: tuple[float, int, float] | None = None  # (time, busy ticks, own seconds)

    def free_cores(self) -> int | None:
        """Cores not used by other processes over the interval just ended (at least 1); None when the
        interval has not ended yet or the machine cannot say."""
        now, last = self.clock(), self._last
        if last is not None and now - last[0] < self.interval_s:
            return None  # cheap between samples: no file read
        busy, own = self.busy_ticks(self.cores), self.own_seconds()
        if busy is None:
            return None
        self._last = (now, busy, own)
        if last is None:
            return None
        elapsed = now - last[0]
        others = max(0.0, (busy - last[1]) / self.ticks_per_s - (own - last[2])) / elapsed  # in cores
        return max(1, len(self.cores) - int(others + 0.3))  # a core counts as taken from 70% busy


class CpuThreads:
    """The engine's CPU threads: at most `limit`, fewer while other processes hold some of the cores.
    `poll` at safe points; it sets torch's intra-op threads and says when the count changed."""

    def __init__(self, limit: int, share: CoreShare | None = None) -> None:
        import torch

        default_threads()  # torch's own default, remembered before the first change
        self.limit = limit
        self.share = share if share is not None else CoreShare(allowed_cores())
        self.current = limit
        self.changes = 0
        torch.set_num_threads(limit)

    def poll(self) -> int | None:
        """The new thread count when it changed, else None."""
        import torch

        free = self.share.free_cores()
        if free is None:
            return None
        threads = max(1, min(self.limit, free))
        if threads == self.current:
            return None
        self.current = threads
        self.changes += 1
        torch.set_num_threads(threads)
        return threads
