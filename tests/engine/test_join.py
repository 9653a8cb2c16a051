"""The interval join on real Spark, RocksDB, Delta and Iceberg, over the demo's two logs
(payments and refunds, ``volley_dagster/demo/refunds.py``): every epoch's rows equal
``tests/join_reference.py`` fed the records the epoch recorded; files land in both logs
between epochs and a rescale moves the waiting rows; a committed epoch re-run changes
nothing; state, late records and both tables say the same; ``kill -9`` at the fault
points, with both sources advancing, heals to the reference's rows, each once."""

from __future__ import annotations

import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from tests.engine.test_crash_recovery import run_until_killed
from tests.join_reference import JoinReference, Row
from volley_dagster import EpochRunner, RunSettings
from volley_dagster.checkpoint.migrate import plan_migration
from volley_dagster.columns import POS_OFFSET_BITS
from volley_dagster.demo.payments import local_tables
from volley_dagster.demo.refunds import refunds_pipeline, write_refund_logs
from volley_dagster.errors import StateLayoutError, StateLimitError
from volley_dagster.operators.event_time import duration_us
from volley_dagster.sinks.iceberg import IcebergSink

PER_FILE, MAX = 600, 700
KILL_MAX = 1_000  # three epochs over the first three files of each log
SIDES = {"payments": (0, "paid_at"), "refunds": (1, "refunded_at")}
LEFT_COLUMNS, RIGHT_COLUMNS = ("merchant_id", "amount", "paid_at"), ("refund_amount", "refunded_at")


def epoch_rows(runner: EpochRunner, events: Path, epoch: int) -> tuple[list[Row], dict[str, dict[str, object]]]:
    """The records ``epoch`` recorded, as the reference takes them (rid: the engine's row
    id, ``"<epoch>:<position>"``), and each one's columns by rid."""
    rows: list[Row] = []
    values: dict[str, dict[str, object]] = {}
    for seg in runner.log.offsets(epoch).segments:
        source = seg.partition.split("/")[0]
        side, time_column = SIDES[source]
        records = pq.read_table(events / source / seg.file).slice(seg.start, seg.records)
        times = records.column(time_column).cast(pa.int64()).to_pylist()
        for i, record in enumerate(records.to_pylist()):
            rid = f"{epoch}:{(seg.id << POS_OFFSET_BITS) + i}"
            rows.append((side, record["payment_id"], times[i], rid))
            values[rid] = record
    return rows, values


def emitted(output: pa.Table) -> set[tuple[object, object, object]]:
    return set(zip(*(output.column(c).to_pylist() for c in ("payment_id", "payments_row", "refunds_row")),
                   strict=True))


@pytest.mark.parametrize("how", ["left", pytest.param("full", marks=pytest.mark.deep)])  # the property test: all four
def test_the_join_equals_the_reference_epoch_by_epoch(spark, tmp_path, how):
    events = tmp_path / "events"
    write_refund_logs(events, 3, PER_FILE)
    tables = local_tables(tmp_path / "tables")
    upserted = IcebergSink("payments.refunds_by_row", catalog=tables.iceberg_catalog, name="by_row", mode="upsert")
    pipeline = refunds_pipeline(events, tables, shards=3, how=how).sink(upserted)  # keyed by key and both row ids
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=MAX), spark=spark)
    reference = JoinReference(0, duration_us("30 minutes", "upper"), how, duration_us("1 minute", "ooo"))
    results, columns_of = [], {}
    while True:
        if len(results) == 2:
            write_refund_logs(events, 2, PER_FILE, first_file=3)  # both logs advance between epochs
        if len(results) == 3:
            runner.rescale(4)  # the waiting rows move with their key groups
        result = runner.run_next()
        if result is None:
            break
        rows, values = epoch_rows(runner, events, result.epoch)
        columns_of.update(values)
        pairs, outer, late = reference.run(rows)
        assert emitted(result.output) == pairs | outer, f"epoch {result.epoch}"
        assert result.records_out == len(pairs) + len(outer)
        assert (result.figures["join_pairs"], result.figures["join_unmatched"]) == (len(pairs), len(outer))
        assert result.late_records == len(late), f"epoch {result.epoch}: late records"
        assert (result.figures["join_left_rows"], result.figures["join_right_rows"]) == reference.held()
        assert result.watermark == reference.watermark
        assert result.input_watermarks == {"payments": reference.side_marks[0], "refunds": reference.side_marks[1]}
        _carries_its_records_columns(result.output, columns_of)
        if late:
            written = runner.late_records(result.epoch)
            assert written is not None
            assert set(written.column("source").to_pylist()) <= {"payments", "refunds"}
            assert written.num_rows == len(late)
        results.append(result)
    assert len(results) >= 5 and sum(r.records_in for r in results) == _log_size(events)
    assert sum(r.late_records for r in results) > 0 and sum(r.figures["join_unmatched"] for r in results) > 0

    waiting = runner.read_state()
    assert set(zip(waiting.column("payment_id").to_pylist(), waiting.column("row").to_pylist(), strict=True)) == {
        (row.key, row.rid) for row in reference.waiting}
    everything = {row for r in results for row in emitted(r.output)}
    delta = DeltaTable(str(tmp_path / "tables" / "delta" / "payment_refunds")).to_pyarrow_table()
    assert emitted(delta) == everything and delta.num_rows == len(everything)  # upsert by key and both row ids
    iceberg = next(s for s in pipeline.sinks if isinstance(s, IcebergSink)).read()
    assert iceberg.num_rows == sum(r.records_out for r in results)  # the changelog: each epoch's rows appended
    by_row = upserted.read()
    assert emitted(by_row) == everything and by_row.num_rows == len(everything)  # outer rows' null ids match null-safely

    again = runner.run(results[2].epoch)  # committed: nothing runs, nothing is written
    assert again.already_committed and again.records_out == results[2].records_out
    assert DeltaTable(str(tmp_path / "tables" / "delta" / "payment_refunds")).to_pyarrow_table().num_rows == len(everything)


def _carries_its_records_columns(output: pa.Table, columns_of: dict[str, dict[str, object]]) -> None:
    """Each side's columns are those of the record its row id names (nulls for a missing side)."""
    for row in output.to_pylist():
        for id_column, names in (("payments_row", LEFT_COLUMNS), ("refunds_row", RIGHT_COLUMNS)):
            record = columns_of.get(row[id_column]) if row[id_column] is not None else None
            assert {n: row[n] for n in names} == {n: record[n] if record else None for n in names}, row


def _log_size(events: Path) -> int:
    return sum(pq.read_metadata(f).num_rows for f in events.rglob("*.parquet"))


def test_a_join_refuses_to_hold_more_than_max_state_rows_and_commits_nothing_and_to_migrate(spark, tmp_path):
    events = tmp_path / "events"
    write_refund_logs(events, 1, PER_FILE)
    bounded = refunds_pipeline(events, local_tables(tmp_path / "tables"), shards=2, max_state_rows=100)
    runner = EpochRunner(bounded, tmp_path / "state", spark=spark)
    with pytest.raises(StateLimitError, match=r"past max_state_rows=100; nothing was committed") as failure:
        runner.run_next()
    assert "'payments'" in str(failure.value) and "epoch 1 shard" in str(failure.value)
    assert runner.committed_epoch() == 0
    sized = refunds_pipeline(events, local_tables(tmp_path / "tables"), shards=2, max_state_rows=10_000)
    runner = EpochRunner(sized, tmp_path / "state", spark=spark)
    result = runner.run_next()  # the same recorded range, now fits
    assert result is not None and result.epoch == 1 and result.records_in == _log_size(events)

    recorded = runner.log.identity()  # the bound is no part of it; the interval is, and no migration moves it
    assert recorded["aggregate"]["join"]["upper_us"] == duration_us("30 minutes", "upper")
    proposed = {**recorded, "aggregate": {"join": {**recorded["aggregate"]["join"], "upper_us": 1}}}
    with pytest.raises(StateLayoutError, match="a join's waiting rows are keyed, dated and bounded"):
        plan_migration(recorded, proposed, {}, {})


@pytest.mark.parametrize(("point", "shard"), [pytest.param("shard_after_snapshot", 1, marks=pytest.mark.deep),
                                              ("after_sink_refunds", None)])
def test_killed_mid_epoch_heals_to_what_the_reference_emits(spark, tmp_path, point, shard):
    """kill -9 in epoch 2 (a shard task after its snapshot; or the driver after the Delta
    commit, before Iceberg and the manifest); files then land in both logs; the resumed
    run writes every epoch's rows once: the reference's, over the ranges each recorded."""
    events = tmp_path / "events"
    write_refund_logs(events, 3, PER_FILE)
    crashed = run_until_killed(tmp_path, point, 2, shard, kind="refunds", max_records=KILL_MAX,
                               hold=("refund_changes",) if point == "after_sink_refunds" else ())
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    pipeline = refunds_pipeline(events, local_tables(tmp_path / "tables"))
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=KILL_MAX), spark=spark)
    assert (runner.committed_epoch(), runner.log.last_cut()) == (1, 2)
    recorded = runner.log.offsets(2)
    write_refund_logs(events, 1, PER_FILE, first_file=3)  # lands in both logs before the resume
    resumed = runner.run_available()
    assert resumed[0].epoch == 2 and resumed[0].range == recorded.summary()  # the range recorded before the kill
    assert sum(runner.result(e).records_in for e in range(1, runner.committed_epoch() + 1)) == _log_size(events)

    reference = JoinReference(0, duration_us("30 minutes", "upper"), "left", duration_us("1 minute", "ooo"))
    everything, per_epoch = set(), []
    for epoch in range(1, runner.committed_epoch() + 1):
        pairs, outer, _ = reference.run(epoch_rows(runner, events, epoch)[0])
        everything |= pairs | outer
        per_epoch.append(len(pairs) + len(outer))
    assert [runner.result(e).records_out for e in range(1, runner.committed_epoch() + 1)] == per_epoch
    delta = DeltaTable(str(tmp_path / "tables" / "delta" / "payment_refunds")).to_pyarrow_table()
    assert emitted(delta) == everything and delta.num_rows == len(everything) > 0
    changes = next(s for s in pipeline.sinks if isinstance(s, IcebergSink)).read()
    assert changes.num_rows == sum(per_epoch)  # the crashed epoch's rows appended once, not twice
    assert emitted(changes) == everything
