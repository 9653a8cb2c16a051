"""The same engine over Spark Connect (a real server from the pyspark package's
own jars), driven from its own process as a Dagster run would be: results equal
the reference, and task-side engine errors surface as themselves."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import assert_state_equal, log_records, payments, reference_state
from volley_dagster import EpochRunner
from volley_dagster.demo.events import generate
from volley_dagster.spark.connect import start_connect_server

ROOT = Path(__file__).resolve().parents[2]


def test_epochs_over_spark_connect(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    generate(tmp_path / "events", 2, 1_500, 200)
    server = start_connect_server(port, "local[2]", tmp_path / "server.log")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "tests.engine.connect_worker", server.url, str(tmp_path)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
        )
    finally:
        server.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["records"] == [2_000, 1_000]
    assert result["error"].startswith("SourceChangedError:") and "changed after the epoch was cut" in result["error"]
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state")
    assert runner.committed_epoch() == 2
    assert_state_equal(runner.read_state(), reference_state(log_records(2, 1_500, 200)))
