"""Routing rows to state shards inside Spark, with one shuffle per epoch.

A shard is a contiguous range of key groups (``state/keys.py``). To send every
row of a shard to one Spark partition, and only that shard's rows, the epoch
repartitions by a small integer per shard chosen so that Spark's own hash
partitioning (``pmod(murmur3(value, 42), n)``) puts shard ``s`` in partition
``s``. The per-key aggregation after that exchange finds its rows already in
place, so Spark plans no second exchange; and each partition is one shard task,
handed its rows by ``per_shard`` (a ``mapInArrow``, which unlike
``groupBy().applyInArrow`` has nothing to sort first).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from volley_dagster import columns
from volley_dagster.columns import sql_identifier
from volley_dagster.errors import VolleyError
from volley_dagster.state.keys import ShardLayout

_SEED = 42  # Spark's HashPartitioning seed


def murmur3_int(value: int, seed: int = _SEED) -> int:
    """Spark's ``Murmur3_x86_32.hashInt``: what ``hash(int)`` and hash partitioning compute."""
    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF

    k = rotl((value * 0xCC9E2D51) & 0xFFFFFFFF, 15)
    k = (k * 0x1B873593) & 0xFFFFFFFF
    h = rotl(seed ^ k, 13)
    h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= 4  # the input length in bytes
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h - (1 << 32) if h >= 1 << 31 else h


@lru_cache(maxsize=64)
def partition_values(num_shards: int) -> tuple[int, ...]:
    """For each shard, the smallest non-negative int that Spark hash-partitions into it."""
    found: dict[int, int] = {}
    value = 0
    while len(found) < num_shards:
        found.setdefault(murmur3_int(value) % num_shards, value)
        value += 1
    return tuple(found[s] for s in range(num_shards))


def with_shard(df: DataFrame, layout: ShardLayout, key: str = columns.KEY, keep: bool = False) -> DataFrame:
    """Key group (a stable hash of the key column ``key``), shard (its range) and the
    partition Spark's hash partitioning puts the shard in, as Spark expressions; ``keep``:
    rows that have them already keep theirs. SQL text, one plan change: each ``F`` call
    and each ``withColumn`` is a round trip to the JVM, and an epoch plans a dozen of them."""
    key_group = f"cast(pmod(xxhash64({sql_identifier(key)}), {layout.num_key_groups}) as int)"
    shard = f"cast(({key_group} * {layout.num_shards}) div {layout.num_key_groups} as int)"
    if keep:
        key_group, shard = f"coalesce({columns.KEY_GROUP}, {key_group})", f"coalesce({columns.SHARD}, {shard})"
    return df.withColumns({columns.KEY_GROUP: F.expr(key_group), columns.SHARD: F.expr(shard),
                           columns.PARTITION: F.expr(partition_of_shard(shard, layout))})


def partition_of_shard(shard: str, layout: ShardLayout) -> str:
    """The partition of the shard that the SQL expression ``shard`` gives, as SQL text."""
    values = ", ".join(map(str, partition_values(layout.num_shards)))
    return f"element_at(array({values}), {shard} + 1)"


def shard_markers(df: DataFrame, layout: ShardLayout) -> DataFrame:
    """``df`` (routed by ``with_shard``) plus one marker row per shard, so every shard task
    runs (and snapshots) even when the epoch has no rows for it. A table of literals,
    planned in one step."""
    rows = ", ".join(f"({shard}, true, {partition})" for shard, partition in enumerate(partition_values(layout.num_shards)))
    markers = df.sparkSession.sql(
        f"SELECT * FROM VALUES {rows} AS markers({columns.SHARD}, {columns.MARKER}, {columns.PARTITION})")
    return df.unionByName(markers, allowMissingColumns=True)


# What ``to_shards`` adds: an aggregate grouping by these (and its own keys) finds its
# rows already in place, and Spark plans no second exchange.
ROUTING_COLUMNS = [columns.PARTITION, columns.SHARD, columns.KEY_GROUP, columns.MARKER]
KEPT_KEY_COLUMNS = [columns.DEDUP_RUN]  # a deduplication's kept keys, a run per key group; null on the records' rows


@dataclass(frozen=True)
class ShardRoute:
    """The epoch's rows after its one exchange: each shard's rows (marker row included)
    in that shard's partition. ``grouping``: what a pre-aggregation groups by besides
    the operator's own keys, so that Spark finds the rows in place and plans no second
    exchange (a deduplication's kept keys, routed with them, group apart)."""

    rows: DataFrame
    grouping: tuple[str, ...]


def route_to_shards(rows: DataFrame, layout: ShardLayout, kept: DataFrame | None = None,
                    kept_inline: bool = False) -> ShardRoute:
    """``rows`` (keyed) to their shards, in one exchange; ``kept``: more rows that carry
    their own key group and shard (a deduplication's kept keys), in the same exchange;
    ``kept_inline``: such rows are among ``rows`` already (a probe in the same job)."""
    grouping = ROUTING_COLUMNS + (KEPT_KEY_COLUMNS if kept is not None or kept_inline else [])
    return ShardRoute(to_shards(rows, layout, kept, kept_inline), tuple(grouping))


def to_shards(rows: DataFrame, layout: ShardLayout, routed: DataFrame | None = None, routed_inline: bool = False
              ) -> DataFrame:
    """Keyed rows, one Spark partition per shard (marker rows included); ``routed``:
    rows with their own key group and shard, in the same exchange (``routed_inline``:
    among ``rows``, which keep theirs)."""
    keyed = with_shard(rows, layout, keep=routed_inline)
    if routed is not None:
        routed = routed.withColumn(columns.PARTITION, F.expr(partition_of_shard(columns.SHARD, layout)))
        keyed = keyed.unionByName(routed, allowMissingColumns=True)
    return shard_markers(keyed, layout).repartition(layout.num_shards, columns.PARTITION)


@dataclass(frozen=True)
class _OnePartitionOneShard:
    """``mapInArrow``: the partition's rows as one table, to ``task`` (none: an empty partition)."""

    task: Callable[[pa.Table], pa.Table]

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        received = [batch for batch in batches if batch.num_rows]
        if not received:
            return
        # one chunk per column: the tasks sort, take and filter it whole, and Arrow does
        # those about 1.3-1.8x faster on one chunk than on Spark's 10k-row batches
        table = pa.Table.from_batches(received).combine_chunks()
        shards = pc.min_max(table.column(columns.SHARD))
        if shards["min"] != shards["max"]:
            raise VolleyError(
                f"one Spark partition holds the rows of shards {shards['min']} to {shards['max']}: it must hold one "
                "shard's only (spark/partitioning.py); nothing was committed. Was the plan changed to coalesce partitions?"
            )
        yield from self.task(table).to_batches()


def per_shard(partitioned: DataFrame, task: Callable[[pa.Table], pa.Table], schema: str | StructType) -> DataFrame:
    """``task`` once per shard, over its rows as one Arrow table, on rows routed by
    ``to_shards`` (or repartitioned by ``PARTITION`` as it does)."""
    return partitioned.mapInArrow(_OnePartitionOneShard(task), schema)
