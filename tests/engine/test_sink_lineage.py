"""A sink knows which checkpoint lineage wrote its epochs: a root deleted and started
again, or restored from a copy, never has its epochs silently skipped by tables that
hold another lineage's (real Parquet files, Delta table and Iceberg catalog)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest

from tests.helpers import assert_epoch_outputs, assert_state_equal, log_records, payments, reference_state
from volley_dagster import EpochRunner
from volley_dagster.cli import describe_checkpoints
from volley_dagster.demo.events import generate
from volley_dagster.errors import SinkLineageError
from volley_dagster.settings import RunSettings
from volley_dagster.verify import check_sink

FILES, PER_FILE, KEYS = 3, 1_000, 150


def runner_for(tmp: Path, spark, choice: str = "fail", max_files: int = 1) -> EpochRunner:
    pipeline = payments(tmp / "events", tmp / "out", tables=tmp / "tables", on_foreign_lineage=choice)
    return EpochRunner(pipeline, tmp / "state", RunSettings(max_records_per_epoch=max_files * PER_FILE), spark=spark)


def table_versions(runner: EpochRunner) -> tuple:
    """What each sink holds, as its own metadata says."""
    parquet, delta, iceberg = runner.pipeline.sinks
    return (sorted(p.name for p in (parquet.path / "payments").iterdir()), delta.table().version(),
            iceberg.table().current_snapshot().snapshot_id)


def by_rows(table: pa.Table) -> pd.DataFrame:
    frame = table.to_pandas()
    return frame.sort_values(list(frame.columns)).reset_index(drop=True)


def assert_sinks_pass_checks(runner: EpochRunner) -> None:
    for sink in runner.pipeline.sinks:
        outcomes = check_sink(runner, sink)
        assert all(o.passed for o in outcomes), [(sink.name, o.name, o.description) for o in outcomes]


def test_a_new_root_over_old_tables_fails_then_each_choice_equals_the_reference(spark, tmp_path):
    """Lineage A writes 3 epochs; its root is deleted. Lineage B fails by name, then
    continues after A's epochs; its root is deleted too, and lineage C replaces it all."""
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    records = log_records(FILES, PER_FILE, KEYS)
    old = runner_for(tmp_path, spark)
    assert [r.epoch for r in old.run_available()] == [1, 2, 3]
    old_lineage = old.log.lineage().id
    old_changes = old.pipeline.sinks[2].read()
    before = table_versions(old)
    old.wait_for_compactions()
    shutil.rmtree(tmp_path / "state")  # "use a new checkpoint root", with the same tables

    new = runner_for(tmp_path, spark)
    with pytest.raises(SinkLineageError) as failure:
        new.run_next()
    message = str(failure.value)
    assert old_lineage in message and new.log.lineage().id in message and "on_foreign_lineage" in message
    assert "'replace'" in message and "'continue'" in message
    assert new.committed_epoch() == 0 and table_versions(new) == before  # nothing committed, nothing skipped

    for choice, offset in (("continue", 3), ("replace", 6)):
        if choice == "replace":
            new.wait_for_compactions()  # the background compactor writes under the root after a commit
            shutil.rmtree(tmp_path / "state")  # and once more: a third lineage replaces both
        chosen = runner_for(tmp_path, spark, choice)
        assert [r.epoch for r in chosen.run_available()] == [1, 2, 3]
        parquet, delta, iceberg = chosen.pipeline.sinks
        for result in (chosen.result(e) for e in (1, 2, 3)):  # each epoch follows the held ones in every sink
            assert {s.sink_epoch for s in result.sinks.values()} == {result.epoch + offset}
        assert_state_equal(chosen.read_state(), reference_state(records))
        assert_state_equal(delta.read().select(list(reference_state(records).columns)), reference_state(records))
        outputs = parquet.read("payments").to_pandas()
        new_outputs = outputs[outputs["epoch"] > offset].assign(epoch=lambda f, o=offset: f["epoch"] - o)
        assert_epoch_outputs(new_outputs, records, {e: PER_FILE for e in (1, 2, 3)})
        if choice == "continue":  # the old rows stay, the new ones follow
            assert_epoch_outputs(outputs[outputs["epoch"] <= 3], records, {e: PER_FILE for e in (1, 2, 3)})
            assert by_rows(iceberg.read()).equals(by_rows(pa.concat_tables([old_changes, old_changes])))
        else:  # every row the tables held is gone, the third lineage's are there once
            assert sorted(outputs["epoch"].unique()) == [7, 8, 9]
            assert by_rows(iceberg.read()).equals(by_rows(old_changes))
        assert_sinks_pass_checks(chosen)
        shown = describe_checkpoints(tmp_path / "state")  # `volley inspect`
        assert f"lineage {chosen.log.lineage().id}" in shown
        assert f"sinks/delta.json  {choice!r} after epoch {offset} of lineage " in shown


def test_a_root_restored_from_a_copy_skips_what_it_committed_and_refuses_another_range(spark, tmp_path):
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    runner = runner_for(tmp_path, spark)
    runner.run_available(max_epochs=2)
    runner.wait_for_compactions()  # a backup: taken once nothing writes the root
    shutil.copytree(tmp_path / "state", tmp_path / "copy")  # a backup taken at epoch 2
    runner.run_available()
    generate(tmp_path / "events", 1, PER_FILE, KEYS, first_file=FILES)
    before = table_versions(runner)

    def restore() -> None:
        runner.wait_for_compactions()
        shutil.rmtree(tmp_path / "state")
        shutil.copytree(tmp_path / "copy", tmp_path / "state")

    restore()  # re-cut with larger epochs, epoch 3 reads files 2 and 3: not what the tables hold as 3
    wider = runner_for(tmp_path, spark, max_files=2)
    with pytest.raises(SinkLineageError, match=r"holds epoch 3 of this lineage \(\w+\) over another source range"):
        wider.run_next()
    assert table_versions(wider) == before

    restore()  # cut as before: epoch 3 is the one the tables hold, so every sink skips it
    again = runner_for(tmp_path, spark)
    results = again.run_available()
    assert [r.epoch for r in results] == [3, 4]
    assert all(commit.skipped for commit in results[0].sinks.values())
    assert not any(commit.skipped for commit in results[1].sinks.values())
    records = log_records(FILES + 1, PER_FILE, KEYS)
    assert_state_equal(again.pipeline.sinks[1].read().select(list(reference_state(records).columns)),
                       reference_state(records))
    assert_epoch_outputs(again.pipeline.sinks[0].read("payments").to_pandas(), records,
                         {e: PER_FILE for e in (1, 2, 3, 4)})
    assert_sinks_pass_checks(again)
