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
    with pytest.raises(SourceError, match=r"version 1 \(UPDATE\) changes or deletes rows, and this source reads "
                                          r"appends only.*changes=True"):
        source.cut(1, {}, None)
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
