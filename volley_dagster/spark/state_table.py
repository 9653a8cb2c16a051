"""A checkpoint root's state at any retained epoch as a Spark DataFrame, and the change
feed between two epochs: what Spark's ``statestore`` source and Flink's State
Processor API give their users, read the same way the epochs write it.

Each shard's snapshot is read by one Spark task (``mapInArrow`` over one row per
shard), in bounded Arrow batches, opened read-only (``checkpoint/state_reader.py``);
nothing is collected to the driver. On a cluster the tasks find the snapshots where
the epochs' own tasks do: the shared checkpoint root, or the snapshot store.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass
from functools import reduce
from pathlib import Path

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.checkpoint.state_reader import (
    KEY_GROUP,
    SHARD,
    ShardToRead,
    StateReader,
    StateView,
    recorded_reader,
    shards_to_read,
)
from volley_dagster.errors import ConfigError
from volley_dagster.operators.window import WINDOW_START
from volley_dagster.state.options import RocksDBOptions

CHANGE = "change"  # "added" | "changed" | "removed"
OLD, NEW = "old_", "new_"


@dataclass(frozen=True)
class ShardStateScan:
    """``mapInArrow`` over one row per shard: each id reads that shard's snapshot."""

    reader: StateReader
    shards: tuple[ShardToRead, ...]
    view: StateView

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                for table in self.reader.read(self.shards[index], self.view):
                    yield from table.to_batches()


class StateTables:
    """The state a checkpoint root's retained epochs hold, for debugging, audits and
    reconciliations: ``at(epoch)`` and ``changes(a, b)`` are lazy DataFrames."""

    def __init__(self, spark: SparkSession, log: EpochLog, reader: StateReader,
                 store: S3SnapshotStore | None = None) -> None:
        self.spark = spark
        self.log = log
        self.reader = reader
        self.store = store

    @classmethod
    def of_root(cls, spark: SparkSession, root: str | Path, *, store: S3SnapshotStore | None = None,
                cache_root: str = "", rocksdb: RocksDBOptions | None = None,
                verify_checksums: bool = False) -> StateTables:
        """From the checkpoint root alone: the operator and key are the ones it recorded."""
        log = EpochLog(root)
        reader = recorded_reader(log, store=store, cache_root=cache_root, rocksdb=rocksdb,
                                 verify_checksums=verify_checksums)
        return cls(spark, log, reader, store)

    @property
    def keys(self) -> list[str]:
        """The columns that identify one state row: the key, and for windows the window."""
        windowed = WINDOW_START in self.reader.schema("state").names
        return [self.reader.key_name] + ([WINDOW_START] if windowed else [])

    def at(self, epoch: int | None = None, view: StateView = "state") -> DataFrame:
        """The state as of committed epoch ``epoch`` (default: the last committed): one
        row per key (per open window for windows) with ``key_group`` and ``shard``; or
        with ``view="pending"`` a window operator's pending entries (key, window end)."""
        epoch = self._committed(epoch)
        shards = tuple(shards_to_read(self.log, epoch, self.store))
        schema = from_arrow_schema(self.reader.schema(view), prefer_timestamp_ntz=False)
        ids = self.spark.range(0, len(shards), 1, numPartitions=max(1, len(shards)))
        return ids.mapInArrow(ShardStateScan(self.reader, shards, view), schema)

    def changes(self, from_epoch: int, to_epoch: int) -> DataFrame:
        """What changed in the state from ``from_epoch`` to ``to_epoch``: one row per key
        added, changed or removed (``change``), with ``old_`` and ``new_`` values."""
        old, new = self.at(from_epoch), self.at(to_epoch)
        return state_changes(old, new, self.keys)

    def _committed(self, epoch: int | None) -> int:
        last = self.log.last_committed()
        if epoch is None:
            epoch = last
        if not 1 <= epoch <= last:
            raise ConfigError(f"epoch {epoch} is not committed in {self.log.root} (committed: 1..{last}); "
                              f"retained epochs: {self.log.retained_snapshots()}")
        return epoch


def state_changes(old: DataFrame, new: DataFrame, keys: list[str]) -> DataFrame:
    """The change feed between two state tables of one root, in one Spark join: values
    compare null-safely; a key's shard may differ (a rescale between them)."""
    ids = keys + [KEY_GROUP]
    values = [c for c in new.columns if c not in ids and c != SHARD]
    present = "_volley_present"

    def side(df: DataFrame, prefix: str) -> DataFrame:
        return df.select(*ids, *[F.col(c).alias(prefix + c) for c in values + [SHARD]], F.lit(True).alias(prefix + present))

    joined = side(old, OLD).join(side(new, NEW), on=ids, how="full_outer")
    differs = reduce(operator.or_, [~F.col(OLD + c).eqNullSafe(F.col(NEW + c)) for c in values], F.lit(False))
    change = (F.when(F.col(OLD + present).isNull(), "added").when(F.col(NEW + present).isNull(), "removed")
              .when(differs, "changed"))
    return joined.select(*ids, F.coalesce(F.col(NEW + SHARD), F.col(OLD + SHARD)).alias(SHARD), change.alias(CHANGE),
                         *[F.col(p + c) for c in values for p in (OLD, NEW)]).where(F.col(CHANGE).isNotNull())

