"""Evolving a pipeline at an epoch boundary on real Spark and RocksDB: accumulators
added (with their declared initial values), removed and renamed, and the shard count
changed, in one migration, against a reference; a window's allowed lateness lowered (raising it is refused)
and a window accumulator renamed; the refusals and their options; ``volley migrate``
killed with ``kill -9`` at each point leaves the old layout or the new, whole."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pandas as pd
import pytest

from tests.engine.test_crash_recovery import run_until_killed
from tests.engine.test_rescale import volley
from tests.helpers import log_records, payments, with_tables
from tests.window_reference import window_pipeline
from volley_dagster import (
    EpochOrderError,
    EpochRunner,
    FileLog,
    ParquetSink,
    Pipeline,
    StateLayoutError,
    count,
    last,
    max_,
    mean,
    sum_,
    tumbling,
)
from volley_dagster.demo.events import generate
from volley_dagster.settings import RunSettings
from volley_dagster.state.keys import ShardLayout

PER_FILE, KEYS = 1_500, 300


def evolved(base: Path, shards: int = 3, tables: Path | None = None, delta_mode: str = "upsert",
            iceberg_mode: str = "append") -> Pipeline:
    """``payments`` after the change: ``events`` renamed ``n_events``; ``smallest`` and
    ``first_event`` removed; ``spent_since`` (sum, from 0), ``seen_since`` (count) and
    ``latest_event`` (last, from null) added. Loaded by ``volley migrate --to``."""
    pipeline = (
        Pipeline("payments")
        .source(FileLog(base / "events", format="parquet"))
        .where("status = 'active'")
        .key_by("merchant_id")
        .aggregate(total=sum_("amount"), n_events=count(), avg_amount=mean("amount"), largest=max_("amount"),
                   last_seen=last("event_time"), spent_since=sum_("amount"), seen_since=count(),
                   latest_event=last("event_id"))
        .sink(ParquetSink(base / "out"))
        .with_shards(shards)
    )
    return with_tables(pipeline, tables, delta_mode=delta_mode, iceberg_table="volley.payments",
                       iceberg_mode=iceberg_mode)


def evolved_from_env() -> Pipeline:
    return evolved(Path(os.environ["VOLLEY_TEST_BASE"]))


def expected_after(files_before: int, files_after: int) -> pd.DataFrame:
    """The evolved pipeline's state: carried columns over every record, added ones over
    the records after the migration only (keys seen before start from 0, 0 and null)."""
    everything = log_records(files_before + files_after, PER_FILE, KEYS).to_pandas()
    since = everything.iloc[files_before * PER_FILE:]
    everything, since = everything[everything["status"] == "active"], since[since["status"] == "active"]
    g, s = everything.groupby("merchant_id"), since.groupby("merchant_id")
    out = pd.DataFrame({"total": g["amount"].sum(), "n_events": g["amount"].size(), "avg_amount": g["amount"].mean(),
                        "largest": g["amount"].max(), "last_seen": g["event_time"].last()})
    added = pd.DataFrame({"spent_since": s["amount"].sum(), "seen_since": s["amount"].size(),
                          "latest_event": s["event_id"].last()})
    out = out.join(added, how="left")
    out["spent_since"] = out["spent_since"].fillna(0.0)
    out["seen_since"] = out["seen_since"].fillna(0).astype("int64")
    return out.reset_index()


def assert_frame(actual, expected: pd.DataFrame) -> None:
    got = actual.to_pandas().sort_values("merchant_id").reset_index(drop=True)
    assert list(got.columns) == list(expected.columns)
    pd.testing.assert_frame_equal(got, expected.sort_values("merchant_id").reset_index(drop=True),
                                  check_dtype=False, check_exact=False, rtol=1e-9)


def test_added_removed_and_renamed_accumulators_and_a_new_shard_count_equal_the_reference(spark, tmp_path):
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    tables = tmp_path / "tables"
    old = payments(tmp_path / "events", tmp_path / "out", shards=3, tables=tables)
    runner = EpochRunner(old, tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    runner.run_available()
    before = runner.read_state()

    result = runner.migrate(evolved(tmp_path, tables=tables), renames={"events": "n_events"},
                            initial={"spent_since": 0}, num_shards=5)
    assert not result.noop and result.rewrite.epoch == 2 and result.rewrite.from_epoch == 3
    assert set(result.changes) == {"'events' renamed to 'n_events'", "'smallest' removed", "'first_event' removed",
                                   "'spent_since' added (existing keys start from 0)",
                                   "'seen_since' added (existing keys start from null)",
                                   "'latest_event' added (existing keys start from null)"}
    assert runner.layout() == ShardLayout(5)
    assert_frame(runner.read_state(), expected_after(2, 0))  # epoch 2's state, rewritten
    assert runner.read_state(1).column_names == before.column_names  # the epoch before reads as it was written

    generate(tmp_path / "events", 1, PER_FILE, KEYS, first_file=2)
    (third,) = runner.run_available()
    assert third.epoch == 3 and len(third.shards) == 5
    expected = expected_after(2, 1)
    assert_frame(runner.read_state(), expected)
    # the tables gained the added columns in a schema change before epoch 3's rows; the
    # upsert table lost the retired ones (the append table keeps them: see the next test)
    delta, iceberg = runner.pipeline.sinks[1:]
    upserted = delta.read().to_pandas()
    assert set(upserted.columns) == set(expected.columns)
    assert delta.epoch_history("payments") == {e: [runner.result(e).records_out] for e in (1, 2, 3)}
    by_key = upserted.set_index("merchant_id").sort_index()  # every row kept through the rewrite
    carried = ["total", "avg_amount", "largest", "last_seen"]
    pd.testing.assert_frame_equal(by_key[carried], expected.set_index("merchant_id").sort_index()[carried],
                                  check_dtype=False, rtol=1e-9)
    touched = upserted[upserted["seen_since"].notna()].set_index("merchant_id")
    assert len(touched) == third.records_out
    want = expected.set_index("merchant_id").loc[touched.index]
    pd.testing.assert_series_equal(touched["spent_since"], want["spent_since"], check_dtype=False, check_names=False)
    appended = iceberg.read().to_pandas()  # every epoch's rows: the new column from epoch 3's on
    assert appended["n_events"].notna().sum() == third.records_out
    assert appended["n_events"].isna().sum() == runner.result(1).records_out + runner.result(2).records_out
    # a runner built on the evolved pipeline, as the next run would build it, goes on
    generate(tmp_path / "events", 1, PER_FILE, KEYS, first_file=3)
    with pytest.raises(StateLayoutError, match="written by a different pipeline layout.*volley migrate"):
        EpochRunner(old, tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark).run_next()  # no longer fits
    again = EpochRunner(evolved(tmp_path, shards=3, tables=tables), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    assert [r.epoch for r in again.run_available()] == [4]
    assert_frame(again.read_state(), expected_after(2, 2))
    changes = again.state_tables().changes(2, 3).toPandas()  # across nothing: both after the migration
    assert set(changes["change"]) <= {"added", "changed"} and len(changes) > 0


def test_an_upsert_table_drops_the_retired_columns_and_an_append_table_keeps_them(spark, tmp_path):
    """Delta appends and Iceberg upserts here (the modes the test above swaps): the
    Iceberg table loses ``events``, ``smallest`` and ``first_event`` in a schema change
    and holds the state; the Delta table keeps them, null in the rows after."""
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    tables = tmp_path / "tables"
    old = with_tables(payments(tmp_path / "events", tmp_path / "out", shards=3), tables, delta_mode="append",
                      iceberg_table="volley.payments", iceberg_mode="upsert")
    runner = EpochRunner(old, tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    first_two = sum(r.records_out for r in runner.run_available())
    runner.migrate(evolved(tmp_path, tables=tables, delta_mode="append", iceberg_mode="upsert"),
                   renames={"events": "n_events"}, initial={"spent_since": 0})
    generate(tmp_path / "events", 1, PER_FILE, KEYS, first_file=2)
    (third,) = runner.run_available()
    delta, iceberg = runner.pipeline.sinks[1:]

    upserted = iceberg.read().to_pandas().set_index("merchant_id").sort_index()
    expected = expected_after(2, 1).set_index("merchant_id").sort_index()
    assert set(upserted.columns) == set(expected.columns)
    assert list(upserted.index) == list(expected.index)  # every key's row kept through the schema change
    carried = ["total", "avg_amount", "largest", "last_seen"]
    pd.testing.assert_frame_equal(upserted[carried], expected[carried], check_dtype=False, rtol=1e-9)
    touched = upserted["seen_since"].notna()
    assert touched.sum() == third.records_out  # the new columns fill in as keys are written
    assert iceberg.epoch_history("payments") == {e: [runner.result(e).records_out] for e in (1, 2, 3)}

    appended = delta.read().to_pandas()
    assert {"events", "smallest", "first_event", "n_events"} <= set(appended.columns)
    assert appended["events"].notna().sum() == first_two and appended["events"].isna().sum() == third.records_out
    assert appended["n_events"].notna().sum() == third.records_out


def test_a_windows_lateness_lowered_not_raised_and_a_renamed_window_accumulator(spark, tmp_path):
    generate(tmp_path / "events", 2, PER_FILE, 100)
    windows = tumbling("10 seconds")
    build = lambda lateness, pipeline=None: pipeline or window_pipeline(  # noqa: E731
        tmp_path / "events", tmp_path / "out", windows, delay="2 seconds", lateness=lateness)
    runner = EpochRunner(build("5 seconds"), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    runner.run_available(max_epochs=1)
    open_windows = runner.read_state()
    assert open_windows.num_rows > 0
    sooner = build("0 seconds")
    result = runner.migrate(sooner)
    assert result.changes == ["allowed lateness 5 s -> 0 s"]
    assert runner.read_state().equals(open_windows)  # the same open windows, nothing fired or lost
    with pytest.raises(StateLayoutError, match=r"cannot migrate: the window's allowed lateness would grow \(0 s -> "
                                               r"5 s\): windows already fired .* fire a second time"):
        runner.migrate(build("5 seconds"))  # issue 31: it would re-fire emitted windows
    bounded = window_pipeline(tmp_path / "events", tmp_path / "out", windows, delay="2 seconds", lateness="0 seconds",
                              max_pending=10)
    assert runner.migrate(bounded).noop  # the pending-window bound may change at any epoch: nothing to rewrite
    wider = window_pipeline(tmp_path / "events", tmp_path / "out", tumbling("20 seconds"), delay="2 seconds",
                            lateness="0 seconds")
    with pytest.raises(StateLayoutError, match="cannot migrate: the window's windows changed .*Options: start a new"):
        runner.migrate(wider)
    renamed = Pipeline("windows").source(FileLog(tmp_path / "events", format="parquet")).where("status != 'failed'") \
        .key_by("merchant_id").window(windows, on="event_time", max_out_of_orderness="2 seconds",
                                      allowed_lateness="0 seconds") \
        .aggregate(n=count(), total=sum_("amount"), largest=max_("amount"), last_event=last("event_id")) \
        .sink(ParquetSink(tmp_path / "out")).with_shards(2)
    result = runner.migrate(renamed, renames={"events": "n"})
    assert set(result.changes) == {"'events' renamed to 'n'", "'first_event' removed"}
    migrated = runner.read_state()
    assert migrated.column("n").equals(open_windows.column("events"))
    assert migrated.column("window_end").equals(open_windows.column("window_end"))
    assert runner.run_available()[-1].epoch == 2  # the next epoch runs on the migrated windows


def test_changes_state_cannot_follow_are_refused_with_the_options(spark, tmp_path):
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    with pytest.raises(EpochOrderError, match="no epoch is committed"):
        runner.migrate(evolved(tmp_path))
    runner.run_available(max_epochs=1)
    base = Pipeline("payments").source(FileLog(tmp_path / "events", format="parquet")).sink(ParquetSink(tmp_path / "o"))
    refusals = {
        "the key column changed": base.key_by("event_id").aggregate(total=sum_("amount")),
        "accumulator 'total' changed from sum\\('amount'\\) over float to max\\('amount'\\)":
            base.key_by("merchant_id").aggregate(total=max_("amount")),
        "the operator changed between a running aggregate and windows":
            base.key_by("merchant_id").window(tumbling("1 minute"), on="event_time").aggregate(total=sum_("amount")),
    }
    for why, pipeline in refusals.items():
        with pytest.raises(StateLayoutError, match=f"cannot migrate: {why}.*Options: start a new lineage"):
            runner.migrate(pipeline)
    with pytest.raises(Exception, match="can start from null or 0 for existing keys, not 5"):
        runner.migrate(evolved(tmp_path), renames={"events": "n_events"}, initial={"spent_since": 5})
    assert runner.log.layout_changes() == []  # nothing was changed by any of them


@pytest.mark.deep  # the same rewrite and layout record as a rescale: the default lane kills a rescale (test_rescale.py)
def test_kill_9_during_volley_migrate_leaves_the_old_layout_or_the_new(spark, tmp_path, monkeypatch):
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    state = tmp_path / "state"
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out", shards=3), state, RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    runner.run_available()
    before = runner.read_state()
    args = ("migrate", str(state), "--to", "tests.engine.test_migrate:evolved_from_env", "--rename", "events=n_events",
            "--initial", "spent_since=0")
    monkeypatch.setenv("VOLLEY_TEST_BASE", str(tmp_path))
    # (rescale_after_shard, mid-rewrite, is the same code as rescale's: test_rescale.py kills there)
    killed = volley(*args, kill_at="rescale_before_commit")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert runner.log.layout_changes() == [] and runner.read_state().equals(before)  # the old layout, whole
    killed = volley(*args, kill_at="rescale_after_commit")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    after = EpochRunner(evolved(tmp_path), state, RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    assert_frame(after.read_state(), expected_after(2, 0))  # the new layout, whole
    again = volley(*args)
    assert again.returncode == 0 and "nothing to migrate" in again.stdout, again.stderr[-2000:]
    inspect = volley("inspect", str(state))
    assert "from epoch 3: 3 shards (was 3; epoch 2's state rewritten; migrated to ['total', 'n_events'" in inspect.stdout
    generate(tmp_path / "events", 1, PER_FILE, KEYS, first_file=2)
    assert [r.epoch for r in after.run_available()] == [3]
    assert_frame(after.read_state(), expected_after(2, 1))


def test_an_epoch_a_sink_already_holds_finishes_in_the_recorded_layout_first(spark, tmp_path):
    """Killed after the Delta sink committed epoch 2: migrating now would give epoch 2
    two layouts across the sinks, so it is refused until the epoch is run."""
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    crashed = run_until_killed(tmp_path, "after_sink_delta", 2, max_records=PER_FILE, hold=("iceberg", "parquet"))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    old = payments(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables")
    runner = EpochRunner(old, tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    assert runner.committed_epoch() == 1 and runner.log.last_cut() == 2
    held = r"epoch 2 is cut but not committed, and sinks \{'delta': 2\} already hold"
    with pytest.raises(EpochOrderError, match=held):
        runner.migrate(evolved(tmp_path, tables=tmp_path / "tables"), renames={"events": "n_events"})
    assert [r.epoch for r in runner.run_available()] == [2]
    result = runner.migrate(evolved(tmp_path, tables=tmp_path / "tables"), renames={"events": "n_events"},
                            initial={"spent_since": 0})
    assert result.rewrite.epoch == 2
    assert_frame(runner.read_state(), expected_after(2, 0))
