"""An upsert table laid out by shard (``sinks/shard_files.py``): each shard task rewrites
its own files and the commit swaps them in. Over epochs that insert, update, expire and
grow a shard past its files' size, the table and the counts are what a MERGE of the same
epochs gives; a table whose files are not all the shards' own, or that moved on since the
plan, or a task that could not rewrite, falls back to the MERGE."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.sinks.helpers import PIPELINE, ctx
from volley_dagster.sinks.base import CommitContext, SinkCommitResult
from volley_dagster.sinks.delta import DeltaSink
from volley_dagster.sinks.shard_files import buckets_of, collected, owned_files, rewrite_shard
from volley_dagster.state.keys import ShardLayout

LAYOUT = ShardLayout(num_shards=2, num_key_groups=8)
KEY, EXPIRY = "merchant_id", "expired"


def rows(keys: list[int], expired: list[bool], epoch: int) -> pa.Table:
    return pa.table({KEY: pa.array(keys, pa.int64()),
                     "total": pa.array([float(k * 10 + epoch) for k in keys], pa.float64()),
                     EXPIRY: pa.array(expired, pa.bool_())})


def shard_rows(output: pa.Table) -> list[pa.Table]:
    """The epoch's rows of each shard (the rewrite never asks which shard a key is in:
    each shard's rows and files are its own; here, by the key's parity)."""
    parity = output.column(KEY).to_numpy() % 2
    return [output.filter(pa.array(parity == s)) for s in range(LAYOUT.num_shards)]


def context(epoch: int) -> CommitContext:
    return replace(ctx(epoch), expiry_column=EXPIRY)


def rewritten_commit(sink: DeltaSink, output: pa.Table, epoch: int, max_rows_per_file: int = 1_000_000,
                     before_commit: Callable[[], None] | None = None) -> SinkCommitResult:
    """The epoch as a pipeline runs it: planned, each shard's files rewritten, committed."""
    target = sink.rewrite_target(LAYOUT, KEY, EXPIRY)
    assert target is not None and target.rewrite is not None
    target = replace(target, rewrite=replace(target.rewrite, max_rows_per_file=max_rows_per_file))
    assert target.rewrite is not None
    rewrites = [rewrite_shard(part, target, LAYOUT, s, epoch, f"{epoch:04x}") for s, part in enumerate(shard_rows(output))]
    if before_commit is not None:
        before_commit()
    return sink.commit(output, replace(context(epoch), rewritten=collected(target.rewrite, rewrites, LAYOUT.num_shards)))


def table_rows(sink: DeltaSink) -> list[tuple[int, float]]:
    return sorted(zip(*sink.read().select([KEY, "total"]).to_pydict().values()))


def epochs_of(draw_keys: list[list[tuple[int, bool]]]) -> list[pa.Table]:
    out = []
    for epoch, changes in enumerate(draw_keys, start=1):
        unique = dict(changes)  # one row per key and epoch, as a running aggregate's
        out.append(rows(list(unique), list(unique.values()), epoch))
    return out


@settings(max_examples=20, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=25), min_size=1, max_size=8))
def test_the_shards_rewrites_leave_what_a_merge_leaves(changes: list[list[tuple[int, bool]]]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        ours, merged = DeltaSink(Path(folder) / "ours", mode="upsert"), DeltaSink(Path(folder) / "merged", mode="upsert")
        for epoch, output in enumerate(epochs_of(changes), start=1):
            result = rewritten_commit(ours, output, epoch, max_rows_per_file=4)  # buckets double as shards grow
            reference = merged.commit(output, context(epoch))
            assert not result.skipped and result.rows == reference.rows == output.num_rows
            assert {k: result.counts[k] for k in reference.counts} == reference.counts
            assert "files_added" in result.counts or not any(reference.counts.values())  # the tasks' files, if any changed
            assert table_rows(ours) == table_rows(merged)
            assert ours.committed_epoch(PIPELINE) == epoch
        target = ours.rewrite_target(LAYOUT, KEY, EXPIRY)
        assert target is not None and target.rewrite is not None  # still laid out by shard
        for files in target.rewrite.files.values():  # a shard's buckets grew with its rows
            assert files[0].buckets * 4 >= sum(f.rows for f in files)


def test_a_shard_rewrites_only_the_buckets_an_epoch_touched(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "t", mode="upsert")
    first = rows(list(range(0, 400, 2)), [False] * 200, 1)  # shard 0 only: 200 rows, 8 buckets of at most 32
    rewritten_commit(sink, first, 1, max_rows_per_file=32)
    target = sink.rewrite_target(LAYOUT, KEY, EXPIRY)
    assert target is not None and target.rewrite is not None
    assert sorted(f.bucket for f in target.rewrite.files[0]) == list(range(8)) and 1 not in target.rewrite.files
    key = pa.array([10], pa.int64())
    result = rewritten_commit(sink, rows([10], [False], 2), 2, max_rows_per_file=32)
    assert result.counts["files_removed"] == result.counts["files_added"] == 1 and result.counts["updated"] == 1
    after = sink.rewrite_target(LAYOUT, KEY, EXPIRY)
    assert after is not None and after.rewrite is not None
    changed = {f.path for f in after.rewrite.files[0]} - {f.path for f in target.rewrite.files[0]}
    assert [f.bucket for f in after.rewrite.files[0] if f.path in changed] == buckets_of(key, 8).tolist()
    assert dict(table_rows(sink))[10] == 102.0


def test_the_bucket_of_a_key_is_stable_and_spread() -> None:
    ints = pa.array(np.arange(100_000), pa.int64())
    counts = np.bincount(buckets_of(ints, 16), minlength=16)
    assert counts.min() > 100_000 / 16 * 0.9 and counts.max() < 100_000 / 16 * 1.1
    strings = pa.array([f"merchant-{i}" for i in range(10_000)])
    assert np.bincount(buckets_of(strings, 4), minlength=4).min() > 2_000
    assert buckets_of(pa.array([7, 7], pa.int64()), 8).tolist() == buckets_of(pa.array([7], pa.int64()), 8).tolist() * 2


def test_files_of_another_writer_or_layout_leave_the_table_to_the_merge(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "t", mode="upsert")
    sink.commit(rows([1, 2], [False, False], 1), context(1))  # a MERGE-written table (delta-rs' own file names)
    assert sink.rewrite_target(LAYOUT, KEY, EXPIRY) is None
    ours = DeltaSink(tmp_path / "ours", mode="upsert")
    rewritten_commit(ours, rows([1, 2], [False, False], 1), 1)
    assert ours.rewrite_target(LAYOUT, KEY, EXPIRY) is not None
    assert ours.rewrite_target(ShardLayout(num_shards=4, num_key_groups=8), KEY, EXPIRY) is None  # rescaled
    assert DeltaSink(tmp_path / "ours", mode="upsert", key_columns=["total"]).rewrite_target(LAYOUT, KEY, EXPIRY) is None
    assert DeltaSink(tmp_path / "ours", mode="append").rewrite_target(LAYOUT, KEY, EXPIRY) is None
    assert DeltaSink("s3://bucket/t", mode="upsert").rewrite_target(LAYOUT, KEY, EXPIRY) is None
    name = "volley-kg00000-00004-of-00008-b0000-of-0002-e0000000001-ab.parquet"
    assert owned_files([(name, 10, 5)], LAYOUT) is not None
    assert owned_files([(name, 10, 5), (name.replace("b0000", "b0001").replace("of-0002", "of-0004"), 10, 5)],
                       LAYOUT) is None  # one shard's files in two bucketings
    assert owned_files([(name, 10, None)], LAYOUT) is None  # no row count: not one of ours


def test_a_table_whose_files_changed_since_the_plan_takes_the_rows(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "t", mode="upsert")
    rewritten_commit(sink, rows([1, 2, 3], [False] * 3, 1), 1)

    def set_property() -> None:  # a commit of the table's metadata only: its files are the planned ones
        DeltaTable(str(tmp_path / "t")).alter.set_table_properties({"delta.logRetentionDuration": "interval 60 days"})

    second = rewritten_commit(sink, rows([3], [False], 2), 2, before_commit=set_property)
    assert second.counts["files_added"] == 1 and second.counts["updated"] == 1

    def another_writer() -> None:  # a file added since the plan
        write_deltalake(str(tmp_path / "t"), rows([7], [False], 0).drop_columns([EXPIRY]), mode="append")

    result = rewritten_commit(sink, rows([2, 3, 4], [False, True, False], 3), 3, before_commit=another_writer)
    assert not result.skipped and "files_added" not in result.counts  # MERGEd
    assert result.counts == {"inserted": 1, "updated": 1, "deleted": 1}
    assert table_rows(sink) == [(1, 11.0), (2, 23.0), (4, 43.0), (7, 70.0)]


def test_a_column_a_migration_added_is_null_in_the_rows_the_epoch_left(tmp_path: Path) -> None:
    ours, merged = DeltaSink(tmp_path / "ours", mode="upsert"), DeltaSink(tmp_path / "merged", mode="upsert")
    first = rows([1, 2, 3, 4], [False] * 4, 1)
    rewritten_commit(ours, first, 1)
    merged.commit(first, context(1))
    second = rows([2, 5], [False, False], 2)
    second = second.append_column("region", pa.array(["eu", "us"]))  # a migration's new column, last
    result = rewritten_commit(ours, second, 2)
    merged.commit(second, context(2))
    assert result.counts["files_added"] == 2  # the epoch's schema change did not change the files
    got, expected = ours.read(), merged.read()
    assert got.schema.names == expected.schema.names == [KEY, "total", "region"]
    assert sorted(got.to_pylist(), key=lambda r: r[KEY]) == sorted(expected.to_pylist(), key=lambda r: r[KEY])
    assert {r[KEY]: r["region"] for r in got.to_pylist()} == {1: None, 2: "eu", 3: None, 4: None, 5: "us"}


def test_a_task_that_cannot_rewrite_its_files_leaves_the_epoch_to_the_merge(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "t", mode="upsert")
    rewritten_commit(sink, rows([1, 2, 3], [False] * 3, 1), 1)
    target = sink.rewrite_target(LAYOUT, KEY, EXPIRY)
    assert target is not None and target.rewrite is not None
    (tmp_path / "t" / target.rewrite.files[1][0].path).rename(tmp_path / "moved.parquet")  # shard 1's file gone
    rewrites = [rewrite_shard(part, target, LAYOUT, s, 2, "02") for s, part in enumerate(shard_rows(rows([1, 2], [False, False], 2)))]
    refused = [r.refused for r in rewrites if r.refused]
    assert len(refused) == 1 and "shard 1" in refused[0] and "could not be read" in refused[0]
    assert collected(target.rewrite, rewrites, LAYOUT.num_shards) is None
    assert collected(target.rewrite, rewrites[:1], LAYOUT.num_shards) is None  # a shard missing


def test_a_retry_of_a_committed_rewrite_adds_nothing(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "t", mode="upsert")
    rewritten_commit(sink, rows([1, 2], [False, False], 1), 1)
    rewritten_commit(sink, rows([2, 3], [False, False], 2), 2)
    version = DeltaTable(str(tmp_path / "t")).version()
    again = rewritten_commit(sink, rows([2, 3], [False, False], 2), 2)
    assert again.skipped and DeltaTable(str(tmp_path / "t")).version() == version
    assert table_rows(sink) == [(1, 11.0), (2, 22.0), (3, 32.0)]

