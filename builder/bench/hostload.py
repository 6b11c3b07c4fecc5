"""The host's load before and after a target's runs: figures from a busy machine are low, and a
bench that does not say so misleads. Linux's /proc/stat gives the share of all CPUs busy over a short
sample; elsewhere only the load average is known."""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BUSY_WARN = 0.25  # of all CPUs, busy while nothing of the bench runs
SAMPLE_S = 1.0
PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class HostLoad:
    cpus: int
    load1: float  # the 1-minute load average
    busy: float | None  # share of all CPUs busy during the sample; None where /proc/stat is not

    def to_json(self) -> dict:
        return asdict(self)


def _cpu_times(path: Path) -> tuple[int, int] | None:
    """(busy, total) jiffies from /proc/stat's first line, None when it cannot be read."""
    try:  # user nice system idle iowait irq softirq steal [guest guest_nice: already counted in user and nice]
        fields = [int(x) for x in path.read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def sample(seconds: float | None = None, path: Path = PROC_STAT) -> HostLoad:
    before = _cpu_times(path)
    time.sleep(SAMPLE_S if seconds is None else seconds)
    after = _cpu_times(path)
    busy = None
    if before and after and after[1] > before[1]:
        busy = round((after[0] - before[0]) / (after[1] - before[1]), 3)
    return HostLoad(cpus=os.cpu_count() or 1, load1=round(os.getloadavg()[0], 2), busy=busy)


def warning(when: str, load: HostLoad) -> str | None:
    """A line for the result when the host was busy WHEN (before/after) the target ran."""
    if load.busy is not None:
        if load.busy > BUSY_WARN:
            return (f"the host was busy {when} this target ran ({load.busy:.0%} of {load.cpus} CPUs in use by "
                    f"other processes): its figures may be low")
        return None
    if load.load1 > BUSY_WARN * load.cpus:
        return f"the host's load average was {load.load1} {when} this target ran ({load.cpus} CPUs)"
    return None
