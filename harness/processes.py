"""Ports, waiting for a process to come up, a log's tail, and a process's family (psutil)."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from volley_dagster.process import parent_pid


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 (held open together so none repeats)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def wait_ready(check: Any, timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready:\n{tail(log)}")
        try:
            if check():
                return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s (last error: {last!r}):\n{tail(log)}")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def tail(log: Path, lines: int = 40) -> str:
    """The last ``lines`` of a log, without terminal colour codes."""
    try:
        return "\n".join(_ANSI.sub("", log.read_text(errors="replace")).splitlines()[-lines:])
    except OSError:
        return "(no log)"


def proc_cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def proc_ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent, ... up to (not including) pid 1."""
    chain = []
    parent = parent_pid(pid)
    while parent and parent > 1:
        chain.append(parent)
        parent = parent_pid(parent)
    return chain


def proc_descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (parents before children)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def free_port() -> int:
    return free_ports(1)[0]

