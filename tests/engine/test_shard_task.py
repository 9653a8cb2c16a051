"""A shard task's rows leave it sorted by the pipeline's output keys, then its stats
row: the driver's sort of the epoch then only merges the shards' runs. A local Spark's
task leaves its rows in a file for the driver instead, and they read back the same.
Spark-free: the task is called as Spark's ``mapInArrow`` would, on one shard's partials."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pytest

from volley_dagster import columns
from volley_dagster.errors import VolleyError
from volley_dagster.operators.accumulators import Count, Sum
from volley_dagster.operators.aggregate import ResolvedAggregate
from volley_dagster.operators.base import ShardStep
from volley_dagster.spark.tasks import ShardMerge, read_rows, split_task_output, task_files
from volley_dagster.state.keys import ShardLayout
from volley_dagster.state.options import RocksDBOptions

AGGREGATE = ResolvedAggregate((("events", Count()), ("total", Sum("amount"))), (None, "float"), 1)


def _named(keys: np.ndarray) -> pa.Array:
    """String keys whose order is not their numbers' (``m-9`` after ``m-10``)."""
    return pa.array([f"m-{k}" for k in keys.tolist()], pa.string())


def _partials(keys: np.ndarray, shard: int, kind: str) -> pa.Table:
    """One shard's partials as the exchange delivers them: in no order, key groups
    unrelated to the keys' order, and the shard's marker row."""
    n = len(keys)
    key_values = pa.array(keys, pa.int64()) if kind == "int" else _named(keys)
    marker = pa.table({columns.SHARD: pa.array([shard], pa.int32()), columns.KEY_GROUP: pa.nulls(1, pa.int32()),
                       columns.MARKER: [True], columns.KEY: pa.nulls(1, key_values.type), columns.ROWS: pa.nulls(1, pa.int64()),
                       "events:n": pa.nulls(1, pa.int64()), "total:v": pa.nulls(1, pa.float64())})
    rows = pa.table({columns.SHARD: pa.array(np.full(n, shard), pa.int32()),
                     columns.KEY_GROUP: pa.array((keys * 2654435761) % 64, pa.int32()),
                     columns.MARKER: pa.nulls(n, pa.bool_()), columns.KEY: key_values,
                     columns.ROWS: pa.array(keys % 5 + 1, pa.int64()), "events:n": pa.array(keys % 5 + 1, pa.int64()),
                     "total:v": pa.array(keys * 0.5)})
    return pa.concat_tables([rows, marker])


def _task(root, kind: str, rows_folder: str = "") -> ShardMerge:
    return ShardMerge(
        step=ShardStep(1, kind, layout=ShardLayout(num_shards=1)), key_column="merchant_id",
        output_keys=("merchant_id",), operator=AGGREGATE, previous={}, snapshot_root=str(root / "snapshots"),
        work_root=str(root / "work"), rocksdb=RocksDBOptions(), scan_fraction=0.5, verify_checksums=False,
        driver_pid=os.getpid(), rows_folder=rows_folder,
    )


@pytest.mark.parametrize("kind", ["int", "str"])
def test_a_shard_tasks_rows_leave_in_output_key_order_then_its_stats_row(tmp_path, kind):
    rng = np.random.default_rng(11)
    keys = rng.permutation(rng.choice(1_000_000, 5_000, replace=False)).astype(np.int64)
    out = _task(tmp_path, kind)(_partials(keys, 0, kind))

    assert out.column(columns.STATS)[out.num_rows - 1].is_valid  # the stats row is last
    stats, rows = split_task_output(out)
    assert json.loads(stats[0])["shard"] == 0 and json.loads(stats[0])["records"] == int((keys % 5 + 1).sum())
    got = rows.column("merchant_id").to_pylist()
    names = keys.tolist() if kind == "int" else _named(keys).to_pylist()
    assert got == sorted(names)  # every key once, ascending
    # in the state's own order (key group, key) the same rows would not be
    key_groups = (keys * 2654435761) % 64
    assert [names[i] for i in sorted(range(len(names)), key=lambda i: (key_groups[i], names[i]))] != got
    number_of = dict(zip(names, keys.tolist(), strict=True))
    numbers = np.array([number_of[name] for name in got])
    assert rows.column("events").to_pylist() == (numbers % 5 + 1).tolist()
    assert rows.column("total").to_pylist() == (numbers * 0.5).tolist()


def test_a_local_sparks_task_leaves_its_rows_in_a_file_the_driver_reads_back_alike(tmp_path):
    keys = np.random.default_rng(5).choice(100_000, 2_000, replace=False).astype(np.int64)
    through_spark = split_task_output(_task(tmp_path / "a", "int")(_partials(keys, 0, "int")))[1]
    folder = tmp_path / "b" / "rows"
    out = _task(tmp_path / "b", "int", str(folder))(_partials(keys, 0, "int"))

    assert out.num_rows == 1  # the stats row alone travels through Spark
    stats, rows = split_task_output(out)
    stats, files = task_files(stats)
    assert rows.num_rows == 0 and len(files.rows) == 1 and "rows_file" not in json.loads(stats[0])
    assert json.loads(stats[0])["records"] == int((keys % 5 + 1).sum())
    read = read_rows(rows.schema, folder, files.rows)
    assert read.schema == through_spark.schema and read.equals(through_spark)

    (folder / files.rows[0]).unlink()  # cleared meanwhile: the epoch fails, naming the file, and commits nothing
    with pytest.raises(VolleyError, match=rf"{files.rows[0]}.*is gone; nothing was committed"):
        read_rows(rows.schema, folder, files.rows)
