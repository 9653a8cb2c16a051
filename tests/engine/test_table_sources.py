"""Pipelines that feed pipelines, on real Spark, RocksDB, Delta and Iceberg: pipeline B
reads pipeline A's table (``DeltaTableSource``, ``IcebergTableSource``) while A keeps
committing, and B's tables equal the reference fed exactly the rows B's epochs
recorded, which are every row of A's table, each once. A re-run reads the same
versions; a version VACUUM removed fails the epoch by name; a change the append
reader cannot follow is refused by name."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from tests.chain_reference import assert_hourly_refunds_equal_reference
from tests.engine.test_crash_recovery import run_until_killed
from tests.helpers import minute_totals, minute_totals_reference
from volley_dagster import DeltaTableSource, EpochRunner, FileLog, Pipeline, RunSettings, count
from volley_dagster.demo.events import generate
from volley_dagster.demo.merchant_refunds import merchant_refunds_pipeline
from volley_dagster.demo.payments import local_tables, merchant_minutes_pipeline
from volley_dagster.demo.refunds import refunds_pipeline, write_refund_logs
from volley_dagster.errors import SourceDataLostError, SourceError

PER_FILE = 400


def assert_totals(output, table) -> None:
    got = DeltaTable(output).to_pyarrow_table(columns=["merchant_id", "minutes", "events", "largest"])
    got = got.to_pandas().sort_values("merchant_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(got, minute_totals_reference(table), check_dtype=False)


@pytest.mark.deep  # tests/dagster/test_chained_location.py checks the same chain against the reference, under Dagster
def test_hourly_refunds_read_from_the_refunds_pipelines_iceberg_table_equal_the_reference(spark, tmp_path):
    events = tmp_path / "events"
    write_refund_logs(events, 3, PER_FILE)
    tables = local_tables(tmp_path / "tables")
    upstream = EpochRunner(refunds_pipeline(events, tables, shards=2), tmp_path / "refunds",
                           RunSettings(max_records_per_epoch=900), spark=spark)
    downstream = EpochRunner(merchant_refunds_pipeline(tables), tmp_path / "merchant_refunds", spark=spark)
    assert downstream.run_next() is None  # no table yet: nothing to cut, no error

    ran: list[int] = []
    for round_ in range(3):
        if round_ == 1:
            write_refund_logs(events, 2, PER_FILE, first_file=3)
        while upstream.run_next() is not None:
            pass
        if round_ == 2:
            upstream.flush()  # the join's last outer rows
        result = downstream.run_next()
        assert result is not None and result.records_in > 0
        ran.append(result.epoch)
    rerun = downstream.run(ran[0])
    assert rerun.already_committed
    downstream.flush()

    assert assert_hourly_refunds_equal_reference(downstream, tables, end_of_stream=True) > 10


def _minutes_then_totals(tmp_path, spark, events_files: int):
    events = tmp_path / "events"
    generate(events, events_files, 200, 20, seed=3, events_per_second=1)
    tables = local_tables(tmp_path / "tables")
    minutes = EpochRunner(merchant_minutes_pipeline(events, tables, shards=2), tmp_path / "minutes",
                          RunSettings(max_records_per_epoch=150), spark=spark)
    table = f"{tables.warehouse}/delta/merchant_minutes"
    return events, minutes, EpochRunner(minute_totals(table, tmp_path / "totals"), tmp_path / "totals_state",
                                        spark=spark), table


@pytest.mark.deep  # the kill -9 test below checks the same totals over A's commits, read by several epochs
def test_running_totals_over_the_minutes_pipelines_delta_table_equal_the_table_summed(spark, tmp_path):
    events, minutes, totals, table = _minutes_then_totals(tmp_path, spark, 2)
    committed = []
    for round_ in range(2):
        if round_ == 1:
            generate(events, 1, 200, 20, seed=3, first_file=2, events_per_second=1)
        minutes.run_next()  # A commits one epoch at a time, B reads what is there
        while (result := totals.run_next()) is not None:
            committed.append(result)
        while minutes.run_next() is not None:
            pass
        while (result := totals.run_next()) is not None:
            committed.append(result)
    ranges = [totals.log.offsets(r.epoch) for r in committed]
    versions = [int(s.version) for rng in ranges for s in rng.segments]
    assert versions == sorted(versions) and len(set(versions)) > 2  # several of A's commits, in order

    assert_totals(tmp_path / "totals", table)

    # a committed epoch re-run reads the versions it recorded and changes nothing
    before = DeltaTable(tmp_path / "totals").version()
    assert totals.run(committed[0].epoch).already_committed
    assert DeltaTable(tmp_path / "totals").version() == before


def test_a_version_vacuumed_before_its_epoch_ran_fails_it_by_name_and_commits_nothing(spark, tmp_path):
    events, minutes, totals, table = _minutes_then_totals(tmp_path, spark, 2)
    while minutes.run_next() is not None:
        pass
    rng = totals.cut_next()
    assert rng is not None and rng.segments
    lost = tmp_path / "tables" / "delta" / "merchant_minutes" / rng.segments[0].file
    lost.unlink()  # as VACUUM removes a file past its retention
    with pytest.raises(SourceDataLostError, match=rf"epoch {rng.epoch}: Delta table .* version "
                                                   rf"{rng.segments[0].version} .*VACUUM.*Nothing was committed"):
        totals.run(rng.epoch)
    assert totals.committed_epoch() == 0 and not (tmp_path / "totals").exists()


def test_a_delete_in_the_table_is_refused_by_name_by_the_append_reader(spark, tmp_path):
    events, minutes, totals, table = _minutes_then_totals(tmp_path, spark, 1)
    while minutes.run_next() is not None:
        pass
    DeltaTable(table).delete("events > 1")
    read = totals.run_next()  # the appends before the delete are read first, then the delete is named
    assert read is not None and read.records_in > 0
    with pytest.raises(SourceError, match=r"version \d+ \(DELETE\) changes or deletes rows.*changes=True"):
        totals.run_next()


@pytest.mark.parametrize(("point", "epoch", "shard"), [("shard_after_snapshot", 2, 1),
                                                    pytest.param("after_snapshot", 3, None, marks=pytest.mark.deep)])
def test_a_pipeline_reading_a_table_killed_mid_epoch_resumes_to_the_same_totals(spark, tmp_path, point, epoch, shard):
    """``kill -9`` in a shard task, its files read by Spark's own scan (or with every
    shard snapshotted): a new runner reads the versions each epoch recorded, and every
    row of the table counts once."""
    events = tmp_path / "events"
    generate(events, 3, 200, 20, seed=5, events_per_second=1)
    minutes = EpochRunner(merchant_minutes_pipeline(events, local_tables(tmp_path / "tables"), shards=2),
                          tmp_path / "minutes", RunSettings(max_records_per_epoch=150), spark=spark)
    while minutes.run_next() is not None:
        pass
    table = tmp_path / "tables" / "delta" / "merchant_minutes"
    crashed = run_until_killed(tmp_path, point, epoch, shard, kind="minute_totals", max_records=40)
    assert crashed.returncode == -9, crashed.stderr[-2000:]
    resumed = EpochRunner(minute_totals(table, tmp_path / "out"), tmp_path / "state",
                          RunSettings(max_records_per_epoch=40), spark=spark)
    assert resumed.committed_epoch() == epoch - 1
    resumed.run_available()
    assert_totals(tmp_path / "out", table)
    history = resumed.pipeline.sinks[0].epoch_history("minute_totals")
    assert sorted(history) == list(range(1, resumed.committed_epoch() + 1)) and resumed.committed_epoch() > epoch
    assert all(len(commits) == 1 for commits in history.values())  # each epoch committed once


@pytest.mark.deep  # tests/sources/test_table_sources.py cuts and reads a table with a file log without Spark
def test_a_pipeline_reads_a_table_and_a_file_log_as_one_stream(spark, tmp_path):
    """``Pipeline.sources`` with a Delta table beside the events it was computed from:
    each merchant's count per source equals the files' and the table's own."""
    events, minutes, _, table = _minutes_then_totals(tmp_path, spark, 2)
    while minutes.run_next() is not None:
        pass
    mixed = (Pipeline("mixed").sources({"events": FileLog(events), "minutes": DeltaTableSource(table)},
                                       source_column="source")
             .with_column("key", "concat(source, ':', cast(merchant_id as string))").key_by("key")
             .aggregate(rows=count()).with_shards(2))
    runner = EpochRunner(mixed, tmp_path / "mixed", spark=spark)
    runner.run_available()
    got = dict(zip(*runner.read_state().select(["key", "rows"]).to_pydict().values(), strict=True))
    files = pa.concat_tables([pq.read_table(f) for f in sorted(events.glob("*.parquet"))]).to_pandas()
    rows = DeltaTable(table).to_pyarrow_table().to_pandas()
    expected = {f"events:{m}": n for m, n in files.merchant_id.value_counts().items()} | \
        {f"minutes:{m}": n for m, n in rows.merchant_id.value_counts().items()}
    assert got == expected
