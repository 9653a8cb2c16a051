"""Deduplication within a watermark on real Spark, RocksDB, Delta and Iceberg, against
the reference in ``tests/dedup_reference.py``: copies within one epoch, across epochs
and past the bound (late: dropped and counted apart); a replay of old batches after
their keys were forgotten, which adds nothing; before a running aggregate and before
a window; a ``kill -9`` after the Delta commit of an epoch, whose re-run drops the
same records; a rescale of the remembered keys."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark.sql import functions as F

from tests.dedup_reference import (
    ID,
    KEY,
    DedupReference,
    dedup_file,
    dedup_pipeline,
    unique_pipeline,
    write_dedup_log,
)
from tests.engine.test_crash_recovery import run_until_killed
from tests.ttl_reference import same_rows
from volley_dagster import (
    ConfigError,
    EpochRunner,
    FileLog,
    ParquetSink,
    Pipeline,
    columns,
    count,
    first,
    last,
    max_,
    sum_,
    tumbling,
)
from volley_dagster.checkpoint.migrate import plan_migration
from volley_dagster.cli import main as volley
from volley_dagster.demo.events import write_events
from volley_dagster.errors import MalformedRecordError, StateLayoutError
from volley_dagster.settings import RunSettings
from volley_dagster.sources.storage import storage_for

FILES, ROWS = 5, 400  # file 4 (epoch 4) repeats ids past the bound (late), file 5 a reused id again
VALUES = [KEY, "events", "total"]
EVERY_VALUE = [*VALUES, "opening", "closing", "top", "ids"]  # the probe-in-stage test's aggregate


def check_side_output(runner: EpochRunner, result, dropped: list[int], late: list[int]) -> None:
    """The epoch's figures and its duplicates side output: every dropped record, in log
    order, the late ones with reason ``late``, the others ``duplicate``."""
    assert (result.figures["duplicates"], result.figures["dedup_late"]) == (len(dropped) - len(late), len(late)), f"epoch {result.epoch}"
    side = runner.duplicate_records(result.epoch)
    offsets = [] if side is None else side.column("offset").to_pylist()
    assert offsets == dropped, f"epoch {result.epoch}: the duplicates side output differs from the reference"
    reasons = [] if side is None else side.column("reason").to_pylist()
    late_rows = set(late)
    assert reasons == ["late" if row in late_rows else "duplicate" for row in dropped], f"epoch {result.epoch}"


def check_epoch(runner: EpochRunner, result, expected: pd.DataFrame, dropped: list[int], late: list[int]) -> None:
    same_rows(result.output.to_pandas(), expected, VALUES)
    check_side_output(runner, result, dropped, late)


def test_duplicates_are_dropped_as_the_reference_and_the_tables_hold_the_kept_records(spark, tmp_path):
    logs = write_dedup_log(tmp_path / "events", FILES)
    runner = EpochRunner(dedup_pipeline(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables"), tmp_path / "state", RunSettings(max_records_per_epoch=ROWS, keep_epochs=FILES), spark=spark)  # every epoch's duplicates are read afterwards
    results = runner.run_available()
    assert [r.epoch for r in results] == list(range(1, FILES + 1))
    reference = DedupReference()
    for result, records in zip(results, logs, strict=True):
        check_epoch(runner, result, *reference.run(records))
    assert all(r.records_aggregated == ROWS - r.figures["duplicates"] - r.figures["dedup_late"] for r in results)
    assert [r.figures["dedup_late"] for r in results] == [0, 0, 0, 20, 20]
    # the probe's job observed each epoch's watermark, and no bad record: no side-output job ran
    assert [r.watermark for r in results] == reference.watermarks[1:] + [reference.watermark]
    assert [r.durations["side_output"] for r in results] == [0.0] * FILES
    # epoch 4 repeats the first ten events of the first file twice, 30 minutes back:
    # both copies are late (event time + 15 minutes <= the watermark epoch 4 starts from)
    side = runner.duplicate_records(4)
    assert side is not None and side.column_names == ["partition", "file", "offset", ID, "event_time", "reason"]
    assert set(side.column("file").to_pylist()) == {"events-000003.parquet"}
    past = [(i, r) for i, r in zip(side.column(ID).to_pylist(), side.column("reason").to_pylist(), strict=True)
            if i < 10]
    assert sorted(past) == [(i, "late") for i in range(10) for _ in range(2)]
    figures = [s.operator.figures for r in results for s in r.shards.values()]
    assert sum(f["dedup_keys_forgotten"] for f in figures) > 0  # memory is bounded by the watermark
    assert sum(f["dedup_keys_remembered"] for f in figures) == reference.remembered_total
    same_rows(runner.read_state().to_pandas(), reference.current(), VALUES)
    delta, iceberg = runner.pipeline.sinks[1], runner.pipeline.sinks[2]
    for table in (delta, iceberg):
        same_rows(table.read().to_pandas(), reference.current(), VALUES)
        assert table.epoch_history("dedup") == {r.epoch: [r.records_out] for r in results}
    # an epoch without records carries its state forward; the next one still remembers
    rng = runner.cut_next(allow_empty=True)
    assert rng is not None and runner.run(rng.epoch).figures["duplicates"] == 0


def test_a_replay_of_old_batches_after_their_keys_were_forgotten_adds_nothing(spark, tmp_path):
    """Issue 31 (F4): after five files, file 3 is sent again (its later events still
    remembered, its earlier ones forgotten), then the first file twice (every key
    long forgotten). Every replayed record is a duplicate or late, so the running
    aggregate, its state and the Delta and Iceberg tables hold what they held after
    five files, however often the old batch comes again; the late copies are counted
    as ``dedup_late`` (not ``duplicates``) and named in the side output as ``late``.
    Before, each replay of the first file was kept and counted again."""
    logs = write_dedup_log(tmp_path / "events", FILES)
    replays = [dedup_file(3), dedup_file(0), dedup_file(0)]
    runner = EpochRunner(dedup_pipeline(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables"), tmp_path / "state", RunSettings(max_records_per_epoch=ROWS, keep_epochs=FILES + len(replays)), spark=spark)  # the replays' side outputs are read afterwards
    reference = DedupReference()
    for result, records in zip(runner.run_available(), logs, strict=True):
        check_epoch(runner, result, *reference.run(records))
    before = reference.current()
    same_rows(runner.read_state().to_pandas(), before, VALUES)
    storage = storage_for(tmp_path / "events")
    for i, table in enumerate(replays, start=FILES):
        write_events(storage, f"events-{i:06d}.parquet", table)
    results = runner.run_available()
    assert [r.epoch for r in results] == [FILES + 1, FILES + 2, FILES + 3]
    for result, records in zip(results, replays, strict=True):
        expected, dropped, late = reference.run(records)
        assert len(dropped) == ROWS and expected.empty  # the reference: nothing of a replay is kept
        check_epoch(runner, result, expected, dropped, late)
        assert (result.records_aggregated, result.records_out) == (0, 0)
    assert results[0].figures["duplicates"] > 0 and results[0].figures["dedup_late"] > 0  # file 3: some keys remembered, some past
    assert [(r.figures["duplicates"], r.figures["dedup_late"]) for r in results[1:]] == [(0, ROWS), (0, ROWS)]  # the first file: all late
    side = runner.duplicate_records(FILES + 3)
    assert side is not None and side.num_rows == ROWS and set(side.column("reason").to_pylist()) == {"late"}
    assert set(side.column("file").to_pylist()) == {f"events-{FILES + 2:06d}.parquet"}
    # the counts did not inflate: state and tables are those after the five files
    same_rows(runner.read_state().to_pandas(), before, VALUES)
    for table in runner.pipeline.sinks[1:]:
        same_rows(table.read().to_pandas(), before, VALUES)
    figures = [s.operator.figures for r in results for s in r.shards.values()]
    assert sum(f.get("dedup_keys_remembered", 0) for f in figures) == 0  # a late copy is never remembered


@pytest.mark.deep  # the default lane kills a deduplication mid state stage (below)
def test_a_kill_9_after_the_delta_commit_re_runs_the_epoch_dropping_the_same_records(spark, tmp_path):
    """Epoch 3's output (decided by its deduplication) is in Delta when the process dies;
    the retry probes the same snapshot with the same records: Iceberg gets the same
    rows, and every table ends equal to the reference."""
    logs = write_dedup_log(tmp_path / "events", 4)
    died = run_until_killed(tmp_path, "after_sink_delta", 3, kind="dedup", max_records=ROWS, hold=("iceberg",))
    assert died.returncode == -9, died.stderr[-3000:]
    runner = EpochRunner(dedup_pipeline(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables"), tmp_path / "state", RunSettings(max_records_per_epoch=ROWS), spark=spark)
    assert runner.committed_epoch() == 2
    delta, iceberg = runner.pipeline.sinks[1], runner.pipeline.sinks[2]
    assert (delta.committed_epoch("dedup"), iceberg.committed_epoch("dedup")) == (3, 2)
    in_delta = delta.read().to_pandas()
    results = runner.run_available()
    assert [r.epoch for r in results] == [3, 4]
    assert results[0].sinks["delta"].skipped and not results[0].sinks["iceberg"].skipped
    reference = DedupReference()
    for epoch, records in enumerate(logs, start=1):
        expected, dropped, late = reference.run(records)
        if epoch == 3:
            check_epoch(runner, results[0], expected, dropped, late)
            same_rows(in_delta, reference.current(), VALUES)  # what the killed attempt committed ...
            rerun = results[0].output.to_pandas()  # ... is what the re-run emitted
            same_rows(in_delta[in_delta[KEY].isin(rerun[KEY])], rerun, VALUES)
    check_epoch(runner, results[1], expected, dropped, late)
    for table in (delta, iceberg):
        same_rows(table.read().to_pandas(), reference.current(), VALUES)
        assert all(len(rows) == 1 for rows in table.epoch_history("dedup").values())


def test_remembered_string_keys_move_with_a_rescale_and_a_migration(spark, tmp_path):
    """String ids; 2 -> 3 shards after epoch 2, then after epoch 4 a migration (``total``
    renamed ``spent``) to 1 shard: copies of events remembered before are still dropped
    after, so the remembered ids moved unconverted beside the converted aggregate."""
    logs = write_dedup_log(tmp_path / "events", FILES)
    runner = EpochRunner(dedup_pipeline(tmp_path / "events", tmp_path / "out", string_ids=True,
                                        write_duplicates=False), tmp_path / "state", RunSettings(max_records_per_epoch=ROWS), spark=spark)
    results = [runner.run_next() for _ in range(2)]
    assert runner.rescale(3).new_shards == 3
    results += [runner.run_next() for _ in range(2)]
    renamed = (Pipeline("dedup").source(FileLog(tmp_path / "events", format="parquet"))
               .with_column(ID, f"concat('e-', {ID})")
               .deduplicate(on=ID, within="15 minutes", event_time="event_time")
               .key_by(KEY).aggregate(events=count(), spent=sum_("amount")).sink(ParquetSink(tmp_path / "out2"))
               .with_shards(1))
    runner.migrate(renamed, renames={"total": "spent"}, num_shards=1)
    runner = EpochRunner(renamed, tmp_path / "state", RunSettings(max_records_per_epoch=ROWS), spark=spark)
    results += runner.run_available()
    reference = DedupReference()
    for result, records in zip(results, logs, strict=True):
        expected, dropped, late = reference.run(records)
        output = result.output.rename_columns([c if c != "spent" else "total" for c in result.output.column_names])
        same_rows(output.to_pandas(), expected, VALUES)
        assert result.figures["duplicates"] == len(dropped) - len(late) > 0 and result.figures["dedup_late"] == len(late)
        assert result.duplicates_path is None
    assert [len(r.shards) for r in results] == [2, 2, 3, 3, 1]
    same_rows(runner.read_state().to_pandas().rename(columns={"spent": "total"}), reference.current(), VALUES)


@pytest.mark.parametrize("anti_join", ["broadcast", "shuffled"])
def test_a_window_after_a_deduplication_counts_each_event_once(spark, tmp_path, monkeypatch, anti_join):
    """Tumbling 10-minute windows over the kept records: late ones (past the window,
    on the pipeline's one watermark) go to the late output, never duplicates. The
    dropped records' positions are broadcast to the anti-join that leaves them out, or
    past ``BROADCAST_DROPPED_MAX`` the records are shuffled by position to meet them."""
    if anti_join == "shuffled":
        monkeypatch.setattr("volley_dagster.spark.dedup.BROADCAST_DROPPED_MAX", 0)
    logs = write_dedup_log(tmp_path / "events", FILES)
    pipeline = (Pipeline("dedup_windows").source(FileLog(tmp_path / "events", format="parquet"))
                .deduplicate(on=[ID], within="15 minutes", event_time="event_time")
                .key_by(KEY).window(tumbling("10 minutes"), on="event_time")
                .aggregate(events=count(), total=sum_("amount")).sink(ParquetSink(tmp_path / "out")).with_shards(2))
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=ROWS), spark=spark)
    results = runner.run_available()
    reference = DedupReference()
    on_time = []
    size = 600 * 1_000_000
    for result, records in zip(results, logs, strict=True):
        _, _, dropped_late = reference.run(records)
        assert result.figures["dedup_late"] == len(dropped_late)  # late for the deduplication: never a window's late record
        kept, before = reference.kept[-1], reference.watermarks[-1]
        start = kept["t"] // size * size
        late = (start + size <= before) if before is not None else pd.Series(False, index=kept.index)
        assert result.late_records == int(late.sum())
        on_time.append(kept[~late].assign(window_start=start[~late]))
        assert result.watermark == reference.watermark
    assert sum(r.late_records for r in results) > 0 and sum(r.figures["duplicates"] for r in results) > 0
    assert sum(r.figures["dedup_late"] for r in results) > 0
    fired = pa.concat_tables([r.output for r in results])
    fired = fired.set_column(fired.column_names.index("window_start"), "window_start",
                             fired.column("window_start").cast(pa.int64())).to_pandas()  # microseconds
    rows = pd.concat(on_time)
    final = reference.watermark
    expected = (rows[rows["window_start"] + size <= final].groupby([KEY, "window_start"])
                .agg(events=("amount", "size"), total=("amount", "sum")).reset_index())
    got = fired[[KEY, "window_start", "events", "total"]].sort_values([KEY, "window_start"]).reset_index(drop=True)
    want = expected.sort_values([KEY, "window_start"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, check_exact=False, rtol=1e-9)


def test_deduplication_settings_are_checked_and_recorded(spark, tmp_path):
    write_dedup_log(tmp_path / "events", 1)
    base = Pipeline("bad").source(FileLog(tmp_path / "events", format="parquet"))
    with pytest.raises(ConfigError, match="within"):
        base.deduplicate(on=ID, within="0 seconds", event_time="event_time")
    with pytest.raises(ConfigError, match="at least one column"):
        base.deduplicate(on=[], within="1 minute", event_time="event_time")
    with pytest.raises(ConfigError, match="names a column twice"):
        base.deduplicate(on=[ID, ID], within="1 minute", event_time="event_time")
    clash = (base.with_column("other_time", "event_time").deduplicate(on=ID, within="1 minute", event_time="other_time")
             .key_by(KEY).window(tumbling("1 minute"), on="event_time").aggregate(events=count()))
    with pytest.raises(ConfigError, match="one watermark"):
        clash.stateful_operator()
    missing = base.deduplicate(on="nope", within="1 minute", event_time="event_time").key_by(KEY).aggregate(n=count())
    with pytest.raises(ConfigError, match="no column 'nope'"):
        EpochRunner(missing.sink(ParquetSink(tmp_path / "o1")), tmp_path / "s1", spark=spark).run_available()
    # a null id is a bad record, named as such; with dead letters it is counted, never dropped silently
    nulls = (base.with_column(ID, f"CASE WHEN {ID} % 50 = 7 THEN NULL ELSE {ID} END")
             .deduplicate(on=ID, within="1 minute", event_time="event_time").key_by(KEY).aggregate(n=count())
             .sink(ParquetSink(tmp_path / "o2")))
    with pytest.raises(MalformedRecordError, match="null deduplication key"):
        EpochRunner(nulls, tmp_path / "s2", spark=spark).run_available()
    lettered = EpochRunner(nulls.on_bad_records("dead_letter"), tmp_path / "s3", spark=spark).run_available()[0]
    null_ids = sum(1 for i in dedup_file(0).column(ID).to_pylist() if i % 50 == 7)
    assert lettered.dead_letters == null_ids > 0
    assert lettered.durations["side_output"] > 0  # the probe counted them; a job of its own found which
    assert lettered.records_aggregated + lettered.figures["duplicates"] + null_ids == ROWS
    # the deduplication is part of the recorded layout: another one is refused, not silently mixed
    recorded = EpochRunner(nulls, tmp_path / "s3", spark=spark).log.identity()
    assert recorded["aggregate"]["dedup"] == {"on": [ID], "within_us": 60_000_000, "time_column": "event_time"}
    proposed = {**recorded, "aggregate": {**recorded["aggregate"], "dedup": {**recorded["aggregate"]["dedup"],
                                                                           "within_us": 1}}}
    with pytest.raises(StateLayoutError, match="deduplication changed"):
        plan_migration(recorded, proposed, {}, {})


def kept_records(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[[ID, KEY, "amount"]].sort_values([ID, "amount"]).reset_index(drop=True)


def last_kept(reference: DedupReference) -> pd.DataFrame:
    """What an upsert by event id holds: each id's latest kept record."""
    return kept_records(pd.concat(reference.kept).drop_duplicates(ID, keep="last"))


def test_a_pipeline_that_only_deduplicates_gives_its_sinks_the_kept_records(spark, tmp_path):
    """No aggregate: the records go to the shard of their id, which decides, remembers
    and emits them. Delta upserts by event id (an id kept again, reused with a later
    event time, replaces its row), Iceberg appends every kept record; the state is the
    remembered ids. Late copies are dropped here too, counted apart in the side output."""
    logs = write_dedup_log(tmp_path / "events", FILES)
    runner = EpochRunner(unique_pipeline(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables"), tmp_path / "state", RunSettings(max_records_per_epoch=ROWS, keep_epochs=FILES), spark=spark)  # every epoch's duplicates are read afterwards
    results = runner.run_available()
    reference = DedupReference()
    for result, records in zip(results, logs, strict=True):
        _, dropped, late = reference.run(records)
        got = result.output.to_pandas()
        assert list(got.columns) == [ID, KEY, "amount", "status", "event_time"]
        pd.testing.assert_frame_equal(kept_records(got), kept_records(reference.kept[-1]), check_dtype=False)
        assert result.records_out == len(got) == result.records_aggregated == ROWS - len(dropped)
        check_side_output(runner, result, dropped, late)
    assert sum(r.figures["dedup_late"] for r in results) > 0
    delta, iceberg = runner.pipeline.sinks[1], runner.pipeline.sinks[2]
    pd.testing.assert_frame_equal(kept_records(delta.read().to_pandas()), last_kept(reference), check_dtype=False)
    pd.testing.assert_frame_equal(kept_records(iceberg.read().to_pandas()),
                                  kept_records(pd.concat(reference.kept)), check_dtype=False)
    state = runner.read_state().to_pandas()
    assert sorted(state[ID]) == sorted(reference.remembered)
    assert list(state.columns[-2:]) == ["event_time", "remembered_until"]
    rng = runner.cut_next(allow_empty=True)  # an epoch without records: the same columns, none of the flags
    assert rng is not None and runner.run(rng.epoch).output.column_names == [ID, KEY, "amount", "status", "event_time"]


def test_a_key_over_several_columns_tells_microseconds_apart(spark, tmp_path, capsys):
    """``on=[id, event_time]``: the same id 1 µs apart is two events (Spark's default
    JSON timestamp format would cut both to the millisecond, one key)."""
    t = pd.Timestamp("2026-01-01 00:00:00.000001", tz="UTC")
    rows = [(1, t), (1, t + pd.Timedelta(microseconds=1)), (1, t), (2, t), (2, t)]
    (tmp_path / "events").mkdir()
    pq.write_table(pa.table({ID: [r[0] for r in rows], KEY: [7] * 5, "amount": [1.0] * 5, "status": ["ok"] * 5,
                             "event_time": pa.array([r[1] for r in rows], pa.timestamp("us", tz="UTC"))}),
                   tmp_path / "events" / "events-000000.parquet")
    pipeline = (Pipeline("pairs").source(FileLog(tmp_path / "events", format="parquet"))
                .deduplicate(on=[ID, "event_time"], within="1 hour", event_time="event_time")
                .sink(ParquetSink(tmp_path / "out")))
    result = EpochRunner(pipeline, tmp_path / "state", spark=spark).run_available()[0]
    assert result.figures["duplicates"] == 2 and result.records_out == 3
    keys = EpochRunner(pipeline, tmp_path / "state", spark=spark).read_state().column("dedup_key").to_pylist()
    assert sorted(keys) == [f'{{"{ID}":1,"event_time":"2026-01-01T00:00:00.000001Z"}}',
                            f'{{"{ID}":1,"event_time":"2026-01-01T00:00:00.000002Z"}}',
                            f'{{"{ID}":2,"event_time":"2026-01-01T00:00:00.000001Z"}}']
    # review F12a: the state commands key such a root by its dedup key, not the first `on` column
    root = str(tmp_path / "state")
    assert volley(["state", "show", root, "--key", keys[0], "--verify-checksums"]) == 0
    shown = capsys.readouterr().out
    assert "state at epoch 1 (1 rows)" in shown and keys[0] in shown


def test_a_kill_9_mid_state_stage_of_a_pipeline_that_only_deduplicates(spark, tmp_path):
    """Killed once shard 1 of epoch 2 has snapshotted (its ids remembered) and before
    the epoch commits: the retry starts again from epoch 1's snapshots, so it keeps
    and drops exactly what the reference does."""
    logs = write_dedup_log(tmp_path / "events", 3)
    died = run_until_killed(tmp_path, "shard_after_snapshot", 2, shard=1, kind="unique", max_records=ROWS)
    assert died.returncode == -9, died.stderr[-3000:]
    runner = EpochRunner(unique_pipeline(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables"), tmp_path / "state", RunSettings(max_records_per_epoch=ROWS), spark=spark)
    delta, iceberg = runner.pipeline.sinks[1], runner.pipeline.sinks[2]
    assert runner.committed_epoch() == 1
    assert (delta.committed_epoch("unique"), iceberg.committed_epoch("unique")) == (1, 1)
    assert [r.epoch for r in runner.run_available()] == [2, 3]
    reference = DedupReference()
    for records in logs:
        reference.run(records)
    pd.testing.assert_frame_equal(kept_records(delta.read().to_pandas()), last_kept(reference), check_dtype=False)
    pd.testing.assert_frame_equal(kept_records(iceberg.read().to_pandas()),
                                  kept_records(pd.concat(reference.kept)), check_dtype=False)
    for table in (delta, iceberg):
        assert all(len(rows) == 1 for rows in table.epoch_history("unique").values())


def test_one_record_stamped_2099_is_refused_and_later_re_sends_stay_duplicates(spark, tmp_path):
    """Issue 31 (F3): a dedup-only pipeline (``within="60 minutes"``) reads 100 records,
    then one stamped 2099, then the same 100 ids again three minutes later. Without a
    skew guard the 2099 record moved the watermark past every deadline and all 100
    re-sends were kept (201 rows); with ``max_event_time_skew`` it is a dead letter and
    the re-sends are duplicates: 100 rows."""
    from volley_dagster.demo.events import EVENT_SCHEMA

    events = tmp_path / "events"
    events.mkdir()
    now_us = int(pd.Timestamp.now(tz="UTC").value // 1000)
    t0 = now_us - 3_600_000_000

    def batch(i: int, ids: list[int], at: list[int]) -> None:
        pq.write_table(pa.table({
            ID: pa.array(ids, pa.int64()), KEY: pa.array([n % 7 for n in ids], pa.int64()),
            "amount": pa.array([1.0] * len(ids)), "status": pa.array(["active"] * len(ids)),
            "event_time": pa.array(at, pa.int64()).cast(pa.timestamp("us", tz="UTC"))}, schema=EVENT_SCHEMA),
            events / f"events-{i:06d}.parquet")

    pipeline = (Pipeline("resends").source(FileLog(events, format="parquet"))
                .deduplicate(on=ID, within="60 minutes", event_time="event_time", max_event_time_skew="1 hour")
                .sink(ParquetSink(tmp_path / "out")).on_bad_records("dead_letter"))
    runner = EpochRunner(pipeline, tmp_path / "state", spark=spark)
    results = []
    for i, (ids, at) in enumerate([(list(range(100)), [t0 + i * 1_000_000 for i in range(100)]),
                                   ([1000], [int(pd.Timestamp("2099-01-01", tz="UTC").value // 1000)]),
                                   (list(range(100)), [t0 + 180_000_000 + i * 1_000_000 for i in range(100)])]):
        batch(i, ids, at)
        results.append(runner.run_next())
    assert [r.records_out for r in results] == [100, 0, 0]
    assert [r.dead_letters for r in results] == [0, 1, 0]
    assert [r.figures["duplicates"] for r in results] == [0, 0, 100]
    assert pq.read_table(tmp_path / "out").num_rows == 100
    with pytest.raises(ConfigError, match=r"max_event_time_skew=\.\.\.\) differs from the window's"):
        (Pipeline("two_clocks").source(FileLog(events, format="parquet"))
         .deduplicate(on=ID, within="60 minutes", event_time="event_time", max_event_time_skew="1 hour")
         .key_by(KEY).window(tumbling("1 minute"), on="event_time", max_event_time_skew="2 hours")
         .aggregate(n=count()).stateful_operator())


def test_the_probe_in_the_state_stage_decides_as_the_probe_job_over_a_json_log_with_bad_records(spark, tmp_path):
    """The same JSON log (read by the Python reader, so its parse errors are found after
    the state stage's job) through the probe's two ways: with the duplicates written out
    (a probe job of its own) and without (the probe in the state stage's job, the shard
    tasks forgetting by the latest event time the probes told them). Each epoch's output,
    figures, dead letters, watermark and keys remembered, and the state at the end, are
    the same; the probe in the stage hands on only the columns the aggregate reads
    (``first`` and ``last`` read the log position too)."""
    from volley_dagster.demo.events import EVENT_SCHEMA

    log = tmp_path / "log"
    log.mkdir()
    for i in range(FILES):
        lines = [json.dumps({**row, "event_time": row["event_time"].isoformat()})
                 for row in dedup_file(i).to_pylist()]
        if i == 2:  # an unparseable line and a record without an id: dead letters, whichever way it runs
            lines[7:7] = ["{not json", json.dumps({ID: None, KEY: 1, "amount": 1.0, "status": "active",
                                                   "event_time": "2026-01-01T00:00:00+00:00"})]
        (log / f"events-{i:06d}.jsonl").write_text("".join(line + "\n" for line in lines))

    def run(write_duplicates: bool) -> tuple[EpochRunner, list]:
        pipeline = (Pipeline("dedup_json").source(FileLog(log, format="json", schema=EVENT_SCHEMA))
                    .deduplicate(on=ID, within="15 minutes", event_time="event_time", write_duplicates=write_duplicates)
                    .key_by(KEY).aggregate(events=count(), total=sum_("amount"), opening=first("amount"),
                                           closing=last("amount"), top=max_("amount"), ids=count(ID))
                    .sink(ParquetSink(tmp_path / f"out-{write_duplicates}")).on_bad_records("dead_letter").with_shards(2))
        runner = EpochRunner(pipeline, tmp_path / f"state-{write_duplicates}",
                             RunSettings(max_records_per_epoch=ROWS), spark=spark)
        return runner, runner.run_available()

    (job, by_job), (here, in_stage) = run(True), run(False)
    assert [r.epoch for r in in_stage] == [r.epoch for r in by_job] and len(in_stage) >= FILES
    assert all(r.durations["pre_step"] > 0 for r in by_job if r.records_in)
    assert all(r.durations["pre_step"] == 0 for r in in_stage)
    for a, b in zip(by_job, in_stage, strict=True):
        same_rows(b.output.to_pandas(), a.output.to_pandas(), EVERY_VALUE)
        assert {k: b.figures[k] for k in ("duplicates", "dedup_late")} == {k: a.figures[k] for k in ("duplicates", "dedup_late")}
        assert (b.dead_letters, b.watermark) == (a.dead_letters, a.watermark), f"epoch {b.epoch}"
    assert sum(r.dead_letters for r in in_stage) == 2
    assert sum(r.figures["duplicates"] for r in in_stage) > 0 and sum(r.figures["dedup_late"] for r in in_stage) > 0
    same_rows(here.read_state().to_pandas(), job.read_state().to_pandas(), EVERY_VALUE)
    remembered = [sum(s.operator.figures.get("dedup_keys_remembered", 0) for s in r.shards.values()) for r in in_stage]
    assert remembered == [sum(s.operator.figures.get("dedup_keys_remembered", 0) for s in r.shards.values())
                          for r in by_job]


def test_the_probe_in_the_state_stage_passes_on_only_what_the_aggregate_reads(spark):
    """Spark cannot prune columns through the probe's Python task: the columns no step
    after it reads are dropped before its exchange (a status string, the event time, the
    id), and a ``first`` brings the log position along."""
    from volley_dagster.operators.aggregate import Aggregate
    from volley_dagster.operators.dedup import Deduplication
    from volley_dagster.operators.event_time import EventTime
    from volley_dagster.operators.ttl import StateTtl
    from volley_dagster.spark.dedup import DuplicateProbe, probe_in_stage
    from volley_dagster.state.keys import ShardLayout
    from volley_dagster.state.options import RocksDBOptions

    rows = spark.createDataFrame(dedup_file(0).to_pandas()).select(
        "*", F.monotonically_increasing_id().alias(columns.POS), F.col(KEY).cast("long").alias(columns.KEY),
        F.col(ID).alias(columns.DEDUP_KEY))
    dedup = Deduplication((ID,), 60_000_000, EventTime("event_time"))
    probe = DuplicateProbe(dedup, None, {}, RocksDBOptions(), False)
    layout = ShardLayout(2)
    kept = [columns.SHARD, columns.KEY_GROUP, columns.DEDUP_RUN]
    for accumulators, passed in ((dict(n=count(), total=sum_("amount")), [columns.KEY, "amount"]),
                                 (dict(opening=first("amount"), ids=count(ID)), [ID, columns.POS, columns.KEY, "amount"])):
        operator = Aggregate(tuple(accumulators.items())).resolve(rows.schema)
        out = probe_in_stage(rows, dedup, layout, probe, operator.input_columns())
        assert sorted(out.columns) == sorted(passed + kept)
    timed = Aggregate((("n", count()),), ttl=StateTtl(duration_us=60_000_000, event_time=EventTime("event_time")))
    assert timed.resolve(rows.schema).input_columns() == (columns.KEY, "event_time")  # what its TTL's partial reads
    assert sorted(probe_in_stage(rows, dedup, layout, probe, None).columns) == sorted(
        [c for c in rows.columns if c != columns.DEDUP_KEY] + kept)


def test_rows_of_one_record_are_decided_by_their_own_keys(spark, tmp_path):
    """Review J1 for deduplication: a transform explodes each order into its two items,
    deduplicated by item id. An item repeated by a later order is dropped alone: the
    order's other item is kept (the anti-join took both, by position); a record's two
    rows with one key are one event's parts, kept together; an aggregate's ``first`` and
    ``last`` over rows of one record break the tie the same way on every run."""
    from datetime import datetime, timezone

    events = tmp_path / "orders"
    events.mkdir()
    at = int(datetime(2026, 1, 1, tzinfo=timezone.utc).timestamp() * 1_000_000)

    def orders(index: int, rows: list[tuple[int, int, int]]) -> None:  # (order, first item, second item)
        pq.write_table(pa.table({
            "order_id": pa.array([o for o, _, _ in rows], pa.int64()),
            "items": pa.array([[a, b] for _, a, b in rows], pa.list_(pa.int64())),
            "at": pa.array([at + i * 1_000_000 for i in range(len(rows))], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        }), events / f"orders-{index:06d}.parquet")

    orders(0, [(1, 10, 11), (2, 20, 21), (3, 30, 30)])
    orders(1, [(4, 11, 40), (5, 50, 51)])  # item 11 repeats order 1's
    pipeline = (Pipeline("items").source(FileLog(events))
                .transform(lambda df: df.withColumn("item", F.explode("items")).drop("items"))
                .deduplicate(on="item", within="1 day", event_time="at")
                .sink(ParquetSink(tmp_path / "out")))
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=3), spark=spark)
    first_epoch, second = runner.run_available()
    assert sorted(first_epoch.output.column("item").to_pylist()) == [10, 11, 20, 21, 30, 30]
    assert sorted(second.output.column("item").to_pylist()) == [40, 50, 51]
    assert second.figures["duplicates"] == 1

    def totals(i: int) -> Pipeline:
        return (Pipeline("firsts").source(FileLog(events))
                .transform(lambda df: df.withColumn("item", F.explode("items")).drop("items"))
                .with_column("one", "1").key_by("one").aggregate(opening=first("item"), closing=last("item"))
                .sink(ParquetSink(tmp_path / f"firsts-{i}")))

    runs = [EpochRunner(totals(i), tmp_path / f"firsts-state-{i}", spark=spark).run_next() for i in range(2)]
    assert [(r.output.column("opening")[0].as_py(), r.output.column("closing")[0].as_py()) for r in runs] == \
        [(10, 51)] * 2
