"""Event-time windows on real Spark and RocksDB, against the documented rule
applied record by record (``tests.window_reference``)."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.window_reference import reference, window_pipeline, window_rows
from volley_dagster import EpochOrderError, EpochRunner, MalformedRecordError, session, sliding, tumbling
from volley_dagster.demo.events import generate
from volley_dagster.settings import RunSettings

FILES, PER_FILE, KEYS = 10, 300, 20  # each file is one epoch of 30 s event time
DELAY, LATENESS = "5 seconds", "2 seconds"


def run_windows(spark, base, windows, max_pending=None, ntz=False):
    files = generate(base / "events", FILES, PER_FILE, KEYS, events_per_second=10, disorder_s=30)
    pipeline = window_pipeline(base / "events", base / "out", windows, delay=DELAY, lateness=LATENESS,
                               max_pending=max_pending, ntz=ntz)
    # every epoch's late records are read afterwards: keep them all (retention removes side outputs)
    runner = EpochRunner(pipeline, base / "state", RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=FILES + 1), spark=spark)
    results = runner.run_available()
    results += runner.flush()  # end of stream: an empty final epoch fires what is still open
    ref = reference([base / "events" / f for f in files], windows, 5_000_000, 2_000_000, end_of_stream=False)
    return runner, results, ref


def write_batch(events, i: int, batch: list[tuple[int, dt.datetime]]) -> None:
    """Log file ``i``: one active 1.0 payment per (merchant, event time)."""
    pq.write_table(pa.table({
        "event_id": pa.array([i * 10 + j for j in range(len(batch))], pa.int64()),
        "merchant_id": pa.array([m for m, _ in batch], pa.int64()),
        "amount": pa.array([1.0] * len(batch)),
        "status": pa.array(["active"] * len(batch)),
        "event_time": pa.array([t for _, t in batch], pa.timestamp("us", tz="UTC")),
    }), events / f"events-{i:06d}.parquet")


def check_against_reference(runner, results, ref):
    assert [r.epoch for r in results] == list(range(1, FILES + 2))
    emitted = set()
    for r in results[:FILES]:
        got = window_rows(r.output)
        assert len(got) == r.output.num_rows == r.records_out
        assert got == ref.fired[r.epoch], f"epoch {r.epoch}: fired windows differ from the reference"
        assert r.watermark == ref.watermark[r.epoch]
        late = runner.late_records(r.epoch)
        got_late = set() if late is None else set(zip(
            late.column("file").to_pylist(), late.column("offset").to_pylist(),
            late.column("window_start").cast(pa.int64()).to_pylist()))
        assert got_late == ref.late[r.epoch], f"epoch {r.epoch}: late records differ from the reference"
        assert r.late_records == len(ref.late[r.epoch])
        assert not emitted & got, "a window was emitted twice"
        emitted |= got
    final = results[-1]
    assert final.end_of_stream and final.records_in == 0
    assert window_rows(final.output) == ref.open  # end of stream fires every pending window
    assert runner.read_state().num_rows == 0
    assert sum(len(v) for v in ref.late.values()) > 0, "the data should include late records"
    assert sum(len(v) for v in ref.fired.values()) > 10 * FILES, "the data should fire windows every epoch"


@pytest.mark.parametrize(
    "windows",
    [tumbling("10 seconds"),
     pytest.param(sliding("20 seconds", "10 seconds"), marks=pytest.mark.deep),  # the property test draws sliding too
     session("8 seconds")],
    ids=["tumbling", "sliding", "session"],
)
def test_windows_equal_reference(spark, tmp_path, windows):
    runner, results, ref = run_windows(spark, tmp_path, windows)
    check_against_reference(runner, results, ref)
    assert all(s.operator.figures["pending_evicted"] == 0 for r in results for s in r.shards.values())
    # open windows are read from the shards' resident mirrors (state/resident.py), each epoch
    assert {s.read_mode for r in results for s in r.shards.values()} - {"carried_forward"} == {"resident"}
    with pytest.raises(EpochOrderError, match="ended its stream"):
        runner.cut_next()


def test_bounded_pending_index_evicts_and_emits_the_same(spark, tmp_path):
    bound = 3
    runner, results, ref = run_windows(spark, tmp_path, sliding("20 seconds", "10 seconds"), max_pending=bound)
    check_against_reference(runner, results, ref)
    shards = [s for r in results[:FILES] for s in r.shards.values()]
    assert all(s.operator.figures["pending_resident"] <= bound for s in shards)  # what stays in memory is bounded
    assert all(s.operator.figures["pending_evicted_now"] > 0 for r in results[:FILES - 1] for s in r.shards.values())
    assert sum(s.operator.figures["pending_evicted_fired"] for s in shards) > 0  # evicted windows still fire


def test_session_spanning_three_epochs_and_bridging(spark, tmp_path):
    """One session grows over three epochs; in another key, a record bridges two sessions
    opened in earlier epochs."""
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    batches = [  # (merchant, seconds after t0); one file, then one epoch, each
        [(1, 0), (2, 0), (2, 20)],
        [(1, 8)],
        [(1, 16), (2, 10)],
        [(3, 100)],  # moves the watermark past everything above
    ]
    events = tmp_path / "events"
    events.mkdir()
    pipeline = window_pipeline(events, tmp_path / "out", session("10 seconds"), delay="60 seconds", lateness="0 s")
    runner = EpochRunner(pipeline, tmp_path / "state", spark=spark)
    fired = []
    for i, batch in enumerate(batches):
        write_batch(events, i, [(m, t0 + dt.timedelta(seconds=s)) for m, s in batch])
        fired.append(window_rows(runner.run_next().output))
    us = lambda s: int((t0 + dt.timedelta(seconds=s)).timestamp() * 1_000_000)  # noqa: E731
    sessions = {(1, us(0), us(26), 3), (2, us(0), us(30), 3)}
    assert {(k, s, e, n) for k, s, e, n, *_ in window_rows(runner.read_state(3))} == sessions
    assert all(not f for f in fired[:3])
    assert {(k, s, e, n) for k, s, e, n, *_ in fired[3]} == sessions
    first_last = {k: (f, l) for k, _, _, _, _, _, f, l in fired[3]}
    assert first_last == {1: (0, 20), 2: (1, 21)}  # log order across the merged sessions


def test_session_windows_on_a_timestamp_ntz_column(spark, tmp_path):
    """TIMESTAMP_NTZ event time (accepted by window(on=...)) sessions like TIMESTAMP."""
    runner, results, ref = run_windows(spark, tmp_path, session("8 seconds"), ntz=True)
    check_against_reference(runner, results, ref)


def test_a_stream_that_resumes_after_a_pause_longer_than_the_skew_is_on_time(spark, tmp_path):
    """Issue 31: with ``max_event_time_skew="10 minutes"``, a stream quiet for two hours
    of event time (a night) resumes on time, every record in a window, nothing a bad
    record; a lone record a day past the wall clock of its cut is still refused. The
    skew is judged against that wall clock, not the watermark."""
    now = dt.datetime.now(dt.timezone.utc)
    t0 = (now - dt.timedelta(hours=5)).replace(second=0, microsecond=0)
    after = t0 + dt.timedelta(hours=2)  # two hours of silence, twelve times the skew
    batches = [[(1, t0), (2, t0 + dt.timedelta(seconds=30))],
               [(1, after), (2, after + dt.timedelta(seconds=40))],
               [(1, after + dt.timedelta(minutes=3)), (2, now + dt.timedelta(days=1))]]  # the lone broken clock
    events = tmp_path / "events"
    events.mkdir()
    runner = EpochRunner(window_pipeline(events, tmp_path / "out", tumbling("1 minute"), delay="5 seconds",
                                         lateness="0 s", skew="10 minutes").on_bad_records("dead_letter"),
                         tmp_path / "state", spark=spark)
    results = []
    for i, batch in enumerate(batches):
        write_batch(events, i, batch)
        results.append(runner.run_next())
    us = lambda t: int(t.timestamp() * 1_000_000)  # noqa: E731
    assert [r.dead_letters for r in results] == [0, 0, 1]
    assert [r.late_records for r in results] == [0, 0, 0]
    assert [r.watermark for r in results] == [us(t0) + 25_000_000, us(after) + 35_000_000,
                                              us(after) + 175_000_000]
    fired = [{(k, s) for k, s, *_ in window_rows(r.output)} for r in results]
    assert fired == [set(), {(1, us(t0)), (2, us(t0))}, {(1, us(after)), (2, us(after))}]
    dead = pq.read_table(runner.log.root / results[2].dead_letter_path).to_pylist()
    assert len(dead) == 1 and "max_event_time_skew" in dead[0]["reason"] and "wall clock" in dead[0]["reason"]


def test_a_record_from_the_far_future_is_a_dead_letter_not_the_watermark(spark, tmp_path):
    """One event time in year 9999 (a broken clock) would move the watermark for good and
    make every later record late; with ``max_event_time_skew`` it is a dead letter."""
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    far = dt.datetime(9999, 12, 31, tzinfo=dt.timezone.utc)
    batches = [[(1, t0), (2, t0 + dt.timedelta(seconds=3))],
               [(1, t0 + dt.timedelta(seconds=12)), (2, far)],  # the broken clock
               [(1, t0 + dt.timedelta(seconds=25)), (2, t0 + dt.timedelta(seconds=26))]]
    events = tmp_path / "events"
    events.mkdir()
    pipeline = window_pipeline(events, tmp_path / "out", tumbling("10 seconds"), delay="5 seconds", lateness="0 s",
                               skew="1 hour")
    runner = EpochRunner(pipeline.on_bad_records("dead_letter"), tmp_path / "state", spark=spark)
    strict = EpochRunner(window_pipeline(events, tmp_path / "strict_out", tumbling("10 seconds"), delay="5 seconds",
                                         lateness="0 s", skew="1 hour"), tmp_path / "strict", RunSettings(max_records_per_epoch=2), spark=spark)
    results = []
    for i, batch in enumerate(batches):
        write_batch(events, i, batch)
        results.append(runner.run_next())
        if i == 1:
            strict.run_next()
            with pytest.raises(MalformedRecordError, match=r"epoch 2: 1 malformed record\(s\): events-000001\.parquet "
                                                           r"record 1: event time beyond max_event_time_skew"):
                strict.run_next()
    us = lambda t: int(t.timestamp() * 1_000_000)  # noqa: E731
    assert [r.dead_letters for r in results] == [0, 1, 0]
    assert [r.watermark for r in results] == [us(t0) - 2_000_000, us(t0) + 7_000_000, us(t0) + 21_000_000]
    assert [r.late_records for r in results] == [0, 0, 0]  # nothing after the broken clock is late
    dead = pq.read_table(runner.log.root / results[1].dead_letter_path).to_pylist()
    assert len(dead) == 1 and dead[0]["offset"] == 1 and "max_event_time_skew" in dead[0]["reason"]
    assert "9999-12-31" in dead[0]["raw"]
    fired = {(k, s) for k, s, *_ in window_rows(results[1].output) | window_rows(results[2].output)}
    assert fired == {(1, us(t0)), (2, us(t0)), (1, us(t0) + 10_000_000)}  # windows closed by real time only


@pytest.mark.parametrize("windows", [tumbling("10 seconds"), sliding("10 seconds", "5 seconds"), session("5 seconds")],
                         ids=["tumbling", "sliding", "session"])
def test_only_records_before_the_watermark_less_lateness_are_read_for_late_pairs(spark, tmp_path, windows):
    """The late rows' necessary test (event time < W - lateness: a window ends after its
    records) reaches the Parquet scan, before the windows are assigned, so row groups of
    later records are skipped; and the pairs it finds are exactly those whose window
    closed, as assigning every record's windows finds them."""
    from pyspark.sql import functions as F

    from volley_dagster import columns

    generate(tmp_path / "events", 1, 600, KEYS, events_per_second=10, disorder_s=30)
    pipeline = window_pipeline(tmp_path / "events", tmp_path / "out", windows, delay=DELAY, lateness=LATENESS)
    rows = (spark.read.parquet(str(tmp_path / "events")).withColumn(columns.KEY, F.col("merchant_id"))
            .withColumn(columns.POS, F.col("event_id")))
    operator = pipeline.stateful_operator().resolve(rows.schema)
    times = sorted(r[0] for r in rows.select(F.unix_micros("event_time")).collect())
    watermark = times[len(times) // 2]  # half the records are before it
    late = operator.late(operator.assign(rows), watermark)
    scan = late._jdf.queryExecution().executedPlan().toString()
    assert "LessThan(event_time," in scan.split("PushedFilters:")[1].split("]")[0], scan
    every_pair = operator.assign(rows).where(operator.is_late(watermark))
    found = sorted(tuple(r) for r in late.select(columns.POS, "window_start").collect())
    expected = sorted(tuple(r) for r in every_pair.select(columns.POS, F.timestamp_micros(columns.WINDOW_START)).collect())
    assert found == expected and len(found) > 0
