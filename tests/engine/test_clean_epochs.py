"""An epoch of whole Parquet files whose footers show no bad record and no record early
enough to be late runs no side-output job: the footers give its latest event time.
Against the same records written without statistics (the job runs every epoch) and
against the window reference, the outputs, watermarks and side outputs are the same;
an epoch whose footers show a null, a time past the skew or an early record runs the
job, which finds it."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.ttl_reference import KEY, TtlReference, same_rows, ttl_file
from tests.window_reference import reference, reference_epochs, window_rows
from volley_dagster import EpochRunner, FileLog, ParquetSink, Pipeline, count, first, last, max_, sum_, tumbling
from volley_dagster.demo.events import generate
from volley_dagster.demo.refunds import refunds_join, write_refund_logs
from volley_dagster.settings import RunSettings
from volley_dagster.spark.plan import plan_epoch
from volley_dagster.spark.side_outputs import _footers_show_clean

FILES, PER_FILE, KEYS = 4, 400, 15  # each file one epoch of 40 s event time


def active_copy(source: Path, target: Path, statistics: bool, row_group_size: int = 150) -> list[Path]:
    """The log's files with every record active (the reference skips failed ones; these
    pipelines have no transform), written with or without footer statistics."""
    target.mkdir()
    out = []
    for path in sorted(source.glob("*.parquet")):
        table = pq.read_table(path)
        table = table.set_column(table.schema.get_field_index("status"), "status",
                                 pa.array(["active"] * table.num_rows))
        pq.write_table(table, target / path.name, write_statistics=statistics, row_group_size=row_group_size)
        out.append(target / path.name)
    return out


def windows_pipeline(events: Path, output: Path, skew: str | None = None, filtered: bool = False) -> Pipeline:
    pipeline = Pipeline("clean").source(FileLog(events, format="parquet"))
    if filtered:
        pipeline = pipeline.where("status != 'failed'")
    return (pipeline.key_by("merchant_id")
            .window(tumbling("10 seconds"), on="event_time", max_out_of_orderness="5 seconds",
                    allowed_lateness="2 seconds", max_event_time_skew=skew)
            .aggregate(events=count(), total=sum_("amount"), largest=max_("amount"),
                       first_event=first("event_id"), last_event=last("event_id"))
            .sink(ParquetSink(output)).with_shards(2))


def test_clean_epochs_skip_the_side_output_job_and_give_what_the_job_gives(spark, tmp_path):
    generate(tmp_path / "raw", FILES, PER_FILE, KEYS, events_per_second=10, disorder_s=1)
    runs = {}
    for statistics in (True, False):
        name = "stats" if statistics else "plain"
        files = active_copy(tmp_path / "raw", tmp_path / name, statistics)
        runner = EpochRunner(windows_pipeline(tmp_path / name, tmp_path / f"{name}_out"), tmp_path / f"{name}_state",
                             RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
        runs[name] = runner.run_available()
    ref = reference(files, tumbling("10 seconds"), 5_000_000, 2_000_000, end_of_stream=False)
    assert all(not v for v in ref.late.values()), "the data should have no late records"
    for fast, slow in zip(runs["stats"], runs["plain"], strict=True):
        assert window_rows(fast.output) == window_rows(slow.output) == ref.fired[fast.epoch]
        assert fast.watermark == slow.watermark == ref.watermark[fast.epoch]
        assert fast.late_records == slow.late_records == fast.dead_letters == 0
    assert [r.durations["side_output"] for r in runs["stats"]] == [0.0] * FILES  # the footers said all
    assert all(r.durations["side_output"] > 0 for r in runs["plain"])  # no statistics: the job looked
    assert sum(len(v) for v in ref.fired.values()) > 3 * FILES, "the data should fire windows every epoch"


def test_epochs_that_end_inside_files_are_bounded_by_the_row_groups_they_touch(spark, tmp_path):
    """A cut that ends inside a file (and inside a row group): what the footers say of
    the row groups a segment touches bounds its records; its event times, which a row
    group straddling the cut would show earlier and later than they are, are read
    exactly from the segment's own rows of the one column. No Spark job runs."""
    generate(tmp_path / "raw", FILES, PER_FILE, KEYS, events_per_second=10, disorder_s=1)
    files = active_copy(tmp_path / "raw", tmp_path / "events", True, row_group_size=32)  # 3.2 s of event time each
    runner = EpochRunner(windows_pipeline(tmp_path / "events", tmp_path / "out"), tmp_path / "state",
                         RunSettings(max_records_per_epoch=PER_FILE * 3 // 4), spark=spark)
    results: list = []
    while (rng := runner.cut_next()) is not None:
        plan = plan_epoch(spark, runner.pipeline, rng)
        assert plan.footers and any(s.start or s.end < PER_FILE for s in rng.segments)
        assert [seg for seg, _ in plan.files_as_read] == list(rng.segments)
        # what the footers say of the rows touched, the watermark before and its late bound
        late_bound = results[-1].watermark - 2_000_000 if results else None
        assert _footers_show_clean(plan, runner.pipeline, rng, None, late_bound) is not None, f"epoch {rng.epoch}"
        results.append(runner.run(rng.epoch))
    log = pa.concat_tables(pq.read_table(f).append_column("file", pa.array([f.name] * PER_FILE))
                           .append_column("offset", pa.array(range(PER_FILE), pa.int64())) for f in files)
    starts = [sum(r.records_in for r in results[:i]) for i in range(len(results))]
    ref = reference_epochs([log.slice(s, r.records_in) for s, r in zip(starts, results, strict=True)],
                           tumbling("10 seconds"), 5_000_000, 2_000_000, end_of_stream=False)
    assert sum(r.records_in for r in results) == FILES * PER_FILE and len(results) > FILES
    for r in results:
        assert window_rows(r.output) == ref.fired[r.epoch] and r.watermark == ref.watermark[r.epoch]
        assert r.late_records == r.dead_letters == 0 and r.durations["side_output"] == 0.0  # no job


T0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def write_epoch(events: Path, i: int, keys: list[int | None], seconds: list[float | None],
                statuses: list[str] | None = None) -> None:
    times = [None if s is None else T0 + dt.timedelta(seconds=s) for s in seconds]
    pq.write_table(pa.table({
        "event_id": pa.array(range(i * 10, i * 10 + len(keys)), pa.int64()),
        "merchant_id": pa.array(keys, pa.int64()),
        "amount": pa.array([1.0] * len(keys)),
        "status": pa.array(statuses or ["active"] * len(keys)),
        "event_time": pa.array(times, pa.timestamp("us", tz="UTC")),
    }), events / f"events-{i:06d}.parquet")


@pytest.mark.parametrize("case", ["null_time", "null_key", "past_skew", "late"])
def test_an_epoch_whose_footers_show_a_bad_or_early_record_runs_the_job_which_finds_it(spark, tmp_path, case):
    events = tmp_path / "events"
    events.mkdir()
    runner = EpochRunner(windows_pipeline(events, tmp_path / "out", skew="1 hour").on_bad_records("dead_letter"),
                         tmp_path / "state", spark=spark)
    write_epoch(events, 0, [1, 2, 1], [0, 3, 30])  # watermark 25 s after it: windows before 20 s are closed
    first = runner.run_next()
    assert first.durations["side_output"] == 0.0 and first.watermark == int(T0.timestamp() * 1e6) + 25_000_000
    far = 10 * 365 * 86_400.0  # ten years ahead of the wall clock of the cut
    keys, seconds = {"null_time": ([1, 2], [31, None]), "null_key": ([1, None], [31, 32]),
                     "past_skew": ([1, 2], [31, far]), "late": ([1, 2], [31, 4])}[case]
    write_epoch(events, 1, keys, seconds)
    second = runner.run_next()
    assert second.durations["side_output"] > 0, "the footers cannot show this epoch clean: the job must look"
    if case == "late":
        late = runner.late_records(2)
        assert (second.late_records, second.dead_letters) == (1, 0)
        assert late.column("offset").to_pylist() == [1] and late.column("merchant_id").to_pylist() == [2]
    else:
        dead = pq.read_table(runner.log.root / second.dead_letter_path)
        assert (second.dead_letters, second.late_records) == (1, 0)
        assert dead.column("offset").to_pylist() == [1], dead.to_pylist()
    # the bad or late record never moves the watermark: the other one (31 s) does
    assert second.watermark == int(T0.timestamp() * 1e6) + 26_000_000
    assert (first.output.num_rows, second.output.num_rows) == (2, 0)  # [0, 10) per key fired first; nothing since


def test_a_filtered_epoch_takes_its_latest_event_time_from_the_records_the_filter_keeps(spark, tmp_path):
    """Behind ``where``, the footers still show that no record is bad or early (a filter
    only drops records), but their latest event time may be a dropped record's: the
    epoch's comes from the records kept. A null event time on a dropped record makes
    the footers show nothing: the job looks, and finds no dead letter."""
    events = tmp_path / "events"
    events.mkdir()
    runner = EpochRunner(windows_pipeline(events, tmp_path / "out", filtered=True).on_bad_records("dead_letter"),
                         tmp_path / "state", spark=spark)
    epochs = [([1, 2, 1, 2], [0, 3, 30, 45], ["active", "active", "active", "failed"]),
              ([1, 2], [31, 60], ["active", "failed"]),
              ([1, 2], [40, None], ["active", "failed"])]
    results = []
    for i, (keys, seconds, statuses) in enumerate(epochs):
        write_epoch(events, i, keys, seconds, statuses)
        results.append(runner.run_next())
    base = int(T0.timestamp() * 1e6)
    # 30 s - 5 s, 31 s - 5 s, 40 s - 5 s: never the failed records' 45 s or 60 s
    assert [r.watermark for r in results] == [base + 25_000_000, base + 26_000_000, base + 35_000_000]
    assert [r.dead_letters for r in results] == [0, 0, 0]
    assert all(r.durations["side_output"] > 0 for r in results)  # the kept records' latest, or the job
    # fired: [0, 10) of both keys, in the first epoch (a watermark of 40 s would fire [30, 40) too)
    assert [r.output.num_rows for r in results] == [2, 0, 0]


def test_an_event_time_ttl_learns_the_watermark_from_its_shards_when_no_key_can_expire(spark, tmp_path):
    """Behind ``where`` and cut inside files, the footers only bound an epoch's latest
    event time. An event-time TTL acts on the watermark only by expiring keys: when the
    expiry index's earliest deadline, and the epoch's earliest record plus the TTL, are
    both past the highest watermark the footers allow, no key can expire whatever it is.
    The shard tasks then run without it and give it, after them (no max() job). Against
    the TTL reference, each file's latest record dropped by the filter."""
    events = tmp_path / "events"
    events.mkdir()
    tables = []
    for i in range(6):  # each file 400 records over 10 minutes of event time, times ascending
        table = ttl_file(i)
        statuses = pa.array(["active"] * (table.num_rows - 1) + ["failed"])  # the latest is filtered out
        table = table.set_column(table.schema.get_field_index("status"), "status", statuses)
        pq.write_table(table, events / f"events-{i:06d}.parquet", row_group_size=100)
        tables.append(table)
    pipeline = (Pipeline("ttl_learnt").source(FileLog(events, format="parquet")).where("status = 'active'")
                .key_by(KEY).aggregate(events=count(), total=sum_("amount"), ttl="25 minutes", event_time="event_time")
                .sink(ParquetSink(tmp_path / "out")).with_shards(2))
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=250), spark=spark)
    results = runner.run_available()
    log = pa.concat_tables(tables)
    starts = [sum(r.records_in for r in results[:i]) for i in range(len(results))]
    assert starts[-1] + results[-1].records_in == log.num_rows
    reference = TtlReference(ttl_us=25 * 60 * 1_000_000)
    for start, result in zip(starts, results, strict=True):
        records = log.slice(start, result.records_in)
        expected = reference.run(records.filter(pc.equal(records.column("status"), "active")))
        same_rows(result.output.to_pandas(), expected, [KEY, "events", "total", "expired"])
        assert result.figures["keys_expired"] == int(expected["expired"].sum()), f"epoch {result.epoch}"
        assert result.watermark == reference.watermark, f"epoch {result.epoch}"
    learnt = [r.epoch for r in results if r.durations["side_output"] == 0.0]
    assert 1 not in learnt, "the first epoch has no expiry index to say when its keys come due"
    assert len(learnt) >= 2 and len(learnt) < len(results) - 1, [r.durations["side_output"] for r in results]
    assert sum(r.figures["keys_expired"] for r in results) > 0
    same_rows(runner.read_state().to_pandas(), reference.current(), [KEY, "events", "total"])


def test_an_epoch_that_learns_its_watermark_leaves_later_deadlines_to_be_found(spark, tmp_path):
    """The shard tasks of an epoch that learns its watermark run at the one it starts
    from, never at the footers' higher bound: an expiry index entry a later epoch adds
    below that bound (a late record's key) and evicts to RocksDB is still found when the
    watermark passes it. One shard, one resident entry; minutes after ``T0``."""
    events = tmp_path / "events"
    events.mkdir()
    pipeline = (Pipeline("ttl_bound").source(FileLog(events, format="parquet")).where("status = 'active'")
                .key_by(KEY).aggregate(events=count(), total=sum_("amount"), ttl="25 minutes", event_time="event_time",
                                       max_expiry_entries=1)
                .sink(ParquetSink(tmp_path / "out")).with_shards(1))
    runner = EpochRunner(pipeline, tmp_path / "state", spark=spark)
    epochs = [([1, 2], [0, 5], None),  # deadlines 25 and 30: 30 is evicted
              ([3, 4], [10, 20], ["active", "failed"]),  # learns W = 10 (the footers allow 20)
              ([5, 6, 3], [-10, -12, 12], None),  # late keys, deadlines 15 and 13 (in 10..20): 15 is evicted
              ([7], [30], None)]  # W = 30: keys 6, 5, 1 and 2 expire
    reference = TtlReference(ttl_us=25 * 60 * 1_000_000)
    results = []
    for i, (keys, minutes, statuses) in enumerate(epochs):
        write_epoch(events, i, keys, [m * 60.0 for m in minutes], statuses)
        results.append(result := runner.run_next())
        records = pq.read_table(events / f"events-{i:06d}.parquet")
        expected = reference.run(records.filter(pc.equal(records.column("status"), "active")))
        same_rows(result.output.to_pandas(), expected, [KEY, "events", "total", "expired"])
        assert result.watermark == reference.watermark, f"epoch {result.epoch}"
    assert [r.durations["side_output"] == 0.0 for r in results] == [False, True, True, False]  # 2 and 3 learn it
    expired = results[-1].output.to_pandas().set_index(KEY)["expired"]
    assert sorted(expired[expired].index) == [1, 2, 5, 6]


def test_a_joins_epochs_of_two_logs_skip_the_job_when_each_sides_footers_show_them_clean(spark, tmp_path):
    """A join of two Parquet logs: each side's footers give that side's latest event
    time, and show its records fit for state (no null key or event time, no carried
    time outside years 1-9999, none early enough to be late). Against the same files
    without statistics (the job looks every epoch), the rows, watermarks, late records
    and waiting rows are the same (``test_join.py``: an epoch with a record early enough
    to be late runs the job, which finds it)."""
    write_refund_logs(tmp_path / "raw", 4, 300)
    for name in ("payments", "refunds"):
        (tmp_path / "plain" / name).mkdir(parents=True)
        for path in sorted((tmp_path / "raw" / name).glob("*.parquet")):
            pq.write_table(pq.read_table(path), tmp_path / "plain" / name / path.name, write_statistics=False)
    runs = {}
    for name in ("raw", "plain"):
        pipeline = refunds_join(tmp_path / name).sink(ParquetSink(tmp_path / f"out-{name}")).with_shards(2)
        runner = EpochRunner(pipeline, tmp_path / f"state-{name}", RunSettings(max_records_per_epoch=300), spark=spark)
        runs[name] = runner.run_available() + runner.flush()
        runs[name + "-state"] = runner.read_state().sort_by("row")
    stats, plain = runs["raw"], runs["plain"]
    assert len(stats) == len(plain) >= 5
    for a, b in zip(stats, plain, strict=True):
        assert a.output.sort_by("payments_row").equals(b.output.sort_by("payments_row")), f"epoch {a.epoch}"
        assert (a.watermark, a.input_watermarks, a.late_records, a.dead_letters) == \
            (b.watermark, b.input_watermarks, b.late_records, b.dead_letters)
    assert all(r.durations["side_output"] > 0 for r in plain if r.records_in)
    assert runs["raw-state"].equals(runs["plain-state"])
    assert [r.durations["side_output"] for r in stats if r.records_in] == [0.0] * (len(stats) - 1)  # the flush
