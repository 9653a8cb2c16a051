"""Issue 76, point 3: ``volley demo`` printed all its output, then now and then exited
with status 134 (``terminate called without an active exception``): a C++ library's
thread pool torn down at exit. The command leaves through ``cli.run``, after Python's
own shutdown and before those destructors; here it runs several times, as a user runs
it, and must exit 0 every time with nothing aborted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

VOLLEY = Path(sys.executable).with_name("volley")
RUNS = 5 if os.environ.get("VOLLEY_DEEP") else 1


@pytest.mark.spark
def test_volley_demo_exits_zero_every_time(tmp_path):
    for attempt in range(RUNS):
        done = subprocess.run([str(VOLLEY), "demo", "--workdir", str(tmp_path / f"demo{attempt}"), "--files", "2",
                               "--records-per-file", "1000", "--keys", "100", "--max-records", "1000"],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"run {attempt + 1}: exit {done.returncode}\n{done.stderr[-3000:]}"
        assert "terminate called" not in done.stderr and "Fatal Python error" not in done.stderr, done.stderr[-3000:]
        assert "next: './dev dagster' serves the Dagster UI" in done.stdout
        assert "velocity: a processor of our own" in done.stdout and "velocity_alerts (append):" in done.stdout
        assert "merchant_refunds: refunds per merchant per hour" in done.stdout and "merchant hours" in done.stdout


def test_the_command_leaves_with_mains_status():
    """Spark-free: a usage error still exits 2, --help 0, through ``run``'s exit."""
    usage = subprocess.run([str(VOLLEY), "no-such-command"], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 2 and "invalid choice" in usage.stderr
    assert subprocess.run([str(VOLLEY), "--help"], capture_output=True, text=True, timeout=120).returncode == 0


def test_the_kafka_demo_outside_the_checkout_says_what_to_run(tmp_path):
    """Spark-free: the mock cluster is the checkout's (harness/kafka.py); the installed
    command, run elsewhere, names ./dev demo --kafka and --bootstrap-servers and starts
    nothing."""
    done = subprocess.run([str(VOLLEY), "demo", "--kafka", "--workdir", str(tmp_path)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "run `./dev demo --kafka` in the checkout, or name a Kafka cluster with --bootstrap-servers" in done.stderr
    assert not list(tmp_path.iterdir()), "nothing was produced or written"
