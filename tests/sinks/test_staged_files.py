"""The shard tasks' files committed as a Delta table's add actions: once per epoch, with
the epoch's txn, and the statistics Delta readers prune by (the same as delta-rs writes
for the same rows, and never tighter than the data)."""

from __future__ import annotations

from dataclasses import replace
import sys
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.transaction import create_table_with_add_actions

from tests.sinks.commit_worker import epoch_output
from tests.sinks.helpers import PIPELINE, ctx
from volley_dagster.sinks.delta import DeltaSink
from volley_dagster.sinks.staged_files import StagedFile, StagingTarget, delta_stats, stage_rows

ROWS_PER_EPOCH = 100

ROWS = pa.table({
    "merchant_id": pa.array([3, None, 1, 7], pa.int64()),
    "total": pa.array([1.5, float("nan"), None, -2.25]),
    "name": pa.array(["b", None, "abc", "zz"]),
    "window_start": pa.array([1_700_000_000_123_000, None, 1_600_000_000_000_000, 1_650_000_000_000_000],
                             pa.timestamp("us", tz="UTC")),
    "day": pa.array([19000, 18000, None, 18500], pa.date32()),
    "late": pa.array([True, False, None, False]),
})


def staged_table(folder: Path, rows: pa.Table, row_group_size: int | None = None) -> DeltaTable:
    folder.mkdir(parents=True)
    pq.write_table(rows, folder / "part-0.parquet", row_group_size=row_group_size)
    staged = StagedFile("part-0.parquet", (folder / "part-0.parquet").stat().st_size, rows.num_rows,
                        delta_stats(pq.ParquetFile(folder / "part-0.parquet").metadata))
    create_table_with_add_actions(str(folder), DeltaSchema.from_arrow(rows.schema), [staged.add_action()], mode="error")
    return DeltaTable(str(folder))


def file_stats(table: DeltaTable) -> dict[str, object]:
    actions = table.get_add_actions(flatten=True)
    return {name: actions.column(name).to_pylist() for name in actions.column_names
            if name == "num_records" or name.startswith(("null_count.", "min.", "max."))}


def test_the_stats_are_delta_rs_own_for_the_same_rows(tmp_path):
    ours = staged_table(tmp_path / "ours", ROWS, row_group_size=2)  # bounds over two row groups
    write_deltalake(str(tmp_path / "theirs"), ROWS)
    theirs = DeltaTable(str(tmp_path / "theirs"))
    assert file_stats(ours) == file_stats(theirs)
    assert file_stats(ours)["min.merchant_id"] == [1] and file_stats(ours)["null_count.total"] == [1]
    read = ours.to_pyarrow_table().combine_chunks()
    assert read.drop_columns(["total"]).equals(ROWS.drop_columns(["total"]))  # NaN equals no NaN
    assert read.column("total").is_nan().to_pylist() == [False, True, None, False]


def test_bounds_are_never_tighter_than_the_rows(tmp_path):
    rows = pa.table({
        "at": pa.array([1_700_000_000_000_001, 1_700_000_000_999_999], pa.timestamp("us", tz="UTC")),
        "long": pa.array(["a" * 40, "b"]),
        "local": pa.array([1_700_000_000_000_001, 1_700_000_000_999_999], pa.timestamp("us")),
        "sum": pa.array([float("inf"), -1.5]),  # a sum that overflowed
        "price": pa.array([Decimal("0.10"), Decimal("-2.25")], pa.decimal128(10, 2)),
    })
    table = staged_table(tmp_path / "t", rows)
    stats = file_stats(table)
    low, high = stats["min.at"][0], stats["max.at"][0]
    assert low <= rows.column("at")[0].as_py() and high >= rows.column("at")[1].as_py()
    assert (high - low).total_seconds() == 1.0  # to the millisecond, outward
    assert stats["min.long"] == ["a" * 40] and stats["max.long"] == ["b"]  # whole, as delta-rs writes them
    assert stats["max.sum"] == [sys.float_info.max] and stats["min.price"][0] <= Decimal("-2.25") < Decimal("0.10") <= stats["max.price"][0]
    assert stats["min.local"][0] <= rows.column("local")[0].as_py() and stats["max.local"][0] >= rows.column("local")[1].as_py()
    # delta-rs's reader skips a file whose bound for a filtered column is missing: each finds its rows
    for column, op, value, found in [("at", ">=", rows.column("at")[1].as_py(), 1), ("long", "==", "b", 1),
                                     ("long", "<", "b", 1), ("local", ">", rows.column("local")[0].as_py(), 1),
                                     ("sum", ">", 0.0, 1), ("sum", "<", 0.0, 1), ("price", ">", Decimal("0.05"), 1)]:
        assert table.to_pyarrow_table(filters=[(column, op, value)]).num_rows == found, (column, op, value)


def files_of(table: DeltaTable) -> list[str]:
    return table.get_add_actions(flatten=True).column("path").to_pylist()


def staged_epoch(folder: Path, epoch: int, shards: int = 2) -> tuple[pa.Table, tuple[StagedFile, ...]]:
    """An epoch's output as the shard tasks leave it: one file per shard in the table's folder."""
    output = epoch_output(epoch, ROWS_PER_EPOCH)
    folder.mkdir(parents=True, exist_ok=True)
    target = StagingTarget("delta", str(folder))
    part = ROWS_PER_EPOCH // shards
    return output, tuple(stage_rows(output.slice(s * part, part), target, f"part-{epoch:010d}-{s:05d}-a.parquet")
                         for s in range(shards))


def test_a_delta_append_commits_the_tasks_files_once_with_the_epochs_txn(tmp_path):
    sink = DeltaSink(tmp_path / "table", mode="append")
    assert sink.staging_folder() == str(tmp_path / "table")
    for epoch in (1, 2):  # the first creates the table with its files, the second appends
        output, files = staged_epoch(tmp_path / "table", epoch)
        result = sink.commit(output, replace(ctx(epoch), staged=files))
        assert not result.skipped and result.rows == output.num_rows
        table = DeltaTable(str(tmp_path / "table"))
        assert sorted(files_of(table)) == sorted(f"part-{e:010d}-{s:05d}-a.parquet" for e in range(1, epoch + 1)
                                               for s in range(2))
        assert sink.committed_epoch(PIPELINE) == epoch
    again = sink.commit(output, replace(ctx(2), staged=staged_epoch(tmp_path / "table", 2)[1]))
    assert again.skipped and len(files_of(DeltaTable(str(tmp_path / "table")))) == 4  # nothing added twice
    expected = pa.concat_tables([epoch_output(e, ROWS_PER_EPOCH) for e in (1, 2)])
    assert DeltaTable(str(tmp_path / "table")).to_pyarrow_table().sort_by("epoch").equals(expected.sort_by("epoch"))
    assert sink.row_count() == expected.num_rows  # from the files' statistics


def test_files_whose_columns_the_table_no_longer_has_are_left_for_the_rows(tmp_path):
    sink = DeltaSink(tmp_path / "table", mode="append")
    first, _ = staged_epoch(tmp_path / "other", 1)
    sink.commit(first.append_column("extra", pa.nulls(first.num_rows, pa.int64())), ctx(1))  # a wider table
    output, files = staged_epoch(tmp_path / "table", 2)
    assert not sink.commit(output, replace(ctx(2), staged=files)).skipped
    table = DeltaTable(str(tmp_path / "table"))
    assert not set(f.path for f in files) & set(files_of(table))  # the rows were written, with the table's columns
    assert table.to_pyarrow_table().num_rows == 2 * ROWS_PER_EPOCH


def test_only_a_local_append_that_nothing_reshapes_stages():
    assert DeltaSink("/tmp/t", mode="upsert").staging_folder() is None
    assert DeltaSink("/tmp/t", partition_by=["epoch"]).staging_folder() is None
    assert DeltaSink("/tmp/t", epoch_column="epoch_key").staging_folder() is None
    assert DeltaSink("s3://bucket/t").staging_folder() is None
