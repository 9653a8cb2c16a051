"""Ports, waiting for a process to come up, a log's tail, and a process's family (psutil)."""

from __future__ import annotations

import random
import re
import socket
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from volley_dagster.process import parent_pid


LISTEN_PORTS_FROM = 10_000  # the test servers' ports are drawn from here up to the ephemeral range


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (and for ``bind`` to port 0)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on this machine (held open together so none repeats),
    below the ephemeral range: a server restarted on its ports after an outage must find
    them free, and while it is down, a port in that range may become any outgoing
    connection's own (a SeaweedFS restart once found its admin port taken so)."""
    low = ephemeral_port_range()[0]
    if low - LISTEN_PORTS_FROM < 100 * n:
        raise RuntimeError(f"the ephemeral port range starts at {low}: too few ports below it from "
                           f"{LISTEN_PORTS_FROM} for the test servers; lower net.ipv4.ip_local_port_range's start")
    rng = random.Random()  # seeded from the OS: two xdist workers draw apart
    ports: list[int] = []
    with ExitStack() as stack:
        for _ in range(100 * n):
            port = rng.randrange(LISTEN_PORTS_FROM, low)
            if port in ports:
                continue
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("0.0.0.0", port))  # taken on any address, or lingering in TIME_WAIT: not free
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"found only {len(ports)} of {n} free ports in {LISTEN_PORTS_FROM}-{low - 1}")


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

