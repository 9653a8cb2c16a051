"""Delta and Iceberg tables as sources, without Spark, on real tables (delta-rs, pyiceberg
with its SQLite catalog): what a cut records and a segment reads, whole commits under
the record budget, a commit that only rearranges files, the change data feed read the
same on every attempt, and each refusal by name (a change the append reader cannot
follow, a removed version, an expired snapshot)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from volley_dagster import DeltaTableSource, IcebergTableSource
from volley_dagster.errors import SourceDataLostError, SourceError, SourceNotReadyError
from volley_dagster.sinks.iceberg import open_catalog, sqlite_catalog
from volley_dagster.sources.offsets import EpochRange, TableVersion

SCHEMA = pa.schema([("id", pa.int64()), ("region", pa.string()), ("amount", pa.float64())])


def rows(ids: range, region: str = "eu") -> pa.Table:
    return pa.table({"id": list(ids), "region": [region] * len(ids), "amount": [i / 4 for i in ids]}, schema=SCHEMA)


def read_all(source, rng: EpochRange) -> pa.Table:
    return pa.concat_tables([source.read_segment(s, source.schema(), rng.epoch) for s in rng.segments])


def test_a_delta_cut_takes_whole_commits_under_the_budget_and_each_segment_reads_its_file(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, rows(range(0, 3)), partition_by=["region"])
    write_deltalake(uri, pa.concat_tables([rows(range(3, 5), "us"), rows(range(5, 6))]), mode="append",
                    partition_by=["region"])
    write_deltalake(uri, rows(range(6, 10)), mode="append", partition_by=["region"])
    source = DeltaTableSource(uri)
    assert source.schema().names == ["id", "region", "amount"]
    assert source.backlog({}).records == 10

    first = source.cut(1, {}, max_records=4)  # version 0 (3 rows) fits, version 1 would pass 4
    assert first.end == {"table": TableVersion(0)} and first.records == 3
    second = source.cut(2, first.end, max_records=1)  # at least one commit, however large
    assert [s.version for s in second.segments] == ["1", "1"] and second.records == 3
    assert EpochRange.from_dict(second.to_dict()) == second  # the position is recorded as it is read
    third = source.cut(3, second.end, None)
    read = pa.concat_tables([read_all(source, r) for r in (first, second, third)])
    assert sorted(read.column("id").to_pylist()) == list(range(10))
    assert read.column("_volley_error").null_count == 10
    by_id = {r["id"]: r["region"] for r in read.select(["id", "region"]).to_pylist()}  # partition values restored
    assert by_id[3] == "us" and by_id[0] == "eu"
    assert source.cut(4, third.end, None).records == 0 and source.backlog(third.end).records == 0

    DeltaTable(uri).optimize.compact()  # rearranges files: no records
    DeltaTable(uri).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    idle = source.cut(4, third.end, None)
    assert idle.records == 0 and idle.end["table"] == TableVersion(DeltaTable(uri).version())
    with pytest.raises(SourceDataLostError, match=r"epoch 1: Delta table .* version 0 .*VACUUM.*Nothing was committed"):
        source.verify(first)  # its files are gone now


def test_a_delta_change_the_append_reader_cannot_follow_is_refused_and_its_log_loss_named(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, rows(range(0, 4)))
    DeltaTable(uri).update(updates={"amount": "0.0"}, predicate="id = 1")
    source = DeltaTableSource(uri)
    first = source.cut(1, {}, None)  # the versions before the update are read first
    assert first.records == 4 and first.end == {"table": TableVersion(0)}
    with pytest.raises(SourceError, match="version 1 .UPDATE."):
        source.backlog(first.end)  # what the sensor shows
    with pytest.raises(SourceError, match=r"version 1 \(UPDATE\) changes or deletes rows, and this source reads "
                                          r"appends only.*changes=True.*starting_version=2"):
        source.cut(2, first.end, None)
    start = DeltaTableSource(uri, starting_version=2)
    assert start.cut(1, {}, None).records == 0  # past it: nothing refused
    DeltaTable(uri).create_checkpoint()
    (tmp_path / "t" / "_delta_log" / f"{0:020d}.json").unlink()  # as log cleanup does past a checkpoint
    with pytest.raises(SourceDataLostError, match=r"version 0 can no longer be read: its commit file .* is gone"):
        DeltaTableSource(uri).cut(1, {}, None)


def test_the_change_data_feed_is_read_with_its_change_kind_and_the_same_order_every_time(tmp_path):
    uri = str(tmp_path / "t")
    write_deltalake(uri, rows(range(0, 6)), configuration={"delta.enableChangeDataFeed": "true"})
    table = DeltaTable(uri)
    table.update(updates={"amount": "amount + 100"}, predicate="id % 2 = 0")
    table.delete("id = 5")
    source = DeltaTableSource(uri, changes=True)
    assert source.schema().names[-3:] == ["_change_type", "_commit_version", "_commit_timestamp"]
    rng = source.cut(1, {}, None)
    assert [s.file for s in rng.segments] == [f"_delta_log/{v:020d}.json" for v in range(3)]
    read = read_all(source, rng)
    assert read.equals(read_all(DeltaTableSource(uri, changes=True), rng))  # a retry: the same rows at the same offsets
    kinds = sorted(zip(read.column("_commit_version").to_pylist(), read.column("_change_type").to_pylist(),
                       read.column("id").to_pylist(), strict=True))
    assert kinds == [(0, "insert", i) for i in range(6)] + \
        sorted([(1, "update_preimage", i) for i in (0, 2, 4)] + [(1, "update_postimage", i) for i in (0, 2, 4)]) + \
        [(2, "delete", 5)]
    DeltaTable(uri).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    with pytest.raises(SourceDataLostError, match=r"epoch 1: Delta table .* version 0 .*VACUUM"):
        source.verify(rng)  # version 0's file, rewritten by the update, is gone


def test_a_table_that_does_not_exist_yet_waits(tmp_path):
    source = DeltaTableSource(tmp_path / "none")
    assert source.backlog({}).records == 0 and source.cut(1, {}, None).records == 0
    with pytest.raises(SourceNotReadyError, match="no Delta table at .* yet"):
        source.schema()
    catalog = sqlite_catalog(tmp_path / "iceberg")
    iceberg = IcebergTableSource("ns.none", catalog=catalog)
    assert iceberg.backlog({}).records == 0 and iceberg.cut(1, {}, None).records == 0
    with pytest.raises(SourceNotReadyError, match="no Iceberg table ns.none yet"):
        iceberg.schema()


def test_iceberg_appends_are_read_snapshot_by_snapshot_and_an_overwrite_or_an_expired_snapshot_named(tmp_path):
    catalog = sqlite_catalog(tmp_path / "iceberg")
    cat = open_catalog("volley", catalog)
    cat.create_namespace("ns")
    table = cat.create_table("ns.t", schema=SCHEMA)
    for start in (0, 3, 5):
        table.append(rows(range(start, start + (3 if start == 0 else 2))))
    source = IcebergTableSource("ns.t", catalog=catalog)
    assert source.backlog({}).records == 7
    first = source.cut(1, {}, max_records=4)
    snapshots = [s.snapshot_id for s in table.refresh().snapshots()]
    assert first.end == {"table": TableVersion(snapshots[0])} and first.records == 3
    rest = source.cut(2, first.end, None)
    assert [s.version for s in rest.segments] == [str(snapshots[1]), str(snapshots[2])]
    read = pa.concat_tables([read_all(source, first), read_all(source, rest)])
    assert sorted(read.column("id").to_pylist()) == list(range(7))

    table.refresh().maintenance.expire_snapshots().by_id(snapshots[0]).commit()
    with pytest.raises(SourceDataLostError, match=rf"epoch 1: Iceberg table ns.t snapshot {snapshots[0]} .*expired"):
        source.verify(first)
    table.refresh().delete("id = 1")
    with pytest.raises(SourceError, match=r"snapshot \d+ is an 'overwrite'|snapshot \d+ is an 'delete'"):
        source.cut(3, rest.end, None)


def test_delta_timestamp_partitions_read_as_written_and_column_mapping_is_refused_with_what_to_do(tmp_path):
    when = pa.array([0, 86_400_000_123, None], pa.int64()).cast(pa.timestamp("us", tz="UTC"))
    table = pa.table({"id": [1, 2, 3], "at": when})
    write_deltalake(str(tmp_path / "t"), table, partition_by=["at"])
    source = DeltaTableSource(tmp_path / "t")
    read = read_all(source, source.cut(1, {}, None))
    assert sorted(read.select(["id", "at"]).to_pylist(), key=lambda r: r["id"]) == table.to_pylist()

    write_deltalake(str(tmp_path / "mapped"), pa.table({"id": [1]}),
                    configuration={"delta.columnMapping.mode": "name", "delta.minReaderVersion": "2",
                                   "delta.minWriterVersion": "5"})
    with pytest.raises(SourceError, match=r"uses column mapping .*changes=True"):
        DeltaTableSource(tmp_path / "mapped", starting_version=1).schema()


def test_iceberg_history_expired_is_named_or_read_whole_and_a_renamed_column_reads_the_same(tmp_path):
    catalog = sqlite_catalog(tmp_path / "iceberg")
    cat = open_catalog("volley", catalog)
    cat.create_namespace("ns")
    table = cat.create_table("ns.t", schema=SCHEMA)
    for start in (0, 2, 4, 6):
        table.append(rows(range(start, start + 2)))
    snapshots = [s.snapshot_id for s in table.refresh().snapshots()]
    reader = IcebergTableSource("ns.t", catalog=catalog)
    first = reader.cut(1, {}, max_records=2)
    assert first.end == {"table": TableVersion(snapshots[0])}

    table.refresh().maintenance.expire_snapshots().by_id(snapshots[1]).commit()  # unread, in the middle
    with pytest.raises(SourceDataLostError, match=r"snapshot \d+ can no longer be read: the snapshots between it and "
                                                  rf"snapshot {snapshots[0]}, read last, expired"):
        reader.cut(2, first.end, None)
    fresh = IcebergTableSource("ns.t", catalog=catalog)  # a new pipeline starts from the oldest snapshot left, whole
    table.refresh().maintenance.expire_snapshots().by_id(snapshots[0]).commit()
    whole = fresh.cut(1, {}, None)
    assert sorted(read_all(fresh, whole).column("id").to_pylist()) == list(range(8))

    before = read_all(fresh, whole)
    with table.refresh().update_schema() as update:
        update.rename_column("amount", "value")
    after = read_all(fresh, whole)  # a retry in the same process: the columns it started with
    assert after.equals(before)


def test_a_table_source_names_its_table_as_the_sink_writing_it_does(tmp_path, monkeypatch):
    """Dagster's lineage joins a pipeline's table asset to the next one's source by these."""
    from volley_dagster import DeltaSink, IcebergSink

    monkeypatch.chdir(tmp_path)
    sink = DeltaSink("tables/alerts/", name="alerts")
    assert DeltaTableSource(tmp_path / "tables" / "x" / ".." / "alerts").upstream_table() == \
        sink.location().identity() == DeltaTableSource(f"file://{tmp_path}/tables/alerts").upstream_table()
    assert DeltaTableSource("s3a://bucket/alerts/").upstream_table() == \
        DeltaSink("s3://bucket/alerts", name="s3").location().identity()
    one, other = sqlite_catalog(tmp_path / "one"), sqlite_catalog(tmp_path / "other")
    written = IcebergSink("ns.alerts", catalog=one, name="alerts").location().identity()
    assert IcebergTableSource("ns.alerts", catalog=one).upstream_table() == written
    assert IcebergTableSource("ns.alerts", catalog=other).upstream_table() != written  # same name, another catalog


def test_appended_files_go_to_sparks_own_scan_unless_partition_values_or_other_columns_are_missing(tmp_path):
    write_deltalake(str(tmp_path / "plain"), rows(range(0, 3)))
    write_deltalake(str(tmp_path / "plain"), rows(range(3, 5)), mode="append")
    plain = DeltaTableSource(tmp_path / "plain")
    rng = plain.cut(1, {}, None)
    native = plain.native_parquet_files(rng, plain.schema())
    assert native is not None and [f.records for f in native] == [s.records for s in rng.segments] == [3, 2]
    assert all(f.is_all_of(s) for f, s in zip(native, rng.segments, strict=True))
    write_deltalake(str(tmp_path / "parted"), rows(range(0, 3)), partition_by=["region"])
    parted = DeltaTableSource(tmp_path / "parted")
    assert parted.native_parquet_files(parted.cut(1, {}, None), parted.schema()) is None  # the region is not in the files
    changes = DeltaTableSource(tmp_path / "plain", changes=True)
    assert changes.native_parquet_files(rng, changes.schema()) is None


def test_a_table_and_a_file_log_are_cut_together_and_wait_together(tmp_path):
    from volley_dagster import FileLog, MultiSource
    from volley_dagster.demo.events import generate

    write_deltalake(str(tmp_path / "t"), rows(range(0, 3)))
    write_deltalake(str(tmp_path / "t"), rows(range(3, 5)), mode="append")
    (tmp_path / "events").mkdir()  # a log folder with no file yet
    both = MultiSource({"events": FileLog(tmp_path / "events"), "table": DeltaTableSource(tmp_path / "t")})
    waiting = both.cut(1, {}, 1_000)
    assert both.waiting_for() == ["events"] and waiting.records == 0  # no events file yet: nothing of either
    generate(tmp_path / "events", 1, 50, 5)
    rng = both.cut(1, {}, 1_000)
    assert {s.partition for s in rng.segments} == {"events/", "table/table"} and rng.records == 55
    read = pa.concat_tables([both.read_segment(s, both.schema(), 1) for s in rng.segments], promote_options="default")
    assert read.num_rows == 55 and len(set(read.column("_volley_pos").to_pylist())) == 55
    assert sorted(i for i in read.column("id").to_pylist() if i is not None) == list(range(5))
    after = both.cut(2, rng.end, 1_000)
    assert after.records == 0 and after.end == rng.end  # each source goes on from where it stopped
