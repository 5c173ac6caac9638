"""CPU time of the benchmark's processes from /proc, to show that a point measured the system
and not this machine: a process near a whole core queues work the model does not have.

`CpuMeter` reads each process's utime + stime (its whole process group: a component that forks
counts with its children) at the start and end of a point; a process's share is its CPU seconds
over the point's wall seconds (1.0 = one core busy throughout). Linux only; elsewhere the shares
are empty.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read_stat(path: str) -> tuple[str, list[str]] | None:
    """A ``/proc/.../stat`` file: (comm, the fields after it; state is field 0), None if gone."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def _stat_fields(pid: int) -> list[str] | None:
    stat = _read_stat(f"/proc/{pid}/stat")
    return None if stat is None else stat[1]


def _cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (clock ticks)


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all its threads) of one live process; OSError if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(f"no process {pid}")
    return _cpu_s(fields)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of one live process's threads, summed by thread name (Python's
    main thread is ``python``, Dynamo's Rust runtime threads ``tokio-rt-worker``, gRPC's its own):
    where a process's CPU goes without a profiler. Threads that already ended are not counted."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        stat = _read_stat(f"/proc/{pid}/task/{tid}/stat")
        if stat is not None:
            out[stat[0]] = out.get(stat[0], 0.0) + _cpu_s(stat[1])
    return out


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in process group ``pgid``."""
    total = 0
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None and int(fields[2]) == pgid:  # field 2: process group
            total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / _TICKS


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy (not idle, not waiting on I/O) since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(values) - values[3] - values[4]) / _TICKS


def own_cpu_s() -> float:
    """This process's CPU seconds (the benchmark client runs here)."""
    t = os.times()
    return t.user + t.system


class CpuMeter:
    """CPU share per labelled process group between `start` and `stop`; ``client``: this process."""

    def __init__(self, groups: Mapping[str, int]):
        self.groups = dict(groups)
        self._begin: dict[str, float] = {}
        self._t0 = 0.0

    def _read(self) -> dict[str, float]:
        out = {label: group_cpu_s(pgid) for label, pgid in self.groups.items()}
        out["client"] = own_cpu_s()
        return out

    def start(self) -> None:
        self._begin, self._t0 = self._read(), time.monotonic()

    def stop(self) -> dict[str, float]:
        """Cores used by each process over the interval (CPU seconds / wall seconds)."""
        end, wall = self._read(), time.monotonic() - self._t0
        if wall <= 0:
            return {}
        return {label: max(0.0, end[label] - self._begin.get(label, 0.0)) / wall for label in end}
