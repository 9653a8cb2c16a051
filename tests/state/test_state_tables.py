"""The state at retained epochs as Spark DataFrames (read by Spark tasks, one per
shard), the change feed between them, the ``volley state`` commands and the Delta
export, against a reference computed straight from the source records; and every
kind of read leaves the snapshots byte for byte as they were."""

from __future__ import annotations

import shutil

import pandas as pd
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from tests.helpers import assert_state_equal, log_records, payments, reference_state, tree_digest
from tests.window_reference import crash_window_pipeline
from volley_dagster import ConfigError, EpochRunner, SnapshotError
from volley_dagster.cli import main as volley
from volley_dagster.demo.events import generate
from volley_dagster.settings import RunSettings
from volley_dagster.spark.state_table import CHANGE

FILES, PER_FILE, KEYS = 3, 2_000, 600
VALUES = ["total", "events", "avg_amount", "smallest", "largest", "first_event", "last_seen"]


@pytest.fixture(scope="module")
def three_epochs(spark, tmp_path_factory):
    base = tmp_path_factory.mktemp("state_tables")
    generate(base / "events", FILES, PER_FILE, KEYS)
    runner = EpochRunner(payments(base / "events", base / "out"), base / "state", RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=3), spark=spark)
    assert [r.epoch for r in runner.run_available()] == [1, 2, 3]
    return base, runner


def reference_at(runner: EpochRunner, epoch: int) -> pd.DataFrame:
    """The running aggregate over exactly the records of epochs 1..epoch."""
    records = sum(runner.result(e).records_in for e in range(1, epoch + 1))
    return reference_state(log_records(FILES, PER_FILE, KEYS).slice(0, records))


def test_the_state_at_three_retained_epochs_and_the_changes_between_them_equal_the_reference(three_epochs):
    _, runner = three_epochs
    tables = runner.state_tables()
    for epoch in (1, 2, 3):
        df = tables.at(epoch)
        assert df.rdd.getNumPartitions() == 3  # one task per shard
        state = df.toArrow()
        assert state.column_names == ["merchant_id", "key_group"] + VALUES + ["shard"]
        assert_state_equal(state.drop_columns(["key_group", "shard"]), reference_at(runner, epoch))
        layout = runner.layout()  # each key sits in its key group's shard
        groups, shards = state.column("key_group").to_numpy(), state.column("shard").to_numpy()
        assert (shards == layout.shard_of_group(groups)).all() and groups.max() < layout.num_key_groups
    for old, new in ((1, 2), (2, 3), (1, 3)):
        feed = tables.changes(old, new).toPandas()
        before, after = reference_at(runner, old), reference_at(runner, new)
        both = before.merge(after, on="merchant_id", how="outer", suffixes=("_old", "_new"), indicator=True)
        added = set(both.loc[both["_merge"] == "right_only", "merchant_id"])
        unchanged = both["_merge"] == "both"
        for column in VALUES:
            unchanged &= both[f"{column}_old"].eq(both[f"{column}_new"])
        changed = set(both.loc[(both["_merge"] == "both") & ~unchanged, "merchant_id"])
        assert set(feed.loc[feed[CHANGE] == "added", "merchant_id"]) == added and added
        assert set(feed.loc[feed[CHANGE] == "changed", "merchant_id"]) == changed and changed
        assert not (feed[CHANGE] == "removed").any()  # a running aggregate keeps every key
        new_values = feed.rename(columns={f"new_{c}": c for c in VALUES})[["merchant_id"] + VALUES]
        expected = after[after["merchant_id"].isin(added | changed)]
        pd.testing.assert_frame_equal(new_values.sort_values("merchant_id").reset_index(drop=True),
                                      expected.sort_values("merchant_id").reset_index(drop=True),
                                      check_dtype=False, check_exact=False, rtol=1e-9)
        assert feed.loc[feed[CHANGE] == "added", "old_total"].isna().all()


def test_the_volley_state_commands_print_diff_and_export_a_delta_table(three_epochs, capsys):
    base, runner = three_epochs
    root = str(base / "state")
    key = int(reference_at(runner, 2)["merchant_id"].iloc[0])
    assert volley(["state", "show", root, "--epoch", "2", "--key", str(key)]) == 0
    shown = capsys.readouterr().out
    assert "state at epoch 2 (1 rows)" in shown and str(key) in shown
    assert volley(["state", "diff", root, "1", "3", "--limit", "5"]) == 0
    diffed = capsys.readouterr().out
    assert "changes from epoch 1 to 3" in diffed and " added" in diffed and " changed" in diffed

    target = base / "exports" / "epoch-2"
    assert volley(["state", "export", root, "--epoch", "2", "--to", f"delta:{target}"]) == 0
    assert "Delta table" in capsys.readouterr().out
    exported = DeltaTable(str(target)).to_pyarrow_table()
    assert_state_equal(exported.drop_columns(["key_group", "shard"]), reference_at(runner, 2))
    files = DeltaTable(str(target)).get_add_actions(flatten=True)  # statistics a reader prunes files by
    assert sum(files.column("num_records").to_pylist()) == exported.num_rows
    assert min(files.column("min.merchant_id").to_pylist()) == pc.min(exported.column("merchant_id")).as_py()
    assert volley(["state", "export", root, "--epoch", "2", "--to", f"delta:{target}"]) == 1  # one table per export
    assert "already exists" in capsys.readouterr().err


def test_reads_leave_the_snapshots_unchanged_and_name_what_they_cannot_read(three_epochs, tmp_path):
    base, runner = three_epochs
    snapshots = base / "state" / "snapshots"
    before = tree_digest(snapshots)
    tables = runner.state_tables()
    tables.at(3).count()
    tables.changes(1, 3).count()
    runner.read_state(2)
    from volley_dagster.spark.delta_export import export_to_delta
    export_to_delta(tables.at(1), str(tmp_path / "export"), "test")
    assert tree_digest(snapshots) == before
    for epoch in runner.log.retained_snapshots():  # and each still matches its manifest, hash for hash
        for snap in runner.log.state_shards(epoch).values():
            from volley_dagster.state.store import verify_snapshot
            verify_snapshot(runner.log.root / snap.path, snap.files, full=True)
    with pytest.raises(ConfigError, match="epoch 4 is not committed"):
        tables.at(4)
    with pytest.raises(ConfigError, match="pending entries are kept by window operators and state TTLs only"):
        tables.at(3, "pending")
    retained = runner.log.retained_snapshots()
    assert retained == [1, 2, 3]
    shutil.rmtree(base / "state" / "snapshots" / "0000000001")  # as retention would
    with pytest.raises(SnapshotError, match=r"epoch 1's snapshot of shard 0 .* was removed by retention"):
        tables.at(1)


def test_windows_read_their_open_windows_and_pending_entries(spark, tmp_path):
    generate(tmp_path / "events", 2, 3_000, 200)
    runner = EpochRunner(crash_window_pipeline(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=3_000), spark=spark)
    runner.run_available()
    before = tree_digest(tmp_path / "state" / "snapshots")
    tables = runner.state_tables()
    state = tables.at().toArrow()
    driver = runner.read_state()
    assert state.drop_columns(["key_group", "shard"]).sort_by(
        [(c, "ascending") for c in tables.keys()]).equals(driver) and driver.num_rows > 0
    pending = tables.at(view="pending").toArrow()
    assert pending.column_names == ["merchant_id", "key_group", "window_end", "evicted", "shard"]
    # every open window has a pending entry with its exact end
    open_windows = set(zip(driver.column("merchant_id").to_pylist(), driver.column("window_end").to_pylist()))
    entries = set(zip(pending.column("merchant_id").to_pylist(), pending.column("window_end").to_pylist()))
    assert open_windows <= entries
    assert tree_digest(tmp_path / "state" / "snapshots") == before
