"""Which machine boot and which process: for telling a live holder from a dead one."""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def boot_id() -> str:
    """Changes at every reboot: a pid recorded before it names no process now."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None when it is gone), so a
    reused pid is not taken for the process that had it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name


def is_alive(pid: int, ticks: int | None) -> bool:
    """Whether the process ``pid`` that started at ``ticks`` still runs on this boot."""
    now = start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)


def started_at(pid: int) -> float | None:
    """When the process ``pid`` started (Unix time), or None when there is none."""
    ticks = start_ticks(pid)
    if ticks is None:
        return None
    try:
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")
