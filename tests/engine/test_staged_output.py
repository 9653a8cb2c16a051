"""A window pipeline whose one sink is a local Delta append: the shard tasks write the
epoch's rows into the table's folder themselves, and the sink commits those files with
the epoch's txn. The table and each epoch's output are what the rows path gives, and a
kill -9 after the files were written, or after their commit, still leaves each window
in the table exactly once. A running aggregate's Delta upsert: each shard task rewrites
its own files of the table (``sinks/shard_files.py``), and after someone compacts the
table the sink MERGEs, the table the reference state either way. Where no sink takes
the tasks' files, a local Spark's tasks leave their rows in files for the driver, which
reads the same output a cluster's rows bring through Spark's result."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from tests.engine.test_crash_recovery import KEEP, run_until_killed
from tests.helpers import assert_state_equal, log_records, payments, reference_state
from tests.window_reference import reference, staged_window_pipeline, window_rows
from volley_dagster import EpochRunner, MemorySink
from volley_dagster import attempt as attempt_module
from volley_dagster.demo.events import generate
from volley_dagster.settings import RunSettings
from volley_dagster.sinks.shard_files import owned_files
from volley_dagster.sinks.staged_files import same_columns
from volley_dagster.spark import stage as stage_module

FILES, PER_FILE = 4, 300
PART = re.compile(r"part-(\d{10})-\d{5}-\w+\.parquet")


def table_files(table: Path) -> list[str]:
    return DeltaTable(str(table)).get_add_actions(flatten=True).column("path").to_pylist()


def test_the_tasks_files_hold_what_the_rows_path_commits(spark, tmp_path):
    generate(tmp_path / "events", FILES, PER_FILE, 20, events_per_second=10, disorder_s=30)
    settings = RunSettings(max_records_per_epoch=PER_FILE)
    staged = EpochRunner(staged_window_pipeline(tmp_path / "events", tmp_path / "out", tmp_path / "staged"),
                         tmp_path / "state-staged", settings, spark=spark)
    # a sink without a staging folder: the rows come to the driver, for every sink
    rows_path = staged_window_pipeline(tmp_path / "events", tmp_path / "out", tmp_path / "rows").sink(MemorySink())
    collected = EpochRunner(rows_path, tmp_path / "state-rows", settings, spark=spark)
    for a, b in zip(staged.run_available(), collected.run_available(), strict=True):
        assert a.output is not None and b.output is not None and a.output.equals(b.output), a.epoch
        assert a.records_out == b.records_out == a.output.num_rows
        assert a.sinks["delta"].rows == b.sinks["delta"].rows == a.records_out
    assert window_rows(DeltaTable(str(tmp_path / "staged" / "delta")).to_pyarrow_table()) == window_rows(
        DeltaTable(str(tmp_path / "rows" / "delta")).to_pyarrow_table())
    epochs = sorted(int(m.group(1)) for path in table_files(tmp_path / "staged" / "delta") if (m := PART.fullmatch(path)))
    assert len(epochs) == len(table_files(tmp_path / "staged" / "delta")) and set(epochs) <= set(range(1, FILES + 1))
    assert not any(PART.fullmatch(path) for path in table_files(tmp_path / "rows" / "delta"))
    stats = DeltaTable(str(tmp_path / "staged" / "delta")).get_add_actions(flatten=True)
    assert None not in stats.column("min.window_start").to_pylist() + stats.column("max.window_end").to_pylist()


@pytest.mark.parametrize("point", ["after_snapshot", pytest.param("after_sink_delta", marks=pytest.mark.deep)])
def test_a_kill_9_after_the_tasks_wrote_their_files_leaves_each_window_once(spark, tmp_path, point):
    names = generate(tmp_path / "events", FILES, PER_FILE, 20, events_per_second=10, disorder_s=30)
    crashed = run_until_killed(tmp_path, point, 3, kind="windows_delta", max_records=PER_FILE)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    folder = tmp_path / "tables" / "delta"
    written = sorted(p.name for p in folder.glob("part-0000000003-*.parquet"))
    assert written, "the killed attempt wrote epoch 3's files"

    pipeline = staged_window_pipeline(tmp_path / "events", tmp_path / "out", tmp_path / "tables")
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=KEEP),
                         spark=spark)
    assert [r.epoch for r in runner.run_available()] == [3, 4]
    ref = reference([tmp_path / "events" / n for n in names], pipeline.windowing.windows, 5_000_000, 0,
                    end_of_stream=False)
    fired = set().union(*ref.fired.values())
    table = DeltaTable(str(folder)).to_pyarrow_table()
    assert table.num_rows == len(fired) and window_rows(table) == fired
    committed = [p for p in table_files(folder) if p.startswith("part-0000000003-")]
    if point == "after_snapshot":  # its files are in no version; the re-run committed its own
        assert not set(written) & set(committed) and committed
    else:  # the killed attempt committed them; the re-run found the epoch held
        assert committed == [p for p in written if p in committed] and set(committed) <= set(written)
        assert runner.result(3).sinks["delta"].skipped


def test_a_running_aggregates_upsert_is_each_shards_rewrite_of_its_files(spark, tmp_path):
    generate(tmp_path / "events", FILES, PER_FILE, 40)
    pipeline = payments(tmp_path / "events", tmp_path / "out", shards=3, tables=tmp_path / "tables")
    table = tmp_path / "tables" / "delta"
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    first = runner.run_available(max_epochs=2)
    assert [r.sinks["delta"].counts["files_added"] for r in first] == [3, 3]  # one file a shard, rewritten whole
    assert first[1].sinks["delta"].counts["files_removed"] == 3
    owned = owned_files([(p, 0, 1) for p in table_files(table)], pipeline.layout)
    assert owned is not None and sorted(owned) == [0, 1, 2]
    schema = pa.schema(DeltaTable(str(table)).schema().to_arrow())
    for path in table_files(table):  # the tasks' files hold the table's own types (a timestamp's zone too)
        assert same_columns(pq.read_schema(table / path), schema), (pq.read_schema(table / path), schema)
    assert_state_equal(DeltaTable(str(table)).to_pyarrow_table(), reference_state(log_records(2, PER_FILE, 40)))

    DeltaTable(str(table)).optimize.compact(min_commit_interval=None)  # another writer: one file of every shard's rows
    assert owned_files([(p, 0, 1) for p in table_files(table)], pipeline.layout) is None
    rest = runner.run_available()
    assert [r.epoch for r in rest] == [3, 4]
    assert not any("files_added" in r.sinks["delta"].counts for r in rest)  # MERGEd
    assert all(r.sinks["delta"].counts["updated"] + r.sinks["delta"].counts["inserted"] == r.records_out for r in rest)
    assert_state_equal(DeltaTable(str(table)).to_pyarrow_table(), reference_state(log_records(FILES, PER_FILE, 40)))


def test_a_local_sparks_tasks_hand_the_driver_their_rows_in_files_as_spark_would(spark, tmp_path, monkeypatch):
    generate(tmp_path / "events", FILES, PER_FILE, 40)

    def run(name: str) -> list:
        pipeline = payments(tmp_path / "events", tmp_path / name / "out").sink(MemorySink())  # no staging: rows
        return EpochRunner(pipeline, tmp_path / name / "state", RunSettings(max_records_per_epoch=PER_FILE),
                           spark=spark).run_available()

    read: list[int] = []
    read_rows = stage_module.read_rows
    monkeypatch.setattr(stage_module, "read_rows", lambda *a: read.append(len(a[2])) or read_rows(*a))
    local = run("local")
    assert read == [3] * FILES  # a file a shard, every epoch
    assert not list((tmp_path / "local" / "state").glob("work/*/rows-*"))  # read, then removed
    monkeypatch.setattr(attempt_module, "executors_share_this_disk", lambda spark: False)  # as a cluster's executors
    remote = run("remote")
    assert len(read) == FILES  # through Spark's result
    for a, b in zip(local, remote, strict=True):
        assert a.output is not None and b.output is not None and a.output.num_rows > 0
        assert a.output.schema == b.output.schema and a.output.equals(b.output), a.epoch
        assert a.records_out == b.records_out == a.output.num_rows
