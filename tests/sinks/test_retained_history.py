"""The sink checks (``verify.check_sink``) and lineage marks over the table's own
retention, on real tables: a Delta table whose log was checkpointed and cleaned up
(``create_checkpoint`` + ``cleanup_metadata`` with a short log retention) and an
Iceberg table (SQLite catalog) whose older snapshots were expired. The row counts
compare only the epochs the sink still holds, within a bounded window of recent
epochs, and say where the sink's history begins.

The epochs are committed as the runner commits them (the sink's commit with the
root's lineage and the range digest, then the manifest), without Spark: the checks
read only the log, the manifests and the tables."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from deltalake import DeltaTable

from tests.sinks.commit_worker import epoch_output
from tests.sinks.helpers import KEY, PIPELINE
from volley_dagster import EpochRunner, FileLog, Pipeline, sum_
from volley_dagster.io.atomic import write_bytes_atomic
from volley_dagster.result import EpochResult
from volley_dagster.sinks.base import CommitContext
from volley_dagster.sinks.delta import DeltaSink
from volley_dagster.sinks.iceberg import IcebergSink
from volley_dagster.sinks.table import TableSink
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.verify import ROW_COUNT_WINDOW, CheckOutcome, check_sink


def rows_of(epoch: int) -> int:
    return 3 + epoch % 5


def runner_for(tmp_path: Path, sink: TableSink) -> EpochRunner:
    (tmp_path / "events").mkdir(exist_ok=True)
    pipeline = Pipeline(PIPELINE).source(FileLog(tmp_path / "events")).key_by("merchant_id") \
        .aggregate(total=sum_("amount")).sink(sink)
    runner = EpochRunner(pipeline, tmp_path / "state")
    if not runner.log.has_identity():
        runner.log.check_identity({"pipeline": PIPELINE, "layout": {"num_shards": 1, "num_key_groups": 256}})
    return runner


def commit(runner: EpochRunner, sink: TableSink, epochs: range) -> None:
    """Each epoch as the runner commits it: offsets, the sink's commit (this root's
    lineage, the range's digest), the manifest with the rows it wrote."""
    lineage = runner.log.lineage()
    for epoch in epochs:
        rng = runner.log.record_offsets(EpochRange(epoch, {}, {}))
        output = epoch_output(epoch, rows_of(epoch))
        result = sink.commit(output, CommitContext(PIPELINE, epoch, KEY, lineage, rng.digest()))
        assert not result.skipped, f"epoch {epoch}"
        n = output.num_rows
        assert runner.log.write_manifest(EpochResult(PIPELINE, epoch, {}, n, n, 0, n, n, 0, 0, 0, {},
                                                     {sink.name: result.to_dict()}, {"total": 1.0}))


def outcomes(runner: EpochRunner, sink: TableSink, epochs: range | None = None) -> dict[str, CheckOutcome]:
    return {o.name: o for o in check_sink(runner, sink, epochs)}


def all_pass(checks: dict[str, CheckOutcome]) -> bool:
    return all(o.passed for o in checks.values())


def history_checks_pass(checks: dict[str, CheckOutcome]) -> bool:
    return checks["row_counts"].passed and checks["no_duplicate_epochs"].passed


def clean_up_delta_log(uri: str) -> int:
    """What a table's maintenance does after the log retention: checkpoint, then delete
    the commits before it. Returns the oldest version whose commit info is left."""
    table = DeltaTable(uri)
    table.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
    time.sleep(1.1)  # older than the retention, by the files' clock
    table = DeltaTable(uri)
    table.create_checkpoint()
    table.cleanup_metadata()
    return min(int(h["version"]) for h in DeltaTable(uri).history())


def expire_iceberg_snapshots(sink: IcebergSink) -> int:
    """Expire every snapshot but the current one; returns how many are left."""
    table = sink.table()
    assert table is not None
    table.maintenance.expire_snapshots().older_than(datetime.now(timezone.utc)).commit()
    table.refresh()
    return len(table.snapshots())


def make_sink(kind: str, tmp_path: Path) -> TableSink:
    if kind == "delta":
        return DeltaSink(tmp_path / "delta", mode="append")
    return IcebergSink("volley.payments", path=tmp_path / "iceberg", mode="append")


def clean_up(kind: str, sink: TableSink) -> None:
    if kind == "delta":
        assert isinstance(sink, DeltaSink)
        assert clean_up_delta_log(sink.uri) > 1  # the epochs' commit infos are gone
    else:
        assert isinstance(sink, IcebergSink)
        assert expire_iceberg_snapshots(sink) == 1


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_row_counts_compare_a_recent_window_and_stay_green_after_the_tables_retention(tmp_path: Path,
                                                                                      kind: str) -> None:
    sink = make_sink(kind, tmp_path)
    runner = runner_for(tmp_path, sink)
    total = ROW_COUNT_WINDOW + 8
    commit(runner, sink, range(1, total + 1))
    checks = outcomes(runner, sink)
    assert all_pass(checks), checks
    row_counts = checks["row_counts"].metadata
    assert row_counts["epochs_checked"] == ROW_COUNT_WINDOW and row_counts["first_checked_epoch"] == 9
    assert row_counts["history_truncated"] is False
    # only the window's manifests are read: one from before it, made unreadable, is not
    write_bytes_atomic(runner.log.epoch_dir(1) / "manifest.json", b"{not json")
    assert all_pass(outcomes(runner, sink))

    clean_up(kind, sink)
    checks = outcomes(runner, sink)
    assert history_checks_pass(checks), {n: o.description for n, o in checks.items()}
    row_counts = checks["row_counts"].metadata
    assert row_counts["history_truncated"] is True
    assert row_counts["epochs_not_in_sink_history"] + row_counts["epochs_checked"] == ROW_COUNT_WINDOW
    assert row_counts["last_checked_epoch"] in (total, 0)
    assert "no longer in the sink's own history" in checks["row_counts"].description



@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_an_epoch_missing_from_a_complete_history_is_still_red(tmp_path: Path, kind: str) -> None:
    sink = make_sink(kind, tmp_path)
    runner = runner_for(tmp_path, sink)
    commit(runner, sink, range(1, 6))
    # epoch 6 is committed in the log, but its sink commit never happened (a lost table write)
    runner.log.record_offsets(EpochRange(6, {}, {}))
    assert runner.log.write_manifest(EpochResult(PIPELINE, 6, {}, 4, 4, 0, 4, 4, 0, 0, 0, {}, {}, {"total": 1.0}))
    checks = outcomes(runner, sink)
    assert not checks["row_counts"].passed and "epoch 6: missing" in checks["row_counts"].description
    assert checks["row_counts"].metadata["history_truncated"] is False
    assert not checks["recorded_epoch"].passed
    # an explicit range of epochs (those a run committed) is all that is compared
    assert outcomes(runner, sink, range(2, 5))["row_counts"].metadata["epochs_checked"] == 3
    assert outcomes(runner, sink, range(2, 5))["row_counts"].passed
