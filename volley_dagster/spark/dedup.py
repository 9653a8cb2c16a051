"""Deduplication in an epoch's Spark work (the rules: ``operators/dedup.py``).

One job routes each valid record's (deduplication key, log position, event time) to
the shard that owns the key and runs ``DuplicateProbe`` there: it marks the late
records (against the watermark the epoch starts from), reads epoch N-1's snapshot of
that shard read-only and marks the duplicates among the others. It returns the dropped
records and the kept keys as one run per key group (``operators/dedup_state.py``), a
few rows however many records were kept. Its result is cached and counted (or
collected, for the duplicates side output) on the driver. The epoch's state stage
then reads the records without the dropped ones (an anti-join on the log position)
and sends the runs to their shards, where ``Deduplicated`` remembers their keys in the
shard's transaction. Every attempt of an epoch probes the same snapshot
with the same records and the same watermark, so every attempt drops the same records.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from volley_dagster import columns
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.checkpoint.snapshots import SnapshotRef, on_this_machine
from volley_dagster.operators.dedup import DEDUP_FIGURES, DEDUP_LATE, DROPPED_COLUMNS, DUPLICATES, Deduplication, decide
from volley_dagster.operators.dedup_state import read_remembered, runs_by_key_group
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.partitioning import partition_of_shard, per_shard, with_shard
from volley_dagster.spark.task_errors import engine_errors
from volley_dagster.spark.tasks import ShardMerge
from volley_dagster.state.keys import ShardLayout, key_kind
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.store import open_snapshot_read_only, verify_snapshot
from volley_dagster.state.transaction import ShardTransaction

_PROBED = [columns.SHARD, columns.KEY_GROUP, columns.DEDUP_KEY, columns.DEDUP_TIME, columns.POS]
_VERDICTS = [columns.DUPLICATE, columns.DEDUP_LATE]
# Up to this many dropped records, their positions are broadcast to the anti-join (8 bytes
# each), so the epoch's records are not shuffled by position to leave them out.
BROADCAST_DROPPED_MAX = 4_000_000


@dataclass(frozen=True)
class DuplicateProbe:
    """Per shard (``per_shard``): which of its records are late (against ``watermark``,
    the one the epoch starts from) and which repeat a key, against N-1's snapshot."""

    dedup: Deduplication
    watermark: int | None
    previous: dict[int, SnapshotRef]
    rocksdb: RocksDBOptions
    verify_checksums: bool
    remote: S3SnapshotStore | None = None
    cache_root: str = ""

    def __call__(self, table: pa.Table) -> pa.Table:
        shard = table.column(columns.SHARD)[0].as_py()
        keys = table.column(columns.DEDUP_KEY).combine_chunks()
        positions = table.column(columns.POS).to_numpy(zero_copy_only=False)
        times = table.column(columns.DEDUP_TIME).to_numpy(zero_copy_only=False).astype(np.int64)
        prev = self.previous.get(shard)
        remembered = None
        with on_this_machine(prev, self.remote, self.cache_root) as (path, _):
            if path is not None and prev is not None:
                verify_snapshot(path, prev.files, full=self.verify_checksums)
                db = open_snapshot_read_only(path, self.rocksdb)
                try:
                    remembered = read_remembered(ShardTransaction(db), key_kind(keys.type))
                finally:
                    db.close()
        verdicts = decide(self.dedup, remembered, keys, positions, times, self.watermark)
        kept = verdicts.kept
        dropped = table.filter(pa.array(~kept)).select(_PROBED)
        dropped = (dropped.append_column(columns.DUPLICATE, pa.array(verdicts.duplicate[~kept]))
                   .append_column(columns.DEDUP_LATE, pa.array(verdicts.late[~kept]))
                   .append_column(columns.DEDUP_RUN, pa.nulls(dropped.num_rows, pa.binary())))
        groups = table.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False).astype(np.int64)
        runs = runs_by_key_group(groups[kept], keys.filter(pa.array(kept)), times[kept])
        n = len(runs)
        schema = dropped.schema
        filled = {columns.SHARD: np.full(n, shard), columns.KEY_GROUP: [g for g, _ in runs],
                  columns.DEDUP_RUN: [r for _, r in runs]}
        run_rows = pa.table([pa.array(filled[f.name], f.type) if f.name in filled else pa.nulls(n, f.type)
                             for f in schema], schema=schema)
        return pa.concat_tables([dropped, run_rows])


@dataclass(frozen=True)
class ProbeDuplicates:
    """The stage's pre-step (``operators/base.PreStep``) for a deduplication before an
    aggregate or window: the probe job, whose dropped records never reach the operator."""

    dedup: Deduplication
    figure_names: tuple[str, ...] = DEDUP_FIGURES

    def run(self, rows: DataFrame, layout: ShardLayout, watermark: int | None, merge: ShardMerge) -> ProbedEpoch:
        probe = DuplicateProbe(self.dedup, watermark, merge.previous, merge.rocksdb, merge.verify_checksums,
                               merge.remote, merge.cache_root)
        return probe_duplicates(rows, self.dedup, layout, probe)


@dataclass
class ProbedEpoch:
    """The probe's verdicts, cached until the state stage has read them."""

    dedup: Deduplication
    probed: DataFrame
    duplicates: int
    late: int
    dropped_records: pa.Table | None  # POS, DEDUP_KEY, DEDUP_TIME, DEDUP_LATE of each dropped record (side output on)

    @property
    def figures(self) -> dict[str, int]:
        return {DUPLICATES: self.duplicates, DEDUP_LATE: self.late}

    def remaining(self, rows: DataFrame) -> DataFrame:
        """``rows`` without the dropped ones (duplicates and late), and without their key."""
        if not self.duplicates and not self.late:
            return rows.drop(columns.DEDUP_KEY)
        dropped = self.probed.where(_dropped()).select(columns.POS)
        if self.duplicates + self.late <= BROADCAST_DROPPED_MAX:
            dropped = F.broadcast(dropped)
        return rows.join(dropped, columns.POS, "left_anti").drop(columns.DEDUP_KEY)

    def dropped(self, rng: EpochRange) -> pa.Table | None:
        return None if self.dropped_records is None else self.dedup.side_output(self.dropped_records, rng)

    def routed(self) -> DataFrame:
        """The kept keys, one run per key group (with its shard), for ``to_shards(routed=...)``:
        they reach their shard task in the state stage's own exchange, grouped apart
        from the partials by ``partitioning.KEPT_KEY_COLUMNS``."""
        return self.probed.where(F.col(columns.DEDUP_RUN).isNotNull()).select(
            columns.SHARD, columns.KEY_GROUP, columns.DEDUP_RUN)

    def release(self) -> None:
        self.probed.unpersist()


def _dropped() -> Column:
    return F.col(columns.DUPLICATE) | F.col(columns.DEDUP_LATE)


def probe_duplicates(rows: DataFrame, dedup: Deduplication, layout: ShardLayout, probe: DuplicateProbe) -> ProbedEpoch:
    """Run the probe job over the epoch's valid ``rows`` (with ``DEDUP_KEY``)."""
    narrow = rows.select(columns.POS, columns.DEDUP_KEY, dedup.event_time.event_us().alias(columns.DEDUP_TIME))
    routed = with_shard(narrow, layout, columns.DEDUP_KEY).withColumn(columns.PARTITION, partition_of_shard(layout))
    key_type = rows.schema[columns.DEDUP_KEY].dataType.simpleString()
    schema = (f"`{columns.SHARD}` int, `{columns.KEY_GROUP}` int, `{columns.DEDUP_KEY}` {key_type}, "
              f"`{columns.DEDUP_TIME}` bigint, `{columns.POS}` bigint, `{columns.DUPLICATE}` boolean, "
              f"`{columns.DEDUP_LATE}` boolean, `{columns.DEDUP_RUN}` binary")
    probed = per_shard(routed.repartition(layout.num_shards, columns.PARTITION), probe, schema)
    probed = probed.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        with engine_errors():
            if dedup.write_duplicates:
                dropped = probed.where(_dropped()).select(*DROPPED_COLUMNS).toArrow()
                late = int(pc.sum(dropped.column(columns.DEDUP_LATE).cast(pa.int64())).as_py() or 0)
                return ProbedEpoch(dedup, probed, dropped.num_rows - late, late, dropped)
            counts = probed.agg(*[F.sum(F.col(c).cast("long")).alias(c) for c in _VERDICTS]).first()
            return ProbedEpoch(dedup, probed, int(counts[0] or 0) if counts else 0, int(counts[1] or 0) if counts else 0,
                               None)
    except BaseException:
        probed.unpersist()
        raise
