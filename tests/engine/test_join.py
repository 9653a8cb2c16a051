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
from pyspark.sql import functions as F

from tests.engine.test_crash_recovery import run_until_killed
from tests.join_reference import JoinReference, Row
from volley_dagster import DeltaSink, EpochRunner, FileLog, Pipeline, RunSettings
from volley_dagster import columns as engine_columns
from volley_dagster.checkpoint.migrate import plan_migration
from volley_dagster.columns import POS_OFFSET_BITS
from volley_dagster.demo.payments import local_tables
from volley_dagster.demo.refunds import refunds_pipeline, write_refund_logs
from volley_dagster.errors import StateLayoutError, StateLimitError, is_retryable
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
    # each side's footers show most epochs clean (no job); one with a late record, the job found it
    assert all(r.durations["side_output"] > 0 for r in results if r.late_records)
    assert any(r.durations["side_output"] == 0.0 for r in results), [r.durations["side_output"] for r in results]

    waiting = runner.read_state()
    assert set(zip(waiting.column("payment_id").to_pylist(), waiting.column("row").to_pylist(), strict=True)) == {
        (row.key, row.rid) for row in reference.waiting}
    assert reference.waiting, "rows wait for the end of the stream"
    [final] = runner.flush()  # review J2: the end of the stream emits every waiting outer row
    outer_at_end = reference.end_of_stream()
    assert final.end_of_stream and final.records_in == 0 and emitted(final.output) == outer_at_end
    assert final.figures["join_unmatched"] == len(outer_at_end) > 0
    assert runner.read_state().num_rows == 0 and reference.held() == (0, 0)
    _carries_its_records_columns(final.output, columns_of)
    results.append(final)
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


def _items(df):
    """Each payment as two items, ``a`` when paid and ``b`` 20 minutes later; a refund as it is."""
    is_payment = F.col(engine_columns.SOURCE) == "payments"
    df = df.withColumn("part", F.explode(F.when(is_payment, F.array(F.lit("a"), F.lit("b")))
                                         .otherwise(F.array(F.lit(None).cast("string")))))
    return df.withColumn("paid_at", F.when(F.col("part") == "b", F.col("paid_at") + F.expr("INTERVAL 20 MINUTES"))
                         .otherwise(F.col("paid_at")))


def test_a_transform_that_explodes_records_gives_each_row_its_own_identity(spark, tmp_path):
    """Review J1: a transform before the join that gives several rows per record (an
    order's items). Each item waits, matches and leaves as its own row, with its own
    columns and id (``"<epoch>:<position>.<rank>"`` after the first), through an upsert
    sink and to the end of the stream, as the reference fed the items says."""
    events = tmp_path / "events"
    write_refund_logs(events, 3, PER_FILE)
    table = tmp_path / "tables" / "items"
    pipeline = (
        Pipeline("items")
        .sources({"payments": FileLog(f"{events}/payments", format="parquet"),
                  "refunds": FileLog(f"{events}/refunds", format="parquet")})
        .transform(_items)
        .join(left="payments", right="refunds", on="payment_id", left_time="paid_at", right_time="refunded_at",
              between=("0 seconds", "+30 minutes"), how="left", max_out_of_orderness="1 minute",
              left_columns=["part", "paid_at"], right_columns=["refund_amount"])
        .sink(DeltaSink(str(table), name="items", mode="upsert"))
        .with_shards(2)
    )
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=MAX), spark=spark)
    reference = JoinReference(0, duration_us("30 minutes", "upper"), "left", duration_us("1 minute", "ooo"))
    twenty = duration_us("20 minutes", "item")
    everything: set[tuple[object, object, object]] = set()
    parts: dict[str, str] = {}  # each left row id: the item it names
    results = runner.run_available() + runner.flush()
    for result in results:
        rows, _ = epoch_rows(runner, events, result.epoch)
        before = reference.watermark
        on_time = [(side, key, at, rid, part) for side, key, time, rid in rows
                   for at, part in (((time, "a"), (time + twenty, "b")) if side == 0 else ((time, None),))
                   if before is None or at > before]
        # the rows of one record and key that are on time are ranked by event time: ids "<rid>", "<rid>.1"
        both = {rid for _, _, _, rid, part in on_time if part == "a"} & {rid for *_, rid, part in on_time if part == "b"}
        items = [(side, key, at, f"{rid}.1" if part == "b" and rid in both else rid)
                 for side, key, at, rid, part in on_time]
        parts.update({item[3]: part for item, (*_, part) in zip(items, on_time, strict=True) if item[0] == 0})
        pairs, outer, _ = reference.run(items)
        if result.end_of_stream:
            outer |= reference.end_of_stream()
        assert result.input_watermarks == {"payments": reference.side_marks[0], "refunds": reference.side_marks[1]}
        assert emitted(result.output) == pairs | outer, f"epoch {result.epoch}"
        for row in result.output.to_pylist():
            if row["payments_row"] is not None:
                assert row["part"] == parts[row["payments_row"]], row
        everything |= emitted(result.output)
    assert results[-1].end_of_stream and results[-1].figures["join_unmatched"] > 0
    assert runner.read_state().num_rows == 0
    assert any(left is not None and left.endswith(".1") and right is not None for _, left, right in everything)
    delta = DeltaTable(str(table)).to_pyarrow_table()
    assert emitted(delta) == everything and delta.num_rows == len(everything)


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
    assert not is_retryable(failure.value), "review J6: a person resizes the bound; a retry fails the same way"
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


def test_a_carried_columns_type_change_is_refused_before_the_epoch_runs(spark, tmp_path):
    """Review J3: the waiting payments were written with ``merchant_id`` a bigint; a
    pipeline that now casts it to string is refused by name before its epoch runs, never
    retried."""
    events = tmp_path / "events"
    write_refund_logs(events, 1, PER_FILE)
    tables = local_tables(tmp_path / "tables")
    runner = EpochRunner(refunds_pipeline(events, tables, shards=2), tmp_path / "state", spark=spark)
    assert runner.run_next() is not None and runner.read_state().num_rows > 0
    write_refund_logs(events, 1, PER_FILE, first_file=1)
    cast = refunds_pipeline(events, tables, shards=2).with_column("merchant_id", F.col("merchant_id").cast("string"))
    with pytest.raises(StateLayoutError, match=r"column 'merchant_id' of 'payments' was carried as bigint and is now "
                                               r"string") as refused:
        EpochRunner(cast, tmp_path / "state", spark=spark).run_next()
    assert not is_retryable(refused.value) and runner.committed_epoch() == 1


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
