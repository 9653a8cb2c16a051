"""Routing rows to shard tasks: one exchange, one shard per Spark partition, and a
clear error if a plan ever put two shards in one partition."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from py4j.clientserver import ClientServerConnection
from pyspark.sql import functions as F

from volley_dagster import columns
from volley_dagster.checkpoint.manifest import ShardEntry, ShardSnapshot
from volley_dagster.errors import VolleyError
from volley_dagster.spark.partitioning import ROUTING_COLUMNS, _OnePartitionOneShard, per_shard, to_shards
from volley_dagster.spark.stage import shard_entries
from volley_dagster.state.keys import ShardLayout


def _describe(table: pa.Table) -> pa.Table:
    """One row per shard task: its shard, rows, marker rows and keys."""
    marker = table.column(columns.MARKER).fill_null(False)
    summary = {"shard": table.column(columns.SHARD)[0].as_py(), "rows": table.num_rows,
               "markers": sum(marker.to_pylist()), "keys": sorted(k for k in table.column(columns.KEY).to_pylist()
                                                                  if k is not None)}
    return pa.table({"summary": [json.dumps(summary)]})


@pytest.mark.parametrize("num_shards", [3, 4])
def test_each_shard_task_gets_exactly_its_keys_after_one_exchange_and_no_sort(spark, num_shards):
    layout = ShardLayout(num_shards=num_shards)
    rows = spark.range(5000).select((F.col("id") % 1234).alias(columns.KEY), F.lit(1).alias("n"))
    routed = to_shards(rows, layout).groupBy(columns.PARTITION, columns.SHARD, columns.KEY_GROUP, columns.MARKER,
                                             columns.KEY).agg(F.sum("n").alias("n"))
    tasks = per_shard(routed, _describe, "summary string")

    plan = tasks._jdf.queryExecution().executedPlan().toString()
    assert plan.count("Exchange") == 1, plan
    assert "Sort " not in plan, plan

    summaries = [json.loads(v) for v in tasks.toArrow().column("summary").to_pylist()]
    assert sorted(s["shard"] for s in summaries) == list(range(num_shards))  # each shard once
    assert all(s["markers"] == 1 for s in summaries)
    expected = (to_shards(rows, layout).where(F.col(columns.KEY).isNotNull())
                .select(columns.SHARD, columns.KEY).distinct().toArrow())
    assert expected.num_rows == 1234
    pairs = list(zip(expected.column(columns.SHARD).to_pylist(), expected.column(columns.KEY).to_pylist(), strict=True))
    by_shard = {s: sorted(k for sh, k in pairs if sh == s) for s in range(num_shards)}
    assert {s["shard"]: s["keys"] for s in summaries} == by_shard


def test_planning_sends_the_jvm_no_python_call_sites(spark, monkeypatch):
    """The engine's session turns PySpark 4's capture of each Column function's Python
    call site off (``default_conf``): it cost ten more round trips to the JVM a call."""
    sent: list[str] = []
    send = ClientServerConnection.send_command

    def recorded(connection: ClientServerConnection, command: str) -> str:
        sent.append(command)
        return send(connection, command)

    monkeypatch.setattr(ClientServerConnection, "send_command", recorded)
    rows = spark.range(100).select((F.col("id") % 7).alias(columns.KEY), F.lit(1).alias("n"))
    to_shards(rows, ShardLayout(4)).groupBy(*ROUTING_COLUMNS, columns.KEY).agg(F.sum("n").alias("n"))
    assert len(sent) > 10  # the plan was built through py4j
    assert not [c for c in sent if "PySparkCurrentOrigin" in c]


def test_a_partition_holding_two_shards_is_refused_naming_them():
    batch = pa.record_batch({columns.SHARD: pa.array([1, 1, 2], pa.int32()), columns.KEY: [7, 8, 9]})
    task = _OnePartitionOneShard(lambda table: table)
    with pytest.raises(VolleyError, match="shards 1 to 2"):
        list(task(iter([batch])))
    assert list(task(iter([]))) == []  # an empty partition: no task call, no rows
    assert list(task(iter([batch.slice(0, 0)]))) == []  # nor one that arrives as empty batches
    assert [b.num_rows for b in task(iter([batch.slice(0, 2)]))] == [2]


def test_a_shard_that_ran_in_two_tasks_is_refused():
    def stats(shard: int) -> str:
        entry = ShardEntry(shard, ShardSnapshot(f"snapshots/3/shard-{shard}", {}, 0, "a1"), "multi_get", records=5)
        return json.dumps(entry.to_dict())

    assert sorted(shard_entries([stats(0), stats(1)], epoch=3)) == [0, 1]
    with pytest.raises(VolleyError, match=r"epoch 3: shard tasks ran for shards \[0, 1, 1\]: a shard ran more than once"):
        shard_entries([stats(1), stats(0), stats(1)], epoch=3)
