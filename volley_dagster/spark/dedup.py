"""Deduplication in an epoch's Spark work (the rules: ``operators/dedup.py``).

Each valid record is routed by its deduplication key to the shard that owns the key,
where ``DuplicateProbe`` marks the late records (against the watermark the epoch starts
from), reads epoch N-1's snapshot of that shard read-only and marks the duplicates
among the others; the kept keys become one run per key group
(``operators/dedup_state.py``), a few rows however many records were kept, which reach
the shard's state task, where ``Deduplicated`` remembers them in the shard's
transaction. Every attempt of an epoch probes the same snapshot with the same records
and the same watermark, so every attempt drops the same records. Two ways to run it:

- **In the state stage's job** (``probe_in_stage``, ``PlannedEpoch.probes_in_stage``):
  ``KeptRecords`` passes the kept records themselves on to the operator, with the runs,
  and tells every shard task the latest event time of its records (``ProbeTally``), by
  which they forget: one read of the records, no job before the stage.
- **In a job of its own** (``ProbeDuplicates``), when the shard tasks need W[N] before
  they start (a window or an event-time TTL after it) or the dropped records are
  written out: it returns the dropped records and the runs, cached and counted (or
  collected, for the duplicates side output) on the driver; the state stage then reads
  the records without the dropped ones (an anti-join on the log position).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.checkpoint.snapshots import SnapshotRef, on_this_machine
from volley_dagster.operators.dedup import (
    DEDUP_LATE,
    DROPPED_COLUMNS,
    DUPLICATES,
    Deduplication,
    ProbeTally,
    Verdicts,
    decide,
)
from volley_dagster.operators.dedup_state import read_remembered, runs_by_key_group
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.partitioning import per_shard, with_shard
from volley_dagster.spark.task_errors import engine_errors
from volley_dagster.spark.tasks import ShardMerge
from volley_dagster.state.keys import ShardLayout, key_kind
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.store import open_snapshot_read_only, verify_snapshot
from volley_dagster.state.transaction import ShardTransaction

_PROBED = [columns.SHARD, columns.KEY_GROUP, columns.DEDUP_KEY, columns.DEDUP_TIME, columns.POS]
_VERDICTS = [columns.DUPLICATE, columns.DEDUP_LATE]
# Up to this many dropped records, their positions and keys are broadcast to the anti-join
# (8 bytes and the key each), so the epoch's records are not shuffled to leave them out.
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

    @classmethod
    def of(cls, dedup: Deduplication, watermark: int | None, merge: ShardMerge) -> DuplicateProbe:
        """The probe of the epoch ``merge`` is for, against its N-1 snapshots."""
        return cls(dedup, watermark, merge.previous, merge.rocksdb, merge.verify_checksums, merge.remote,
                   merge.cache_root)

    def __call__(self, table: pa.Table) -> pa.Table:
        shard, keys, times, verdicts = self.verdicts(table)
        kept = verdicts.kept
        dropped = table.filter(pa.array(~kept)).select(_PROBED)
        dropped = (dropped.append_column(columns.DUPLICATE, pa.array(verdicts.duplicate[~kept]))
                   .append_column(columns.DEDUP_LATE, pa.array(verdicts.late[~kept]))
                   .append_column(columns.DEDUP_RUN, pa.nulls(dropped.num_rows, pa.binary())))
        runs = _runs(table, keys, times, kept)
        return _followed_by(dropped, len(runs), {columns.SHARD: [shard] * len(runs),
                                                 columns.KEY_GROUP: [g for g, _ in runs],
                                                 columns.DEDUP_RUN: [r for _, r in runs]})

    def verdicts(self, table: pa.Table) -> tuple[int, pa.Array, np.ndarray, Verdicts]:
        """The shard's records (``DEDUP_KEY``, ``POS``, ``DEDUP_TIME``) decided against
        N-1's snapshot of it: the shard, the keys, their event times and the verdicts."""
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
        return shard, keys, times, decide(self.dedup, remembered, keys, positions, times, self.watermark)


def _followed_by(table: pa.Table, n: int, values: dict[str, list]) -> pa.Table:
    """``table`` and ``n`` rows after it routed to their shards (runs, tallies): ``values``
    in the columns they name, nulls in the others."""
    more = pa.table([pa.array(values[f.name], f.type) if f.name in values else pa.nulls(n, f.type)
                     for f in table.schema], schema=table.schema)
    return pa.concat_tables([table, more])


def _runs(table: pa.Table, keys: pa.Array, times: np.ndarray, kept: np.ndarray) -> list[tuple[int, bytes]]:
    """The kept keys of a probe's shard, as one run per key group."""
    groups = table.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False).astype(np.int64)
    return runs_by_key_group(groups[kept], keys.filter(pa.array(kept)), times[kept])


@dataclass(frozen=True)
class KeptRecords:
    """Per shard, in the state stage's own job (``probe_in_stage``): the records it
    keeps, whole (``passed``, without a shard: the operator's key routes them next), its
    kept keys as runs, and a ``ProbeTally`` to every shard (``num_shards``)."""

    probe: DuplicateProbe
    passed: tuple[str, ...]
    num_shards: int

    def __call__(self, table: pa.Table) -> pa.Table:
        shard, keys, times, verdicts = self.probe.verdicts(table)
        kept = verdicts.kept
        records = table.select(list(self.passed)).filter(pa.array(kept))
        records = (records.append_column(columns.SHARD, pa.nulls(records.num_rows, pa.int32()))
                   .append_column(columns.KEY_GROUP, pa.nulls(records.num_rows, pa.int32()))
                   .append_column(columns.DEDUP_RUN, pa.nulls(records.num_rows, pa.binary())))
        runs = _runs(table, keys, times, kept)
        latest = int(times.max()) if len(times) else None
        own = ProbeTally(latest, int(verdicts.duplicate.sum()), int(verdicts.late.sum()))
        tallies = [(own if s == shard else ProbeTally(latest)).to_bytes() for s in range(self.num_shards)]
        return _followed_by(records, len(runs) + self.num_shards, {
            columns.SHARD: [shard] * len(runs) + list(range(self.num_shards)),
            columns.KEY_GROUP: [g for g, _ in runs] + [ProbeTally.key_group(shard)] * self.num_shards,
            columns.DEDUP_RUN: [r for _, r in runs] + tallies})


@dataclass(frozen=True)
class ProbeDuplicates:
    """The stage's pre-step (``operators/base.PreStep``) for a deduplication before an
    aggregate or window: the probe job, whose dropped records never reach the operator."""

    dedup: Deduplication

    def run(self, rows: DataFrame, layout: ShardLayout, watermark: int | None, merge: ShardMerge) -> ProbedEpoch:
        return probe_duplicates(rows, self.dedup, layout, DuplicateProbe.of(self.dedup, watermark, merge))


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
        """``rows`` without the dropped ones (duplicates and late), and without their key:
        a dropped row is its position and key, since a transform that explodes a record
        gives rows of one position other keys, each decided on its own."""
        if not self.duplicates and not self.late:
            return rows.drop(columns.DEDUP_KEY)
        dropped = self.probed.where(_dropped()).select(columns.POS, columns.DEDUP_KEY)
        if self.duplicates + self.late <= BROADCAST_DROPPED_MAX:
            dropped = F.broadcast(dropped)
        return rows.join(dropped, [columns.POS, columns.DEDUP_KEY], "left_anti").drop(columns.DEDUP_KEY)

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
    routed = with_shard(narrow, layout, columns.DEDUP_KEY)
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


def probe_in_stage(rows: DataFrame, dedup: Deduplication, layout: ShardLayout, probe: DuplicateProbe,
                   reads: tuple[str, ...] | None) -> DataFrame:
    """The epoch's valid ``rows`` (with ``DEDUP_KEY``) routed by their deduplication key
    to ``KeptRecords``, in the job that ends in the shard tasks (nothing runs here): the
    kept records come out with the columns the operator ``reads`` only (None: all but
    ``DEDUP_KEY``; the others are neither shuffled nor handed to Python and back),
    followed by the runs and tallies with their shard
    (``partitioning.route_to_shards(kept_inline=True)``)."""
    passed = tuple(c for c in rows.columns if c not in (columns.DEDUP_KEY, columns.SHARD, columns.KEY_GROUP)
                   and (reads is None or c in reads))
    timed = rows.withColumn(columns.DEDUP_TIME, dedup.event_time.event_us()).select(
        *dict.fromkeys([*passed, columns.DEDUP_KEY, columns.DEDUP_TIME, columns.POS]))
    routed = with_shard(timed, layout, columns.DEDUP_KEY)
    schema = T.StructType([T.StructField(c, rows.schema[c].dataType, True) for c in passed] + [
        T.StructField(columns.SHARD, T.IntegerType(), True), T.StructField(columns.KEY_GROUP, T.IntegerType(), True),
        T.StructField(columns.DEDUP_RUN, T.BinaryType(), True)])
    return per_shard(routed.repartition(layout.num_shards, columns.PARTITION),
                     KeptRecords(probe, passed, layout.num_shards), schema)
