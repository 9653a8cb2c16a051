"""The same engine over Spark Connect (a real server from the pyspark package's
own jars, started by the warm-Spark supervisor), driven from its own process as a
Dagster run would be: results equal the reference, and task-side engine errors
surface as themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers import assert_state_equal, log_records, payments, reference_state
from tests.window_reference import reference, window_rows
from volley_dagster import EpochRunner, tumbling
from volley_dagster.demo.events import generate
from volley_dagster.process import is_alive
from volley_dagster.spark.warm import find_or_start, read_record, stop

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.deep  # the UI tests run on the warm Spark; its restart is an extra fault point
def test_epochs_over_the_warm_spark_which_restarts_and_ends_with_its_owner(tmp_path):
    """The warm Spark (``spark/warm.py``) as Dagster runs meet it: the first caller
    starts it, epochs run over it, a kill -9 of its server is healed by the
    supervisor, and it stops when its owner (``dagster dev``, here a stand-in) exits."""
    home = tmp_path / "warm"
    owner = subprocess.Popen(["sleep", "600"], start_new_session=True)
    generate(tmp_path / "events", 2, 1_500, 200)
    window_files = generate(tmp_path / "events-w", 4, 300, 20, events_per_second=10, disorder_s=30)
    try:
        first = find_or_start(home, owner_pid=owner.pid)
        url = first.url
        assert url is not None and first == read_record(home) and first.owner_pid == owner.pid
        assert find_or_start(home) == first  # the next run reuses it, and its session
        out = subprocess.run(
            [sys.executable, "-m", "tests.engine.connect_worker", url, str(tmp_path), first.session_id],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]

        os.kill(first.server_pid, signal.SIGKILL)  # the server dies; the supervisor starts another
        deadline = time.monotonic() + 30
        while getattr(read_record(home), "server_pid", None) == first.server_pid and time.monotonic() < deadline:
            time.sleep(0.2)
        second = find_or_start(home)
        assert second == read_record(home) and second.restarts == 1 and second.session_id != first.session_id
        assert second.server_pid != first.server_pid and second.supervisor_pid == first.supervisor_pid
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (is_alive(second.supervisor_pid, None) or is_alive(second.server_pid, None)):
        time.sleep(0.5)
    assert not is_alive(second.server_pid, None) and not is_alive(second.supervisor_pid, None)
    assert read_record(home) is None
    log = (home / "supervisor.log").read_text()
    assert "restarting" in log and f"owner {owner.pid} exited" in log and "server stopped" in log

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["records"] == [2_000, 1_000]
    assert result["error"].startswith("SourceChangedError:") and "changed after the epoch was cut" in result["error"]
    active = log_records(2, 1_500, 200).slice(0, 2_000).to_pandas().query("status == 'active'")
    assert result["enriched"]["records"] == len(active)  # observed over Connect, not zeros
    assert result["enriched"]["dropped"] == int((active["merchant_id"] % 7 == 3).sum()) > 0
    # windows over Connect: the watermark comes from an observed maximum (spark/side_outputs.py)
    ref = reference([tmp_path / "events-w" / f for f in window_files], tumbling("10 seconds"), 5_000_000, 0,
                    end_of_stream=False)
    assert [w["epoch"] for w in result["windows"]] == [1, 2, 3, 4]
    assert [w["watermark"] for w in result["windows"]] == [ref.watermark[e] for e in range(1, 5)]
    assert [w["late"] for w in result["windows"]] == [len(ref.late[e]) for e in range(1, 5)]
    assert sum(w["late"] for w in result["windows"]) > 0
    for e in range(1, 5):
        fired = pq.read_table(tmp_path / "out-w" / "windows" / f"epoch-{e:010d}.parquet")
        assert window_rows(fired) == ref.fired[e], f"epoch {e}"
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state")
    assert runner.committed_epoch() == 2
    assert_state_equal(runner.read_state(), reference_state(log_records(2, 1_500, 200)))


def test_a_run_falls_back_to_a_local_spark_when_the_warm_one_will_not_start(tmp_path):
    home = tmp_path / "warm"
    out = subprocess.run(
        [sys.executable, "-m", "tests.engine.warm_fallback_worker", str(home)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "VOLLEY_WARM_SPARK_MASTER": "no-such-master"},
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    run = json.loads(out.stdout.strip().splitlines()[-1])
    assert run["master"].startswith("local") and run["rows"] == 3  # the run went on, on its own Spark
    assert len(run["log"]) == 1 and run["log"][0].startswith("Spark: falling back to a local Spark for this run: ")
    assert str(home / "supervisor.log") in run["log"][0]
    assert "could not start a server (1 in a row)" in (home / "supervisor.log").read_text()
    record = read_record(home)
    assert record is not None and record.url is None and record.start_failures == 1
    stop(home)  # as dagster dev's exit would
    assert read_record(home) is None and not is_alive(record.supervisor_pid, None)
