"""Which machine boot and which process: for telling a live holder from a dead one.

Portable through psutil (Linux and macOS). A process that exists but whose start
time cannot be read counts as alive, never as dead: a wrong "dead" would let a
second writer in, or fail a running run."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@functools.cache
def boot_id() -> str:
    """Changes at every reboot: a pid recorded before it names no process now. Linux's
    boot id where the kernel has one (what records written so far hold), else the boot
    time."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return f"boot-{psutil.boot_time():.0f}"


@dataclass(frozen=True)
class ProcessStart:
    """Whether ``pid`` names a process, and when it started (None: not readable)."""

    exists: bool
    at: float | None = None  # Unix time

    @property
    def ticks(self) -> int | None:
        """Clock ticks since boot, as Linux's ``/proc/<pid>/stat`` counts them (what
        records written so far hold): a reused pid shows another count."""
        return None if self.at is None else round((self.at - psutil.boot_time()) * _TICKS_PER_S)


def process_start(pid: int) -> ProcessStart:
    try:
        return ProcessStart(True, psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return ProcessStart(False)
    except psutil.Error:  # no permission to look: it exists
        return ProcessStart(True)


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None when it is gone or
    unreadable), so a reused pid is not taken for the process that had it."""
    return process_start(pid).ticks


def is_alive(pid: int, ticks: int | None) -> bool:
    """Whether the process ``pid`` that started at ``ticks`` still runs on this boot
    (an unreadable start time: yes)."""
    start = process_start(pid)
    now = start.ticks
    return start.exists and (ticks is None or now is None or now == ticks)


def parent_pid(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def command_line(pid: int) -> list[str]:
    """The process's arguments ([] when gone or unreadable)."""
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
