"""kill -9 at each named fault point, in a real subprocess (driver, JVM and
Python workers all die), then resume: the result equals a clean run."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers import assert_epoch_outputs, assert_state_equal, log_records, payments, read_sink, reference_state
from tests.window_reference import crash_window_pipeline, reference, window_rows
from volley_dagster import EpochRunner
from volley_dagster.demo.events import generate
from volley_dagster.faults import PAUSE_DIR_ENV, PAUSE_MAX_ENV
from volley_dagster.settings import RunSettings

FILES, PER_FILE, KEYS, MAX, KEEP = 4, 1_500, 300, 1_500, 2
ROOT = Path(__file__).resolve().parents[2]


class SpareCrashWorkers:
    """One crash worker kept started ahead (``crash_worker --spare``: its Spark up), so
    a kill test does not wait for a JVM to start: about 6 s of each test's 20 on two
    cores. The next spare starts once the taken one died, while the test resumes."""

    def __init__(self) -> None:
        self._spare: subprocess.Popen | None = None
        atexit.register(self.stop)

    def take(self) -> subprocess.Popen:
        spare, self._spare = self._spare or self._start(), None
        ready = spare.stdout.readline() if spare.stdout is not None else ""
        if ready.strip() != "ready":  # it died starting: say why
            _, err = spare.communicate(timeout=60)
            raise AssertionError(f"the crash worker did not start: {ready!r}\n{err[-3000:]}")
        return spare

    def start_next(self) -> None:
        if self._spare is None:
            self._spare = self._start()

    def stop(self) -> None:
        if self._spare is not None:
            _kill_group(self._spare)
            self._spare = None

    @staticmethod
    def _start() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.engine.crash_worker", "--spare"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True,
        )


SPARES = SpareCrashWorkers()


def _kill_group(proc: subprocess.Popen) -> None:
    try:  # the whole process group: a crashed machine leaves no JVM or worker behind
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_until_killed(
    base: Path, point: str, epoch: int, shard: int | None = None, kind: str = "payments", max_records: int = MAX,
    env_extra: dict[str, str] | None = None, hold: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run the pipeline in a crash worker that kills itself at ``point`` of ``epoch``;
    ``hold``: sinks paused before they write ``epoch`` (the sinks commit concurrently),
    so a kill at ``after_sink_<name>`` finds them not yet holding it."""
    env = {"VOLLEY_KILL_AT": point, "VOLLEY_KILL_EPOCH": str(epoch), **(env_extra or {})}
    if hold:
        pause = base / "pause"
        pause.mkdir(exist_ok=True)
        for sink in hold:
            (pause / f"before_sink_{sink}-{epoch}-None.armed").touch()
        env.update({PAUSE_DIR_ENV: str(pause), PAUSE_MAX_ENV: "120"})
    if shard is not None:
        env["VOLLEY_KILL_SHARD"] = str(shard)
    proc = SPARES.take()
    request = {"args": [str(base), str(max_records), str(KEEP), kind], "env": env}
    try:
        out, err = proc.communicate(json.dumps(request) + "\n", timeout=240)
    finally:
        _kill_group(proc)
    SPARES.start_next()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize(
    ("point", "epoch", "shard", "committed_after_crash"),
    [
        ("segment_read", 2, None, 1),
        pytest.param("shard_after_snapshot", 2, 1, 1, marks=pytest.mark.deep),  # also windows' and enrichment's
        pytest.param("after_snapshot", 2, None, 1, marks=pytest.mark.deep),
        ("after_sink_delta", 2, None, 1),
        pytest.param("after_sinks", 2, None, 1, marks=pytest.mark.deep),  # also the Kafka source's
        ("during_retention", 3, None, 3),
    ],
)
def test_kill_and_resume_equals_clean_run(spark, tmp_path, point, epoch, shard, committed_after_crash):
    # Local Parquet is read by Spark's own scan; the Python segment reader (and its
    # fault point) serves JSON and S3 logs, so the read-time kill runs over JSON.
    fmt = "json" if point == "segment_read" else "parquet"
    generate(tmp_path / "events", FILES, PER_FILE, KEYS, fmt=fmt)
    crashed = run_until_killed(tmp_path, point, epoch, shard, kind="payments_json" if fmt == "json" else "payments",
                               hold=("iceberg",) if point == "after_sink_delta" else ())
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]

    pipeline = payments(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables", fmt=fmt)
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=MAX, keep_epochs=KEEP), spark=spark)
    assert runner.committed_epoch() == committed_after_crash
    assert runner.log.last_cut() == epoch  # the crashed epoch's range stays recorded
    resumed = runner.run_available()
    assert [r.epoch for r in resumed] == list(range(committed_after_crash + 1, FILES + 1))

    records = log_records(FILES, PER_FILE, KEYS)
    assert_state_equal(runner.read_state(), reference_state(records))
    records_in = {e: runner.result(e).records_in for e in range(1, FILES + 1)}
    assert sum(records_in.values()) == records.num_rows
    assert_epoch_outputs(read_sink(tmp_path / "out"), records, records_in)
    assert runner.log.retained_snapshots() == [FILES - 1, FILES]
    assert not any((tmp_path / "state" / "work").iterdir())  # attempt directories cleaned up
    sinks = {s.name: s for s in pipeline.sinks}
    final = reference_state(records)
    assert_state_equal(sinks["delta"].read(), final)  # upsert: exactly the current state
    appended = sinks["iceberg"].read().to_pandas()
    expected_rows = read_sink(tmp_path / "out").drop(columns="epoch")
    assert len(appended) == len(expected_rows)  # append: every epoch's rows exactly once
    key = ["merchant_id", "events"]
    pd.testing.assert_frame_equal(
        appended.sort_values(key).reset_index(drop=True), expected_rows.sort_values(key).reset_index(drop=True),
        check_dtype=False, rtol=1e-9,
    )
    assert sinks["delta"].committed_epoch("payments") == sinks["iceberg"].committed_epoch("payments") == FILES
    skipped = {name for name, r in runner.result(epoch).sinks.items() if r.skipped}
    if point == "after_sinks":
        assert skipped == {"parquet", "delta", "iceberg"}  # each sink decided: already held
    elif point == "after_sink_delta":  # Iceberg was held; Parquet, committing concurrently, may have finished
        assert {"delta"} <= skipped <= {"parquet", "delta"}
    elif committed_after_crash < epoch:
        assert skipped == set()
    # Resident state (state/resident.py) outlives the killed process: the first resumed
    # epoch reads it where it is the restored snapshot, and RocksDB where the killed
    # attempt already stamped it with a snapshot of an epoch that never committed.
    first = {s: info.read_mode for s, info in runner.result(committed_after_crash + 1).shards.items()}
    if point in ("segment_read", "during_retention"):
        assert set(first.values()) == {"resident"}
    elif point == "shard_after_snapshot":
        assert first[shard] != "resident"
    else:
        assert "resident" not in first.values()


@pytest.mark.parametrize(
    # after_sinks (every sink holds the epoch, no manifest) is the payments cases' job: for
    # windows it adds only what after_sink_delta already covers (a resumed epoch 3 whose
    # state is restored from epoch 2 while some sinks hold it)
    ("point", "shard"), [("shard_after_snapshot", 1), pytest.param("after_sink_delta", None, marks=pytest.mark.deep)]
)
def test_kill_window_pipeline_and_resume_equals_reference(spark, tmp_path, point, shard):
    """Sessions merge across epochs, so a resumed epoch must restore window state and
    the pending index exactly as the crashed attempt found them."""
    files, per_file = 4, 300
    names = generate(tmp_path / "events", files, per_file, 20, events_per_second=10, disorder_s=30)
    crashed = run_until_killed(tmp_path, point, 3, shard, kind="windows", max_records=per_file)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]

    pipeline = crash_window_pipeline(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables")
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=per_file, keep_epochs=KEEP), spark=spark)
    assert runner.committed_epoch() == 2
    assert [r.epoch for r in runner.run_available()] == [3, 4]

    windows = pipeline.windowing.windows
    ref = reference([tmp_path / "events" / n for n in names], windows, 5_000_000, 0, end_of_stream=False)
    for epoch in range(1, files + 1):
        assert window_rows(read_epoch(tmp_path / "out", epoch)) == ref.fired[epoch], f"epoch {epoch}"
    assert window_rows(runner.read_state()) == ref.open
    fired = set().union(*ref.fired.values())
    sinks = {s.name: s for s in pipeline.sinks}
    for name in ("delta", "iceberg"):  # append: every fired window exactly once
        table = sinks[name].read()
        assert table.num_rows == len(fired) and window_rows(table) == fired, name
        assert sinks[name].committed_epoch("windows") == files


def read_epoch(output: Path, epoch: int) -> pa.Table:
    return pq.read_table(output / "windows" / f"epoch-{epoch:010d}.parquet")
