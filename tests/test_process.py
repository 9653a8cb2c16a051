"""Telling a live process from a dead one, portably (psutil): a reused pid is not the
process that had it, and the start stamp is the one records written so far hold."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from volley_dagster.process import boot_id, is_alive, process_start, start_ticks


def test_a_process_is_alive_until_it_exits_and_a_reused_pid_is_another_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ticks = start_ticks(child.pid)
        assert ticks is not None and is_alive(child.pid, ticks) and is_alive(child.pid, None)
        assert not is_alive(child.pid, ticks + 1)  # same pid, another start: another process
        assert process_start(child.pid).at is not None
    finally:
        child.kill()
        child.wait()
    assert not is_alive(child.pid, ticks) and process_start(child.pid).exists is False


def test_the_start_stamp_and_boot_id_match_what_records_on_linux_hold() -> None:
    """Leases and warm-Spark records written before psutil hold /proc's clock ticks and
    boot id: a live holder must still be recognised after the upgrade."""
    stat = Path(f"/proc/{os.getpid()}/stat").read_text()
    assert start_ticks(os.getpid()) == int(stat.rsplit(")", 1)[1].split()[19])
    assert boot_id() == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
