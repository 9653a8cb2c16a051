"""Deduplication in an epoch's Spark work (the rules: ``operators/dedup.py``).

One job routes each valid record's (deduplication key, log position, event time) to
the shard that owns the key and runs ``DuplicateProbe`` there: it reads epoch N-1's
snapshot of that shard read-only and marks the duplicates. Its result is cached and
counted (or collected, for the duplicates side output) on the driver. The epoch's
state stage then reads the records without the duplicates (an anti-join on the log
position) and sends the kept keys to their shards, where ``Deduplicated`` remembers
them in the shard's transaction. Every attempt of an epoch probes the same snapshot
with the same records, so every attempt drops the same records.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from volley_dagster import columns
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.operators.dedup import INTERNAL_OUT, Deduplication, ResolvedUniqueRecords, find_duplicates
from volley_dagster.spark.partitioning import partition_of_shard, per_shard, to_shards, with_shard
from volley_dagster.spark.task_errors import engine_errors
from volley_dagster.spark.tasks import PreviousSnapshot, previous_on_this_machine
from volley_dagster.state.keys import ShardLayout
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.store import open_snapshot_read_only, verify_snapshot
from volley_dagster.state.transaction import ShardTransaction

_PROBED = [columns.SHARD, columns.KEY_GROUP, columns.DEDUP_KEY, columns.DEDUP_TIME, columns.POS]
KEPT_KEY_COLUMNS = [columns.DEDUP_KEY, columns.DEDUP_TIME]  # null on the records' rows


@dataclass(frozen=True)
class DuplicateProbe:
    """Per shard (``per_shard``): which of its records repeat a key, against N-1's snapshot."""

    previous: dict[int, PreviousSnapshot]
    rocksdb: RocksDBOptions
    verify_checksums: bool
    remote: S3SnapshotStore | None = None
    cache_root: str = ""

    def __call__(self, table: pa.Table) -> pa.Table:
        shard = table.column(columns.SHARD)[0].as_py()
        key_groups = table.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False).astype(np.int64)
        keys = table.column(columns.DEDUP_KEY).combine_chunks()
        positions = table.column(columns.POS).to_numpy(zero_copy_only=False)
        prev = self.previous.get(shard)
        with previous_on_this_machine(shard, prev, self.remote, self.cache_root) as (path, _):
            if path is None or prev is None:
                duplicate = find_duplicates(None, key_groups, keys, positions)
            else:
                verify_snapshot(path, prev.files, full=self.verify_checksums)
                db = open_snapshot_read_only(path, self.rocksdb)
                try:
                    duplicate = find_duplicates(ShardTransaction(db), key_groups, keys, positions)
                finally:
                    db.close()
        return table.select(_PROBED).append_column(columns.DUPLICATE, pa.array(duplicate))


@dataclass
class ProbedEpoch:
    """The probe's verdicts, cached until the state stage has read them."""

    probed: DataFrame
    duplicates: int
    dropped: pa.Table | None  # POS, DEDUP_KEY, DEDUP_TIME of each duplicate (when the side output is on)

    def unique(self, rows: DataFrame) -> DataFrame:
        """``rows`` without the duplicates."""
        if not self.duplicates:
            return rows
        dropped = self.probed.where(F.col(columns.DUPLICATE)).select(columns.POS)
        return rows.join(dropped, columns.POS, "left_anti")

    def kept_keys(self) -> DataFrame:
        """One row per kept key, with its key group and shard, for ``to_shards(routed=...)``:
        they reach their shard task in the state stage's own exchange, grouped apart
        from the partials by ``KEPT_KEY_COLUMNS``."""
        return self.probed.where(~F.col(columns.DUPLICATE)).drop(columns.DUPLICATE, columns.POS)

    def release(self) -> None:
        self.probed.unpersist()


def probe_duplicates(rows: DataFrame, dedup: Deduplication, layout: ShardLayout, probe: DuplicateProbe) -> ProbedEpoch:
    """Run the probe job over the epoch's valid ``rows`` (with ``DEDUP_KEY``)."""
    narrow = rows.select(columns.POS, columns.DEDUP_KEY, dedup.event_time.event_us().alias(columns.DEDUP_TIME))
    routed = with_shard(narrow, layout, columns.DEDUP_KEY).withColumn(columns.PARTITION, partition_of_shard(layout))
    key_type = rows.schema[columns.DEDUP_KEY].dataType.simpleString()
    schema = (f"`{columns.SHARD}` int, `{columns.KEY_GROUP}` int, `{columns.DEDUP_KEY}` {key_type}, "
              f"`{columns.DEDUP_TIME}` bigint, `{columns.POS}` bigint, `{columns.DUPLICATE}` boolean")
    probed = per_shard(routed.repartition(layout.num_shards, columns.PARTITION), probe, schema)
    probed = probed.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        with engine_errors():
            duplicates = probed.where(F.col(columns.DUPLICATE))
            if dedup.write_duplicates:
                dropped = duplicates.select(columns.POS, columns.DEDUP_KEY, columns.DEDUP_TIME).toArrow()
                return ProbedEpoch(probed, dropped.num_rows, dropped)
            return ProbedEpoch(probed, duplicates.count(), None)
    except BaseException:
        probed.unpersist()
        raise


def route_records(rows: DataFrame, unique: ResolvedUniqueRecords, layout: ShardLayout) -> DataFrame:
    """A pipeline that only deduplicates: each record (its columns, position and event
    time) in the partition of the shard that owns its key, marker rows included."""
    needed = [columns.KEY, columns.POS, *unique.columns]
    narrow = rows.select(*needed, unique.dedup.event_time.event_us().alias(columns.DEDUP_TIME),
                         F.lit(1).alias(columns.ROWS))
    return to_shards(narrow, layout)


def split_duplicates(output: pa.Table, unique: ResolvedUniqueRecords) -> tuple[pa.Table, pa.Table | None]:
    """The shard tasks' rows as the kept records, and with ``write_duplicates`` the
    dropped ones (position, key, event time) for the side output."""
    if not unique.dedup.write_duplicates:
        return output, None
    flags = output.column(columns.DUPLICATE)
    dropped = output.filter(flags).select([columns.POS, columns.DEDUP_KEY, columns.DEDUP_TIME])
    return output.filter(pc.invert(flags)).drop_columns(list(INTERNAL_OUT)), dropped
