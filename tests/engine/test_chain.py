"""Several stateful operators in one pipeline (``volley_dagster/chain.py``) on real Spark,
RocksDB and Delta: the refunds per merchant per hour as the demo's join, then an
hourly window over its pairs (``demo/merchant_refunds.hourly_refunds_pipeline``),
equal epoch by epoch to the references composed (``tests/join_reference.py``'s pairs
fed to ``tests/window_reference.py`` with the watermark the join hands on), with files
landing between epochs, a rescale of every stage, a re-run and the end of the stream; each minute's count then
each key's running maximum; and ``kill -9`` in the window's stage, after the join's
stage committed, resumed to the same hours, each once."""

from __future__ import annotations

import shutil
import signal
import uuid

import pandas as pd
import pyarrow as pa
import pyarrow.parquet  # noqa: F401  (pa.parquet)
import pytest
from deltalake import DeltaTable

from tests.conftest import BUCKET
from tests.engine.test_crash_recovery import run_until_killed
from tests.engine.test_join import epoch_rows
from tests.join_reference import JoinReference
from tests.processors import NewHighs
from tests.window_reference import reference_epochs
from volley_dagster import EpochRunner, FileLog, ParquetSink, Pipeline, RunSettings, cli, count, max_, sum_, tumbling
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.demo.events import generate
from volley_dagster.demo.merchant_refunds import hourly_refunds_pipeline
from volley_dagster.demo.payments import local_tables
from volley_dagster.demo.refunds import write_refund_logs
from volley_dagster.operators.event_time import duration_us

PER_FILE, MAX = 200, 700  # 16 files of 10 minutes each: the hours fire over several epochs
HOUR_COLUMNS = ["merchant_id", "window_start", "window_end", "refunds", "refunded", "largest"]
WINDOW_DELAY = duration_us("30 minutes", "the join's interval")  # what the join's watermark hands on less


def _hours(table: pa.Table) -> set[tuple]:
    rows = zip(*(table.column(c).to_pylist() for c in HOUR_COLUMNS), strict=True)
    return {(m, int(s.timestamp() * 1e6), int(e.timestamp() * 1e6), n, round(total, 6), largest)
            for m, s, e, n, total, largest in rows}


class _ComposedReference:
    """The join's reference fed each epoch's recorded records; its pairs with a refund,
    as the window reference's events; the window's watermark the join's less 30 minutes."""

    def __init__(self) -> None:
        self.join = JoinReference(0, WINDOW_DELAY, "left", duration_us("1 minute", "ooo"))
        self.pairs: list[pa.Table] = []
        self.handed: list[int | None] = []
        self.join_late: list[int] = []
        self.values: dict[str, dict[str, object]] = {}  # every record's columns by row id: pairs match old rows

    def epoch(self, runner: EpochRunner, events, epoch: int) -> None:
        rows, fresh = epoch_rows(runner, events, epoch)
        values = self.values
        values.update(fresh)
        pairs, _outer, late = self.join.run(rows)
        self.join_late.append(len(late))
        refunds = [(values[left]["merchant_id"], values[right]["refunded_at"], values[right]["refund_amount"], left)
                   for _key, left, right in sorted(pairs, key=str) if right is not None]
        self.pairs.append(pa.table({
            "merchant_id": pa.array([r[0] for r in refunds], pa.int64()),
            "event_time": pa.array([r[1] for r in refunds], pa.timestamp("us", "UTC")),
            "amount": pa.array([r[2] for r in refunds], pa.float64()),
            "event_id": pa.array(range(len(refunds)), pa.int64()), "status": pa.array(["ok"] * len(refunds)),
            "file": pa.array([r[3] for r in refunds], pa.string()), "offset": pa.array([0] * len(refunds), pa.int64())}))
        mark = self.join.watermark
        self.handed.append(None if mark is None else mark - WINDOW_DELAY)

    def hours(self, end_of_stream: bool):
        return reference_epochs(self.pairs, tumbling("1 hour"), 0, 0, end_of_stream, handed=self.handed)


def test_refunds_per_merchant_per_hour_in_one_pipeline_equal_the_references_composed(spark, tmp_path):
    events = tmp_path / "events"
    write_refund_logs(events, 8, PER_FILE)
    tables = local_tables(tmp_path / "tables")
    pipeline = hourly_refunds_pipeline(events, tables)
    assert [stage.operator_name for stage in pipeline.stages()] == ["join(...)", "window(...).aggregate(...)"]
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=MAX), spark=spark)
    reference, results = _ComposedReference(), []
    while True:
        if len(results) == 2:
            write_refund_logs(events, 8, PER_FILE, first_file=8)  # both logs advance between epochs
        if len(results) == 3:
            runner.rescale(3)  # every stage: the join's waiting rows and the open hours move with their key groups
        result = runner.run_next()
        if result is None:
            break
        reference.epoch(runner, events, result.epoch)
        results.append(result)
    [final] = runner.flush()
    reference.epoch(runner, events, final.epoch)
    results.append(final)

    expected = reference.hours(end_of_stream=True)
    fired = {epoch: {row[:6] for row in rows} for epoch, rows in expected.fired.items()}
    [join_stage] = runner.stage_runners()
    assert runner.layout().num_shards == join_stage.layout().num_shards == 3
    for result in results:
        epoch = result.epoch
        assert _hours(result.output) == fired[epoch], f"epoch {epoch}"
        assert result.watermark == expected.watermark[epoch]
        assert result.late_records == len(expected.late[epoch]) == 0  # nothing the join emits on time is late
        assert result.figures["stage1_late_records"] == reference.join_late[epoch - 1]
        assert result.figures.get("stage1_watermark") == reference.join.watermark if epoch == final.epoch else True
        assert join_stage.result(epoch).records_in == result.records_in  # the epoch as cut from the two logs
        if not result.already_committed:  # what each stage's attempt ran, and the chain in all
            assert result.figures["chain_spark_jobs"] == result.figures["spark_jobs"] + result.figures[
                "stage1_spark_jobs"] and result.figures["spark_jobs"] >= 1
    assert sum(len(f) for f in fired.values()) > 20
    assert sum(1 for e in fired.values() if e) >= 3, "hours fire across epochs, not only at the end"
    table = DeltaTable(f"{tables.warehouse}/delta/hourly_refunds").to_pyarrow_table()
    assert _hours(table) == {row for rows in fired.values() for row in rows}
    assert table.num_rows == sum(r.records_out for r in results)

    again = runner.run(results[1].epoch)  # committed: neither stage runs, nothing is written
    assert again.already_committed
    assert DeltaTable(f"{tables.warehouse}/delta/hourly_refunds").to_pyarrow_table().num_rows == table.num_rows
    assert runner.read_state().num_rows == 0 and join_stage.read_state().num_rows == 0  # all fired, all left


def test_each_windows_count_then_each_keys_running_maximum(spark, tmp_path):
    events = tmp_path / "events"
    generate(events, 4, 300, 7, seed=5)
    out = tmp_path / "out"
    pipeline = (Pipeline("busiest_minute").source(FileLog(events, format="parquet")).where("status != 'failed'")
                .key_by("merchant_id").window(tumbling("10 seconds"), on="event_time", max_out_of_orderness="5 seconds")
                .aggregate(events=count())
                .key_by("merchant_id").aggregate(busiest=max_("events"), windows=count())
                .sink(ParquetSink(out)).with_shards(2))
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=400, keep_epochs=50), spark=spark)
    results = runner.run_available() + runner.flush()
    minutes = runner.stage_runners()[0]
    fired = pa.concat_tables([_stage_rows(minutes, r.epoch)
                              for r in results]).to_pandas()
    totals = runner.read_state().to_pandas().set_index("merchant_id")
    expected = fired.groupby("merchant_id").agg(busiest=("events", "max"), windows=("events", "size"))
    assert len(expected) == 7 and (expected["windows"] >= 3).all()
    assert totals.loc[expected.index, ["busiest", "windows"]].astype(int).equals(expected.astype(int))
    everything = pa.parquet.read_table(events).to_pandas()  # every minute's count came from the log, once
    ok = everything[everything.status != "failed"]
    assert fired["events"].sum() == len(ok) - sum(r.late_records for r in
                                                  (minutes.result(e.epoch) for e in results))


def test_windows_then_a_teams_processor_then_an_aggregate(spark, tmp_path, capsys):
    """``process`` in the middle of a chain: each 10 seconds' count per merchant, then the
    windows that set a merchant's record (``NewHighs``, value state, in the order the
    window emitted them), then how many records each merchant set. The window's rows
    equal the window reference fed what each epoch recorded."""
    events = tmp_path / "events"
    generate(events, 4, 300, 5, seed=9)
    pipeline = (Pipeline("records").source(FileLog(events, format="parquet")).where("status != 'failed'")
                .key_by("merchant_id").window(tumbling("10 seconds"), on="event_time").aggregate(events=count())
                .key_by("merchant_id").process(NewHighs(), output_schema=NewHighs.OUTPUT)
                .key_by("merchant_id").aggregate(records=count(), best=max_("events"))
                .with_shards(2))
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=300, keep_epochs=50),
                         spark=spark)
    results = runner.run_available() + runner.flush()
    windows, highs = runner.stage_runners()
    recorded = [_recorded(runner, events, r.epoch) for r in results]
    reference = reference_epochs(recorded, tumbling("10 seconds"), 0, 0, end_of_stream=True)
    fired = {r.epoch: _stage_rows(windows, r.epoch) for r in results}
    for result in results:
        got = fired[result.epoch].to_pylist()
        assert sorted((r["merchant_id"], int(r["window_start"].timestamp() * 1e6), r["events"]) for r in got) == \
            sorted((row[0], row[1], row[3]) for row in reference.fired[result.epoch]), f"epoch {result.epoch}"
    best: dict[int, int] = {}
    expected_highs = []
    for result in results:  # the processor's reference: the windows in the order the stage emitted them
        got = fired[result.epoch].to_pylist()
        for row in sorted(got, key=lambda r: (r["merchant_id"], r["window_start"])):
            if row["events"] > best.get(row["merchant_id"], 0):
                best[row["merchant_id"]] = row["events"]
                expected_highs.append((row["merchant_id"], row["window_start"], row["events"]))
    emitted = pa.concat_tables([_stage_rows(highs, r.epoch) for r in results]).to_pylist()
    assert sorted((r["merchant_id"], r["window_start"], r["events"]) for r in emitted) == sorted(expected_highs)
    totals = runner.read_state().to_pylist()
    assert {(t["merchant_id"], t["records"], t["best"]) for t in totals} == {
        (m, sum(1 for h in expected_highs if h[0] == m), b) for m, b in best.items()}
    assert len(expected_highs) > len(best) >= 5  # records were set more than once per merchant

    assert cli.main(["state", "show", str(tmp_path / "state"), "--stage", "2"]) == 0  # the processor's value state
    shown = capsys.readouterr().out
    assert "state/stages/1: state at epoch" in shown and f"({len(best)} rows)" in shown and "best" in shown
    assert cli.main(["state", "show", str(tmp_path / "state")]) == 0
    assert "(the last of a chain's 3 stateful stages; --stage 1..2 shows the others)" in capsys.readouterr().out
    assert cli.main(["state", "show", str(tmp_path / "state"), "--stage", "4"]) == 2
    assert cli.main(["rescale", str(tmp_path / "state"), "--shards", "3"]) == 0  # every stage, from the root alone
    assert [r.layout().num_shards for r in (windows, highs, runner)] == [3, 3, 3]


def test_a_stage_without_a_clock_hands_on_the_watermark_it_was_handed(spark, tmp_path):
    """windows -> a processor with no time mode -> windows over its rows: the last
    windows fire as the first stage's watermark passes them (handed on through the
    processor), not only at the stream's end."""
    events = tmp_path / "events"
    generate(events, 4, 300, 5, seed=9)
    pipeline = (Pipeline("highs_per_minute").source(FileLog(events, format="parquet")).where("status != 'failed'")
                .key_by("merchant_id").window(tumbling("10 seconds"), on="event_time").aggregate(events=count())
                .key_by("merchant_id").process(NewHighs(), output_schema=NewHighs.OUTPUT)
                .key_by("merchant_id").window(tumbling("20 seconds"), on="window_end").aggregate(highs=count())
                .with_shards(2))
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=200), spark=spark)
    results = runner.run_available()
    windows, _ = runner.stage_runners()
    assert [r.watermark for r in results] == [windows.result(r.epoch).watermark for r in results]  # window_end: 0 delay
    assert sum(r.records_out for r in results) > 0, "the last windows fire before the stream's end"
    assert sum(r.late_records for r in results) == 0


def test_each_stage_keeps_its_snapshots_on_s3_apart_and_restores_them(spark, seaweedfs, tmp_path):
    """With an S3 snapshot store, each stage's snapshots live in a folder of their own:
    one stage's retention never prunes another's, and a machine without the last
    epoch's snapshots on disk restores every stage's from S3, to the same state."""
    events = tmp_path / "events"
    generate(events, 5, 200, 5, seed=3)

    def chain(root, store):
        pipeline = (Pipeline("busiest").source(FileLog(events, format="parquet")).where("status != 'failed'")
                    .key_by("merchant_id").window(tumbling("10 seconds"), on="event_time").aggregate(events=count())
                    .key_by("merchant_id").aggregate(busiest=max_("events"), fired=count()).with_shards(2))
        return EpochRunner(pipeline, root, RunSettings(max_records_per_epoch=200, keep_epochs=2, snapshot_store=store,
                                                      snapshot_cache=tmp_path / "cache"), spark=spark)

    store = S3SnapshotStore(f"s3://{BUCKET}/chain-{uuid.uuid4().hex[:8]}", seaweedfs.s3)
    runner = chain(tmp_path / "state", store)
    for _ in range(4):
        runner.run_next()
    [windows] = runner.stage_runners()
    assert store.epochs() == runner.log.retained_snapshots() == [3, 4]
    assert store.within("stages/0").epochs() == windows.log.retained_snapshots() == [3, 4]
    for root in (runner.log.root, windows.log.root):  # another machine: epoch 4's snapshots are not on its disk
        shutil.rmtree(root / "snapshots" / f"{4:010d}")
    runner.run_next()
    plain = chain(tmp_path / "plain", None)
    plain.run_available()
    assert runner.read_state().sort_by("merchant_id") == plain.read_state().sort_by("merchant_id")
    assert windows.read_state().sort_by([("merchant_id", "ascending"), ("window_start", "ascending")]) == \
        plain.stage_runners()[0].read_state().sort_by([("merchant_id", "ascending"), ("window_start", "ascending")])


def test_deduplicate_then_join_then_aggregate(spark, tmp_path):
    """Re-sent payments and refunds dropped, then each payment joined with its refunds,
    then refunds per merchant: at the stream's end the totals equal the demo's logs (no
    copy) joined and summed with pandas; every copy is counted by the first stage as a
    duplicate or a late copy, and none reaches the join late (it is handed the
    deduplication's watermark less ``within``)."""
    events = tmp_path / "events"
    write_refund_logs(events, 6, PER_FILE)
    pipeline = (Pipeline("unique_refunds")
                .sources({"payments": FileLog(events / "payments", format="parquet"),
                          "refunds": FileLog(events / "refunds", format="parquet")}, source_column="source")
                .with_column("at", "coalesce(paid_at, refunded_at)")
                .deduplicate(on=["source", "payment_id", "at"], within="1 hour", event_time="at")
                .join(left="payments", right="refunds", on="payment_id", left_time="paid_at",
                      right_time="refunded_at", between=("0 seconds", "+30 minutes"), sides_from="source",
                      left_columns=["merchant_id", "paid_at"], right_columns=["refund_amount", "refunded_at"])
                .key_by("merchant_id").aggregate(refunds=count(), refunded=sum_("refund_amount"))
                .with_shards(2))
    assert [s.operator_name for s in pipeline.stages()] == ["deduplicate(...)", "join(...)", "aggregate(...)"]
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=MAX), spark=spark)
    ran = runner.run_available()
    write_refund_logs(events, 6, PER_FILE, first_file=6)
    copies = 0
    for side in ("payments", "refunds"):  # re-sent: the rows of files 4 and 5 again, in a file landing last
        resent = pa.concat_tables([pa.parquet.read_table(events / side / f"{side}-00000{i}.parquet") for i in (4, 5)])
        pa.parquet.write_table(resent, events / side / f"{side}-000011-resent.parquet")
        copies += resent.num_rows
    ran += runner.run_available() + runner.flush()
    dropped = sum(r.figures.get("stage1_duplicates", 0) + r.figures.get("stage1_dedup_late", 0) for r in ran)
    assert dropped == copies and sum(r.figures.get("stage2_late_records", 0) for r in ran) == 0

    payments = pa.concat_tables(pa.parquet.read_table(events / "payments" / f"payments-{i:06d}.parquet")
                                for i in range(12)).to_pandas()
    refunds = pa.concat_tables(pa.parquet.read_table(events / "refunds" / f"refunds-{i:06d}.parquet")
                               for i in range(12)).to_pandas().merge(payments, on="payment_id")
    refunds = refunds[(refunds.refunded_at >= refunds.paid_at)
                      & (refunds.refunded_at <= refunds.paid_at + pd.Timedelta(minutes=30))]
    expected = refunds.groupby("merchant_id").agg(refunds=("refund_amount", "size"), refunded=("refund_amount", "sum"))
    got = runner.read_state().to_pandas().set_index("merchant_id").sort_index()
    assert len(got) == len(expected) > 20
    assert (got["refunds"] == expected["refunds"]).all()
    assert ((got["refunded"] - expected["refunded"]).abs() < 1e-6).all()


def _recorded(runner: EpochRunner, events, epoch: int) -> pa.Table:
    """The records ``epoch`` recorded, as the window reference reads them."""
    first = next(iter(sorted(events.glob("*.parquet"))))
    parts = [pa.parquet.read_table(first).slice(0, 0).append_column("file", pa.array([], pa.string()))
             .append_column("offset", pa.array([], pa.int64()))]
    for seg in runner.log.offsets(epoch).segments:
        rows = pa.parquet.read_table(events / seg.file).slice(seg.start, seg.records)
        parts.append(rows.append_column("file", pa.array([seg.file] * rows.num_rows))
                     .append_column("offset", pa.array(range(seg.start, seg.end), pa.int64())))
    return pa.concat_tables(parts)


def _stage_rows(runner: EpochRunner, epoch: int) -> pa.Table:
    """A stage's rows of ``epoch``, as the next stage read them (its output file)."""
    return pa.parquet.read_table(runner.pipeline.sinks[0].file_for(runner.pipeline.name, epoch))


@pytest.mark.parametrize("point", ["after_sink_hourly_refunds"])
def test_a_kill_9_in_the_windows_stage_after_the_join_committed_resumes_to_the_same_hours(spark, tmp_path, point):
    events = tmp_path / "events"
    write_refund_logs(events, 12, PER_FILE)
    crashed = run_until_killed(tmp_path, point, 2, kind="hourly_refunds", max_records=MAX)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    runner = EpochRunner(hourly_refunds_pipeline(events, local_tables(tmp_path / "tables")), tmp_path / "state",
                         RunSettings(max_records_per_epoch=MAX), spark=spark)
    [join_stage] = runner.stage_runners()
    assert runner.committed_epoch() == 1 and join_stage.committed_epoch() == 2  # killed between the stages
    runner.run_available()  # nobody acts but to run on: the window's stage resumes at epoch 2
    assert runner.committed_epoch() >= 3
    reference = _ComposedReference()
    for epoch in range(1, runner.committed_epoch() + 1):
        reference.epoch(runner, events, epoch)
    expected = {row[:6] for rows in reference.hours(end_of_stream=False).fired.values() for row in rows}
    table = DeltaTable(str(tmp_path / "tables" / "delta" / "hourly_refunds")).to_pyarrow_table()
    assert _hours(table) == expected and table.num_rows == len(expected) > 0  # each hour once
