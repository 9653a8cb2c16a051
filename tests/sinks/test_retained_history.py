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

import json
import shutil
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest
from deltalake import DeltaTable

from tests.sinks.commit_worker import epoch_output
from tests.sinks.helpers import KEY, PIPELINE
from volley_dagster import EpochRunner, FileLog, Pipeline, sum_
from volley_dagster.errors import SinkLineageError
from volley_dagster.io.atomic import write_bytes_atomic
from volley_dagster.result import EpochResult
from volley_dagster.sinks.base import CommitContext
from volley_dagster.sinks.delta import DeltaSink
from volley_dagster.sinks.iceberg import IcebergSink
from volley_dagster.sinks.lineage import SinkBinding, SinkMark
from volley_dagster.sinks.table import TableSink
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.verify import ROW_COUNT_WINDOW, CheckOutcome, check_sink


def rows_of(epoch: int) -> int:
    return 3 + epoch % 5


def runner_for(tmp_path: Path, sink: TableSink) -> EpochRunner:
    (tmp_path / "events").mkdir(parents=True, exist_ok=True)
    pipeline = Pipeline(PIPELINE).source(FileLog(tmp_path / "events")).key_by("merchant_id") \
        .aggregate(total=sum_("amount")).sink(sink)
    runner = EpochRunner(pipeline, tmp_path / "state")
    if not runner.log.has_identity():
        runner.log.check_identity({"pipeline": PIPELINE, "layout": {"num_shards": 1, "num_key_groups": 256}})
    return runner


def context(runner: EpochRunner, sink: TableSink, epoch: int) -> CommitContext:
    """The runner's context of an epoch's commit: this root's lineage, the range's
    digest and the sink's recorded choice, if any."""
    rng = runner.log.record_offsets(EpochRange(epoch, {}, {}))
    return CommitContext(PIPELINE, epoch, KEY, runner.log.lineage(), rng.digest(), runner.log.sink_binding(sink.name))


def commit(runner: EpochRunner, sink: TableSink, epochs: range) -> None:
    """Each epoch as the runner commits it: offsets, the sink's commit, the manifest
    with the rows it wrote."""
    for epoch in epochs:
        output = epoch_output(epoch, rows_of(epoch))
        result = sink.commit(output, context(runner, sink, epoch))
        assert not result.skipped, f"epoch {epoch}"
        n = output.num_rows
        assert runner.log.write_manifest(EpochResult(PIPELINE, epoch, {}, n, n, 0, n, n, 0, 0, 0, {},
                                                     {sink.name: result}, {"total": 1.0}))


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


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_pipeline_paused_past_the_tables_retention_is_still_recognised(tmp_path: Path, kind: str) -> None:
    """The mark (lineage, its epoch, the range digest) outlives the commit infos and
    snapshots: Delta keeps it as txns in its checkpoints, Iceberg in table properties."""
    sink = make_sink(kind, tmp_path)
    runner = runner_for(tmp_path, sink)
    commit(runner, sink, range(1, 6))
    lineage, digest = runner.log.lineage(), runner.log.offsets(5).digest()
    clean_up(kind, sink)

    fresh = make_sink(kind, tmp_path)  # a new process: nothing cached
    assert fresh.committed_mark(PIPELINE) == SinkMark(5, lineage.id, 5, digest)
    commit(runner, fresh, range(6, 9))  # no SinkLineageError asking a person to choose
    again = fresh.commit(epoch_output(8, rows_of(8)), context(runner, fresh, 8))
    assert again.skipped and again.held_epoch == 8
    clean_up(kind, fresh)
    with pytest.raises(SinkLineageError, match="over another source range"):  # the range survived too
        fresh.commit(epoch_output(8, rows_of(8)), replace(context(runner, fresh, 8), range_digest="0" * 32))

    checks = outcomes(runner, fresh)
    assert all_pass(checks), {n: o.description for n, o in checks.items()}
    assert checks["recorded_epoch"].metadata == {"sink_epoch": 8, "committed_epoch": 8}
    commit(runner, fresh, range(9, 12))  # the epochs after the cleanup are compared again
    checks = outcomes(runner, fresh)
    assert all_pass(checks) and checks["row_counts"].metadata["epochs_checked"] >= 3
    wrong = runner.log.committed_manifest(10)
    wrong.records_out += 1
    write_bytes_atomic(runner.log.epoch_dir(10) / "manifest.json", json.dumps(wrong.to_manifest()).encode())
    checks = outcomes(runner, fresh)
    assert not checks["row_counts"].passed
    assert f"epoch 10: [{rows_of(10)}] rows, manifest says {rows_of(10) + 1}" in checks["row_counts"].description

    # another root over the same table is told whose epochs it holds, by the lineage's id
    runner.wait_for_compactions()
    shutil.rmtree(tmp_path / "state")
    other = runner_for(tmp_path, make_sink(kind, tmp_path))
    with pytest.raises(SinkLineageError, match=f"holds epoch 11 of lineage {lineage.id} "):
        commit(other, other.pipeline.sinks[0], range(1, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_lineage_that_continued_after_another_keeps_its_numbering_past_the_retention(tmp_path: Path,
                                                                                       kind: str) -> None:
    sink = make_sink(kind, tmp_path)
    first = runner_for(tmp_path / "a", sink)
    commit(first, sink, range(1, 4))
    held = sink.committed_mark(PIPELINE)
    assert held is not None
    second = runner_for(tmp_path / "b", sink)
    second.log.record_sink_binding(SinkBinding(sink.name, "continue", held, first_epoch=1))
    commit(second, sink, range(1, 3))  # sink epochs 4 and 5
    clean_up(kind, sink)
    fresh = make_sink(kind, tmp_path)
    assert fresh.committed_mark(PIPELINE) == SinkMark(5, second.log.lineage().id, 2, second.log.offsets(2).digest())
    commit(second, fresh, range(3, 4))
    checks = outcomes(second, fresh)
    assert all_pass(checks), {n: o.description for n, o in checks.items()}
    assert checks["recorded_epoch"].metadata == {"sink_epoch": 3, "committed_epoch": 3}
