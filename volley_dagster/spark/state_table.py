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
from volley_dagster.checkpoint.snapshots import SnapshotRef
from volley_dagster.checkpoint.state_reader import (
    KEY_GROUP,
    SHARD,
    ReadSettings,
    StateReader,
    StateView,
    recorded_reader,
    shards_to_read,
)
from volley_dagster.errors import ConfigError
from volley_dagster.operators.window import WINDOW_START

CHANGE = "change"  # "added" | "changed" | "removed"
OLD, NEW = "old_", "new_"


@dataclass(frozen=True)
class ShardStateScan:
    """``mapInArrow`` over one row per shard: each id reads that shard's snapshot."""

    reader: StateReader
    shards: tuple[SnapshotRef, ...]
    view: StateView

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                for table in self.reader.read(self.shards[index], self.view):
                    yield from table.to_batches()


class StateTables:
    """The state a checkpoint root's retained epochs hold, for debugging, audits and
    reconciliations: ``at(epoch)`` and ``changes(a, b)`` are lazy DataFrames. Each
    epoch is decoded by the operator that wrote it (a migration changes it)."""

    def __init__(self, spark: SparkSession, root: str | Path, settings: ReadSettings | None = None) -> None:
        self.spark = spark
        self.log = EpochLog(root)
        self.settings = settings or ReadSettings()

    def reader(self, epoch: int | None = None) -> StateReader:
        return recorded_reader(self.log, self._committed(epoch), self.settings)

    def keys(self, epoch: int | None = None) -> list[str]:
        """The columns that identify one state row: the key, and for windows the window
        (a processor's: its variable and the row's index there)."""
        reader = self.reader(epoch)
        names = reader.schema("state").names
        # the decoded key column: the recorded key, or a dedup key over several columns (``dedup_key``)
        key = reader.key_name if reader.key_name in names else names[0]
        rows = getattr(reader.operator, "state_row_keys", ())
        return [key] + ([WINDOW_START] if WINDOW_START in names else []) + list(rows)

    def at(self, epoch: int | None = None, view: StateView = "state") -> DataFrame:
        """The state as of committed epoch ``epoch`` (default: the last committed): one
        row per key (per open window for windows) with ``key_group`` and ``shard``; or
        with ``view="pending"`` a window operator's pending entries (key, window end)."""
        epoch = self._committed(epoch)
        reader = self.reader(epoch)
        schema = from_arrow_schema(reader.schema(view), prefer_timestamp_ntz=False)
        shards = tuple(shards_to_read(self.log, epoch, self.settings.store))
        ids = self.spark.range(0, len(shards), 1, numPartitions=max(1, len(shards)))
        return ids.mapInArrow(ShardStateScan(reader, shards, view), schema)

    def changes(self, from_epoch: int, to_epoch: int) -> DataFrame:
        """What changed in the state from ``from_epoch`` to ``to_epoch``: one row per key
        added, changed or removed (``change``), with ``old_`` and ``new_`` values."""
        old, new = self.at(from_epoch), self.at(to_epoch)
        return state_changes(old, new, self.keys(to_epoch))

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
    compare null-safely; a key's shard may differ (a rescale between them), and so may
    the columns (a migration)."""
    ids = keys + [KEY_GROUP]
    types = {f.name: f.dataType for df in (old, new) for f in df.schema.fields}
    values = list(dict.fromkeys(c for df in (old, new) for c in df.columns if c not in ids and c != SHARD))
    present = "_volley_present"

    def side(df: DataFrame, prefix: str) -> DataFrame:
        """A column only the other side has (a migration between them) is null here."""
        cols = [(F.col(c) if c in df.columns else F.lit(None).cast(types[c])).alias(prefix + c) for c in values + [SHARD]]
        return df.select(*ids, *cols, F.lit(True).alias(prefix + present))

    joined = side(old, OLD).join(side(new, NEW), on=ids, how="full_outer")
    differs = reduce(operator.or_, [~F.col(OLD + c).eqNullSafe(F.col(NEW + c)) for c in values], F.lit(False))
    change = (F.when(F.col(OLD + present).isNull(), "added").when(F.col(NEW + present).isNull(), "removed")
              .when(differs, "changed"))
    return joined.select(*ids, F.coalesce(F.col(NEW + SHARD), F.col(OLD + SHARD)).alias(SHARD), change.alias(CHANGE),
                         *[F.col(p + c) for c in values for p in (OLD, NEW)]).where(F.col(CHANGE).isNotNull())

