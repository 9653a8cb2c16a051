"""Ports, waiting for a process to come up, a log's tail, and a process's family (from /proc)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any


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
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _proc_parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def proc_ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent, ... up to (not including) pid 1, from /proc."""
    chain = []
    parent = _proc_parent(pid)
    while parent and parent > 1:
        chain.append(parent)
        parent = _proc_parent(parent)
    return chain


def proc_descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid``, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _proc_parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def free_port() -> int:
    return free_ports(1)[0]

