"""State TTL on real Spark, RocksDB, Delta and Iceberg, against the reference in
``tests/ttl_reference.py``: keys that expire, a key refreshed in the very epoch that
would expire it, a key that comes back after expiring (from empty); on epochs and on
event time; upsert tables lose expired rows in the epoch's own commit, the append
changelog keeps an ``expired`` row; a ``kill -9`` between the sinks of an expiring
epoch, a rescale, resident state and an expiry index evicted to RocksDB."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest

from tests.engine.test_crash_recovery import run_until_killed
from tests.ttl_reference import (
    KEY,
    REFRESHED,
    RETURNING,
    STEADY,
    TtlReference,
    same_rows,
    ttl_pipeline,
    write_ttl_log,
)
from volley_dagster import ConfigError, EpochRunner, FileLog, ParquetSink, Pipeline, count, sum_, tumbling
from volley_dagster.checkpoint.state_reader import recorded_reader, shards_to_read
from volley_dagster.errors import StateLayoutError
from volley_dagster.settings import RunSettings

FILES = 6
VALUES = [KEY, "events", "total", "expired"]


def run_all(runner: EpochRunner, empty_epochs: int = 0) -> list:
    results = runner.run_available()
    for _ in range(empty_epochs):  # epochs without records: keys still expire by epochs
        rng = runner.cut_next(allow_empty=True)
        assert rng is not None and rng.records == 0
        results.append(runner.run(rng.epoch))
    return results


def check_against_reference(runner: EpochRunner, results: list, reference: TtlReference,
                            logs: list[pa.Table | None]) -> None:
    expired_keys = 0
    for result, records in zip(results, logs, strict=True):
        expected = reference.run(records)
        same_rows(result.output.to_pandas(), expected, VALUES)
        assert result.figures["keys_expired"] == int(expected["expired"].sum())
        expired_keys += result.figures["keys_expired"]
    assert expired_keys > 0
    same_rows(runner.read_state().to_pandas(), reference.current(), [KEY, "events", "total"])


def test_keys_expire_by_epochs_as_the_reference_and_upsert_tables_lose_them(spark, tmp_path):
    logs = write_ttl_log(tmp_path / "events", FILES)
    pipeline = ttl_pipeline(tmp_path / "events", tmp_path / "out", ttl_epochs=2, tables=tmp_path / "tables")
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=logs[0].num_rows), spark=spark)
    results = runner.run_available()
    after_records = TtlReference(ttl_epochs=2)
    for records in logs:
        after_records.run(records)
    delta, iceberg = runner.pipeline.sinks[1], runner.pipeline.sinks[2]
    for table in (delta, iceberg):  # upsert tables hold exactly the live state
        same_rows(table.read().to_pandas(), after_records.current(), [KEY, "events", "total"])
        assert "expired" not in table.read().column_names
    results += run_all(runner, empty_epochs=3)
    assert [r.records_in for r in results] == [t.num_rows for t in logs] + [0, 0, 0]
    reference = TtlReference(ttl_epochs=2)
    check_against_reference(runner, results, reference, logs + [None, None, None])
    # epochs without records: 7 and 8 expire what epochs 5 and 6 touched last; by 9 nothing
    # is left to expire, so its shards carry their snapshots forward without a Spark job
    modes = [{s.read_mode for s in r.shards.values()} for r in results[-3:]]
    assert [r.figures["keys_expired"] > 0 for r in results[-3:]] == [True, True, False]
    assert "carried_forward" not in modes[0] | modes[1] and modes[2] == {"carried_forward"}
    assert runner.read_state().num_rows == 0
    stories = {k: [bool(r.output.to_pandas().set_index(KEY)["expired"].get(k, False)) for r in results]
               for k in (REFRESHED, RETURNING, STEADY)}
    assert stories[REFRESHED][:3] == [False, False, False]  # touched in epoch 3, the epoch that would expire it
    assert stories[RETURNING][2] is True  # expired in epoch 3 ...
    returned = results[3].output.to_pandas().set_index(KEY).loc[RETURNING]
    assert (returned["events"], returned["expired"]) == (3, False)  # ... and back in epoch 4 from empty
    assert stories[STEADY] == [False] * (FILES + 1) + [True, False]  # in every file: expires once they end
    # after the last keys expired the upsert tables are empty; each epoch one commit
    for table in (delta, iceberg):
        assert table.read().num_rows == 0 == len(reference.current())
        assert table.epoch_history("ttl") == {r.epoch: [r.records_out] for r in results}
    assert results[-2].sinks["delta"].counts["deleted"] > 0 and results[-2].sinks["iceberg"].counts["expired"] > 0
    # the append changelog keeps every row, the expiry rows too
    changelog = pd.concat([r.output.to_pandas() for r in results])
    written = runner.pipeline.sinks[0]
    assert sum(c.rows for c in written.commits("ttl")) == len(changelog)
    assert int(changelog["expired"].sum()) == sum(r.figures["keys_expired"] for r in results)


def test_keys_expire_on_event_time_with_the_expiry_index_evicted_to_rocksdb(spark, tmp_path):
    """An in-memory index of 5 entries a shard: nearly every entry is evicted, and found
    again by the range scan of its deadline. Int keys read resident state. An epoch
    without records in the middle keeps the watermark (and expires nothing new)."""
    logs = write_ttl_log(tmp_path / "events", 3)
    pipeline = ttl_pipeline(tmp_path / "events", tmp_path / "out", ttl="15 minutes", tables=tmp_path / "tables",
                            max_expiry_entries=5, iceberg_mode="append")
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=logs[0].num_rows), spark=spark)
    results = run_all(runner, empty_epochs=1)
    logs += [None] + write_ttl_log(tmp_path / "events", FILES - 3, first_file=3)
    results += run_all(runner)
    reference = TtlReference(ttl_us=15 * 60 * 1_000_000)
    check_against_reference(runner, results, reference, logs)
    latest = [None if t is None else max(t.column("event_time").cast(pa.int64()).to_pylist()) for t in logs]
    assert [r.watermark for r in results] == [max(w for w in latest[: i + 1] if w is not None) for i in range(len(logs))]
    assert results[3].figures["keys_expired"] == 0 and results[3].watermark == results[2].watermark
    shards = [s for r in results for s in r.shards.values()]
    assert max(s.operator.figures.get("expiry_evicted", 0) for s in shards) > 0
    assert max(s.operator.figures.get("expiry_resident", 0) for s in shards) <= 5
    assert {s.read_mode for r in results[1:] for s in r.shards.values()} - {"carried_forward"} == {"resident"}
    same_rows(runner.pipeline.sinks[1].read().to_pandas(), reference.current(), [KEY, "events", "total"])
    appended = runner.pipeline.sinks[2].read().to_pandas()  # Iceberg, append: the changelog
    assert int(appended["expired"].sum()) == sum(r.figures["keys_expired"] for r in results) > 0


def test_a_kill_9_between_the_sinks_of_an_expiring_epoch_commits_it_once(spark, tmp_path):
    """Killed with epoch 3's Delta commit (its deletes included) landed and Iceberg's not:
    the resume leaves each table one commit per epoch and exactly the live state."""
    logs = write_ttl_log(tmp_path / "events", 5)
    died = run_until_killed(tmp_path, "after_sink_delta", 3, kind="ttl", max_records=logs[0].num_rows,
                            hold=("iceberg",))
    assert died.returncode == -9, died.stderr[-3000:]
    runner = EpochRunner(ttl_pipeline(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables"), tmp_path / "state", RunSettings(max_records_per_epoch=logs[0].num_rows), spark=spark)
    assert runner.committed_epoch() == 2
    delta, iceberg = runner.pipeline.sinks[1], runner.pipeline.sinks[2]
    assert (delta.committed_epoch("ttl"), iceberg.committed_epoch("ttl")) == (3, 2)
    results = runner.run_available()
    assert [r.epoch for r in results] == [3, 4, 5]
    assert results[0].sinks["delta"].skipped and not results[0].sinks["iceberg"].skipped
    reference = TtlReference(ttl_epochs=2)
    for epoch, records in enumerate(logs, start=1):
        expected = reference.run(records)
        if epoch >= 3:
            same_rows(results[epoch - 3].output.to_pandas(), expected, VALUES)
    assert results[0].figures["keys_expired"] > 0
    for table in (delta, iceberg):
        same_rows(table.read().to_pandas(), reference.current(), [KEY, "events", "total"])
        assert table.epoch_history("ttl").keys() == set(range(1, 6))
        assert all(len(rows) == 1 for rows in table.epoch_history("ttl").values())


def test_a_rescale_carries_the_expiry_index_to_the_new_shards(spark, tmp_path):
    """With string keys, 2 -> 5 -> 3 shards: the expiry index moves with the keys, and
    the string keys' resident state (expired keys removed from it) is used within a
    layout, never across a rescale."""
    logs = write_ttl_log(tmp_path / "events", FILES)
    runner = EpochRunner(ttl_pipeline(tmp_path / "events", tmp_path / "out", shards=2, max_expiry_entries=3,
                                      string_keys=True), tmp_path / "state", RunSettings(max_records_per_epoch=logs[0].num_rows), spark=spark)
    logs = [t.set_column(1, KEY, pa.array([f"m-{k}" for k in t.column(KEY).to_pylist()])) for t in logs]
    reference = TtlReference(ttl_epochs=2)
    results = [runner.run_next() for _ in range(2)]
    assert runner.rescale(5).new_shards == 5
    results += [runner.run_next() for _ in range(2)]
    # one index entry per live key, none due yet, in the 5 new shards
    reader = recorded_reader(runner.log, 4)  # on the driver, as read_state
    pending = pa.concat_tables([t for shard in shards_to_read(runner.log, 4, None)
                                for t in reader.read(shard, "pending")]).to_pandas()
    assert sorted(pending[KEY]) == sorted(runner.read_state().column(KEY).to_pylist())
    assert (pending["expires_in_epoch"] > 4).all() and pending["evicted"].any()
    assert runner.rescale(3).new_shards == 3
    results += run_all(runner, empty_epochs=2)
    check_against_reference(runner, results, reference, logs + [None, None])
    assert len(results[-1].shards) == 3
    modes = [{s.read_mode for s in r.shards.values()} for r in results]
    assert modes[1] == {"resident"}  # epoch 2, with epoch 1's mirror
    assert "resident" not in modes[2] | modes[4]  # the first epoch of each new layout reads RocksDB


def test_ttl_settings_are_checked_and_recorded(spark, tmp_path):
    write_ttl_log(tmp_path / "events", 1)
    base = Pipeline("bad").source(FileLog(tmp_path / "events", format="parquet")).key_by(KEY)
    with pytest.raises(ConfigError, match="either ttl="):
        base.aggregate(events=count(), ttl="1 hour", ttl_epochs=3, event_time="event_time")
    with pytest.raises(ConfigError, match="event_time="):
        base.aggregate(events=count(), ttl="1 hour")
    with pytest.raises(ConfigError, match="give ttl= with it"):
        base.aggregate(events=count(), ttl_epochs=3, event_time="event_time")
    with pytest.raises(ConfigError, match="at least 1"):
        base.aggregate(events=count(), ttl_epochs=0)
    with pytest.raises(ConfigError, match="reserved"):
        base.aggregate(expired=count(), ttl_epochs=3)
    windowed = base.window(tumbling("1 minute"), on="event_time").aggregate(events=count(), ttl_epochs=3)
    with pytest.raises(ConfigError, match="running aggregates"):
        windowed.stateful_operator()
    missing = base.aggregate(events=count(), ttl="1 hour", event_time="when")
    with pytest.raises(ConfigError, match="no such column"):
        EpochRunner(missing, tmp_path / "s1", spark=spark).run_available()
    # a root written without a TTL refuses a pipeline with one: the state records lack the stamp
    EpochRunner(base.aggregate(events=count()), tmp_path / "s2", spark=spark).run_available()
    write_ttl_log(tmp_path / "events", 1, first_file=1)
    with pytest.raises(StateLayoutError):
        EpochRunner(base.aggregate(events=count(), ttl_epochs=3), tmp_path / "s2", spark=spark).run_available()


def test_a_migration_keeps_each_keys_expiry_and_refuses_another_ttl(spark, tmp_path):
    """``total`` renamed to ``spent`` and 3 -> 4 shards after epoch 2: every key expires
    when it would have (its stamp and index entry carried over). Another TTL is refused."""
    logs = write_ttl_log(tmp_path / "events", FILES)
    runner = EpochRunner(ttl_pipeline(tmp_path / "events", tmp_path / "out", shards=3), tmp_path / "state", RunSettings(max_records_per_epoch=logs[0].num_rows), spark=spark)
    results = runner.run_available(max_epochs=2)
    other = ttl_pipeline(tmp_path / "events", tmp_path / "out", ttl_epochs=5)
    with pytest.raises(StateLayoutError, match="the state TTL changed"):
        runner.migrate(other)
    renamed = Pipeline("ttl").source(FileLog(tmp_path / "events", format="parquet")).key_by(KEY).aggregate(
        events=count(), spent=sum_("amount"), ttl_epochs=2).sink(ParquetSink(tmp_path / "out2"))
    runner.migrate(renamed, renames={"total": "spent"}, num_shards=4)
    runner = EpochRunner(renamed, tmp_path / "state", RunSettings(max_records_per_epoch=logs[0].num_rows), spark=spark)
    results += run_all(runner, empty_epochs=2)
    for result in results:
        result.output = result.output.rename_columns([c if c != "spent" else "total" for c in result.output.column_names])
    reference = TtlReference(ttl_epochs=2)
    for result, records in zip(results, logs + [None, None], strict=True):
        same_rows(result.output.to_pandas(), reference.run(records), VALUES)
    state = runner.read_state().to_pandas().rename(columns={"spent": "total"})
    same_rows(state, reference.current(), [KEY, "events", "total"])
    assert len(results[-1].shards) == 4 and sum(r.figures["keys_expired"] for r in results[2:]) > 0
