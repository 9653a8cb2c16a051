"""Deduplication within a watermark: Spark's ``dropDuplicatesWithinWatermark``,
decided so that a re-run of an epoch drops exactly the same records.

The rule, for epoch N, with ``W[N-1]`` the watermark it starts from (the pipeline's
one clock, ``operators.event_time``; the first epoch has none) and ``t`` a record's
event time:

- **Late.** A record with ``t + within <= W[N-1]`` is late: it is dropped, counted
  (the epoch's ``dedup_late``) and, with ``write_duplicates``, written to the
  duplicates side output with reason ``late``. It is not compared with the
  remembered keys, not remembered, and makes no other record a duplicate.
- **Duplicate.** A record that is not late is a duplicate when its key (its ``on``
  columns) is remembered, or when a record of the same key that is not late comes
  before it in this epoch (by log position): it is dropped, counted (``duplicates``)
  and written with reason ``duplicate``. Any other record is kept.
- **Memory.** A kept record's key is remembered until the watermark passes ``t +
  within``: epoch N forgets every key whose deadline is at or before the watermark
  after N, and does not remember a kept key whose deadline already is.

So a re-send of a kept record (same key, same event time) is never kept again: while
its key is remembered it is a duplicate, and once the watermark has passed its
deadline (the key forgotten, or never remembered) it is late; a replay of an old
batch adds nothing to what follows. Only a key that comes again with a later event
time, one not late, is kept and remembered again.

Late records are Spark's: its watermark is the latest event time less the delay, and
a row at or before it (the previous batch's) is dropped before deduplicating and
counted in ``numRowsDroppedByWatermark``. Here ``within`` plays the delay and the
watermark is the pipeline's one (the latest event time, less a window's or an
event-time TTL's ``max_out_of_orderness`` when they set the clock), so the same test
reads ``t + within <= W[N-1]``. Spark keeps a key until its own watermark reaches
``t + delay`` (the latest event time ``t + 2 * delay``), here until the watermark
reaches ``t + within``: the two differ only for a key that comes again with a later
event time, which Spark may still drop as a duplicate.

Epoch N decides against ``W[N-1]`` (in N-1's manifest), the state epoch N-1 left (its
snapshot, read-only) and its own records, so every attempt of epoch N decides the
same.

State: the remembered keys, in runs per key group and epoch in the shard that owns
the key group (``operators/dedup_state.py``), read once an epoch and tested in bulk.

Where it runs: before an aggregate or a window, Spark routes each record to the
key's shard, where a probe reads N-1's snapshot (``spark/dedup.py``: in the state
stage's own job, or, before a window or an event-time TTL, which need W[N] first, in a
job before it); the epoch's state tasks then remember the kept keys and forget the due
ones, in the same ``WriteBatch`` and snapshot as the operator after it
(``Deduplicated``). With nothing after it, the records themselves are routed by the
key and each shard task decides, remembers and emits the kept ones
(``UniqueRecords``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.errors import ConfigError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.base import (
    LATEST_EVENT,
    OperatorStats,
    ShardStep,
    StageClock,
    StatefulOperator,
    StateNamespaces,
    partial_records,
    summed,
)
from volley_dagster.operators.dedup_state import (
    DEDUP_NAMESPACES,
    RememberedKeys,
    decode_run,
    decoded_runs,
    read_remembered,
    run_key_group,
    write_remembered,
)
from volley_dagster.operators.event_time import EventTime
from volley_dagster.sources.base import ColumnStatistics
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.partitioning import ShardRoute
from volley_dagster.state.keys import key_columns, key_kind
from volley_dagster.state.resident import ResidentRecords
from volley_dagster.state.transaction import ShardTransaction

# a key over several columns: every value exactly (microseconds, in UTC whatever the
# session's time zone), and a null as a null, so equal keys and only they match
EXACT_JSON = {"timestampFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSSXXX", "timestampNTZFormat": "yyyy-MM-dd'T'HH:mm:ss.SSSSSS",
               "timeZone": "UTC", "ignoreNullFields": "false"}
DUPLICATES = "duplicates"  # the epoch's figures: records dropped as duplicates,
DEDUP_LATE = "dedup_late"  # and as late (event time + within at or before the watermark the epoch starts from)
DEDUP_FIGURES = (DUPLICATES, DEDUP_LATE)
REASON_DUPLICATE, REASON_LATE = "duplicate", "late"  # the duplicates side output's ``reason``
DROPPED_COLUMNS = [columns.POS, columns.DEDUP_KEY, columns.DEDUP_TIME, columns.DEDUP_LATE]  # of a dropped record
_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class Deduplication:
    """``Pipeline.deduplicate(...)``: the key columns, how long a key is remembered,
    on which event time, and whether dropped records go to a side output."""

    on: tuple[str, ...]
    within_us: int
    event_time: EventTime
    write_duplicates: bool = False

    def __post_init__(self) -> None:
        if not self.on:
            raise ConfigError("deduplicate(on=[...]) needs at least one column")
        if len(set(self.on)) != len(self.on):
            raise ConfigError(f"deduplicate(on={list(self.on)}) names a column twice")
        reserved = [c for c in self.on if c.startswith("_volley_")]
        if reserved:
            raise ConfigError(f"deduplicate(on=...): {reserved} use the engine's reserved prefix _volley_")
        if self.within_us < 1:
            raise ConfigError("deduplicate(within=...) must be positive")

    def deadlines(self, times: np.ndarray) -> np.ndarray:
        """When keys kept with these event times are forgotten: ``t + within`` (saturated)."""
        return np.minimum(times, _MAX - self.within_us) + self.within_us

    def late(self, times: np.ndarray, watermark: int | None) -> np.ndarray:
        """Which records are late against ``watermark``, the one the epoch starts from:
        ``t + within <= W[N-1]`` (none before there is a watermark)."""
        if watermark is None:
            return np.zeros(len(times), dtype=bool)
        return self.deadlines(times) <= watermark

    def layout(self) -> JsonObject:
        """What must not change between epochs of one checkpoint root (the side output may)."""
        return {"on": list(self.on), "within_us": self.within_us, "time_column": self.event_time.time_column}

    @classmethod
    def recorded(cls, layout: JsonObject) -> Deduplication:
        return cls(tuple(layout["on"]), layout["within_us"], EventTime(layout["time_column"]))

    def key_expr(self, schema: T.StructType) -> tuple[Column, str]:
        """The key over ``on`` and its kind: one integer column as int64, one string
        column as it is, anything else as the JSON of its values (exact, never hashed)."""
        missing = [c for c in self.on if c not in schema.names]
        if missing:
            raise ConfigError(f"deduplicate(on=...): no column {missing[0]!r}; columns are {schema.names}")
        self.event_time.check(schema, "deduplicate(event_time=...)")
        if len(self.on) == 1:
            kind = schema[self.on[0]].dataType
            if isinstance(kind, T.IntegralType):
                return F.col(self.on[0]).cast("long"), "int"
            if isinstance(kind, T.StringType):
                return F.col(self.on[0]), "str"
        return F.to_json(F.struct(*[F.col(c) for c in self.on]), options=EXACT_JSON), "str"

    @property
    def key_name(self) -> str:
        """What the key is called where it is shown alone: its column, or for several their JSON ``dedup_key``."""
        return self.on[0] if len(self.on) == 1 else "dedup_key"

    def describe_null(self) -> str:
        """The dead-letter reason of a record whose single key column is null."""
        return f"null deduplication key: {self.on[0]!r} is null"

    def side_output(self, dropped: pa.Table, rng: EpochRange) -> pa.Table:
        """The duplicates side output of ``dropped`` (``DROPPED_COLUMNS``): where each
        dropped record is, its key and event time, and why (``duplicate``, or ``late``:
        event time + within at or before the watermark the epoch started from), in log order."""
        dropped = dropped.sort_by(columns.POS)
        reason = pc.if_else(dropped.column(columns.DEDUP_LATE), pa.scalar(REASON_LATE), pa.scalar(REASON_DUPLICATE))
        cols = rng.where_in_log(dropped.column(columns.POS).combine_chunks()) + [
            dropped.column(columns.DEDUP_KEY), dropped.column(columns.DEDUP_TIME).cast(pa.timestamp("us", tz="UTC")),
            reason]
        return pa.table(cols, names=["partition", "file", "offset", self.key_name, self.event_time.time_column,
                                     "reason"])


def first_occurrences(keys: pa.Array, positions: np.ndarray) -> np.ndarray:
    """For each row, whether it is of its key's first record by log position (bulk: one
    sort). Every row of that record counts as first: a transform that explodes a record
    gives several rows one position, and they are one event's parts, kept or dropped
    together."""
    n = len(keys)
    first = np.zeros(n, dtype=bool)
    if n == 0:
        return first
    order = pc.sort_indices(pa.table({"k": keys, "p": positions}),
                            sort_keys=[("k", "ascending"), ("p", "ascending")]).to_numpy()
    ordered = keys.take(pa.array(order))
    starts = np.ones(n, dtype=bool)
    if n > 1:
        starts[1:] = pc.not_equal(ordered.slice(1), ordered.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    ordered_positions = np.asarray(positions)[order]
    earliest = ordered_positions[np.flatnonzero(starts)][np.cumsum(starts) - 1]
    first[order[ordered_positions == earliest]] = True
    return first


def find_duplicates(remembered: RememberedKeys | None, keys: pa.Array, positions: np.ndarray) -> np.ndarray:
    """Which rows are duplicates: not their key's first in the epoch, or their key is
    ``remembered`` (N-1's state; None: there is none)."""
    duplicate = ~first_occurrences(keys, positions)
    if remembered is not None:
        duplicate |= remembered.contains(keys)
    return duplicate


@dataclass(frozen=True)
class Verdicts:
    """One shard's decision over its records: which are duplicates, which are late
    (never both); the rest are kept."""

    duplicate: np.ndarray
    late: np.ndarray

    @property
    def kept(self) -> np.ndarray:
        return ~(self.duplicate | self.late)


def decide(dedup: Deduplication, remembered: RememberedKeys | None, keys: pa.Array, positions: np.ndarray,
           times: np.ndarray, watermark: int | None) -> Verdicts:
    """The rule over one shard's records, in bulk: the late ones (against ``watermark``,
    the one the epoch starts from) are set aside first; the others are duplicates when
    ``find_duplicates`` says so among themselves and against ``remembered`` (N-1's state)."""
    late = dedup.late(times, watermark)
    duplicate = np.zeros(len(keys), dtype=bool)
    on_time = np.flatnonzero(~late)
    if len(on_time) == len(keys):
        duplicate = find_duplicates(remembered, keys, positions) if len(keys) else duplicate
    elif len(on_time):
        duplicate[on_time] = find_duplicates(remembered, keys.take(pa.array(on_time)), positions[on_time])
    return Verdicts(duplicate, late)


class SeenKeys:
    """One shard's remembered keys in one epoch: forget the due ones, remember the kept ones."""

    def __init__(self, dedup: Deduplication, txn: ShardTransaction, step: ShardStep) -> None:
        self.dedup, self.txn, self.step = dedup, txn, step

    def settle(self, key_groups: np.ndarray, keys: pa.Array, times: np.ndarray,
               remembered: RememberedKeys) -> dict[str, int]:
        """Forget every ``remembered`` key (the shard's state as the epoch found it)
        whose deadline is at or before the watermark after this epoch, and remember the
        kept ``keys`` that outlive it; its figures."""
        limit = self.step.watermark
        due = np.zeros(len(remembered.keys), dtype=bool)
        if limit is not None:
            due = self.dedup.deadlines(remembered.times) <= limit
            live = self.dedup.deadlines(times) > limit
            key_groups, keys, times = key_groups[live], keys.filter(pa.array(live)), times[live]
        write_remembered(self.txn, remembered, due, self.step.epoch, key_groups, keys, times)
        return {"dedup_keys_remembered": len(keys), "dedup_keys_forgotten": int(due.sum())}


@dataclass(frozen=True)
class ProbeTally:
    """What one probe task tells each shard task when the probe runs in the state
    stage's job (``spark/dedup.py``): the latest event time of its records, by which
    the shard task forgets (W[N] is not known before the job), and, to its own shard
    only, how many it dropped. It rides as a ``DEDUP_RUN`` row whose key group is
    negative (``key_group``), grouped apart from the runs."""

    latest: int | None
    duplicates: int = 0
    late: int = 0

    _FORMAT: ClassVar[np.dtype] = np.dtype("<i8")

    @staticmethod
    def key_group(probe_shard: int) -> int:
        return -1 - probe_shard

    def to_bytes(self) -> bytes:
        latest = (0, 0) if self.latest is None else (1, self.latest)
        return np.array([*latest, self.duplicates, self.late], self._FORMAT).tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes) -> ProbeTally:
        has, latest, duplicates, late = (int(v) for v in np.frombuffer(blob, cls._FORMAT))
        return cls(latest if has else None, duplicates, late)

    @classmethod
    def combined(cls, tallies: Sequence[ProbeTally]) -> ProbeTally:
        latest = [t.latest for t in tallies if t.latest is not None]
        return cls(max(latest) if latest else None, sum(t.duplicates for t in tallies), sum(t.late for t in tallies))


@dataclass(frozen=True)
class Deduplicated:
    """The stateful operator after a deduplication: its own work, plus remembering the
    kept keys that reach the shard (rows with ``DEDUP_RUN``: the probe's runs) and
    forgetting due ones, in the same transaction, so one snapshot holds both."""

    inner: StatefulOperator
    dedup: Deduplication
    key_kind: str | None = None  # the deduplication key's ("int" | "str"); None: rebuilt to read state only

    @property
    def resident_records(self) -> ResidentRecords | None:
        return self.inner.resident_records

    def layout(self) -> JsonObject:
        return {**self.inner.layout(), "dedup": self.dedup.layout()}

    @property
    def namespaces(self) -> StateNamespaces:
        return dedup_namespaces(self.inner.namespaces)

    def decode_state(self, keys: list[bytes], values: list[bytes], key_kind: str, key_name: str,
                     key_group: str | None = None) -> pa.Table:
        return self.inner.decode_state(keys, values, key_kind, key_name, key_group)

    def output_ddl(self) -> list[str]:
        return self.inner.output_ddl()

    def output_names(self) -> list[str]:
        return self.inner.output_names()

    def epoch_figures(self, shards: Sequence[OperatorStats]) -> dict[str, int]:
        """The inner operator's; the records dropped are the probe's (``spark/dedup.py``)."""
        return self.inner.epoch_figures(shards)

    def apply(self, txn: ShardTransaction, data: pa.Table, step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
        if self.key_kind is None:
            raise ValueError("a Deduplicated rebuilt from a recorded layout reads state only")
        is_run = pc.is_valid(data.column(columns.DEDUP_RUN))
        kept, rest = data.filter(is_run), data.filter(pc.invert(is_run))
        outputs, stats = self.inner.apply(txn, rest.drop_columns([columns.DEDUP_RUN]), step)
        is_tally = pc.less(kept.column(columns.KEY_GROUP), 0)
        tallies = [ProbeTally.from_bytes(b) for b in kept.filter(is_tally).column(columns.DEDUP_RUN).to_pylist()]
        kept = kept.filter(pc.invert(is_tally))
        runs = [(kg, decode_run(b"", blob)) for kg, blob in zip(kept.column(columns.KEY_GROUP).to_pylist(),
                                                                 kept.column(columns.DEDUP_RUN).to_pylist(), strict=True)]
        groups, keys, times = decoded_runs([kg for kg, _ in runs], [r for _, r in runs], self.key_kind)
        probed: dict[str, int] = {}
        if tallies:  # the probe ran in this job: W[N] is the one the epoch starts from, advanced by its records
            tally = ProbeTally.combined(tallies)
            step = replace(step, watermark=self.dedup.event_time.advance(step.watermark, tally.latest))
            probed = {DUPLICATES: tally.duplicates, DEDUP_LATE: tally.late}
            if tally.latest is not None:
                probed[LATEST_EVENT] = tally.latest
        figures = SeenKeys(self.dedup, txn, step).settle(groups, keys, times,
                                                         read_remembered(txn, self.key_kind))
        return outputs, OperatorStats(stats.keys_touched, stats.new_keys, {**stats.figures, **figures, **probed},
                                      stats.records)


@dataclass(frozen=True)
class UniqueRecords:
    """``deduplicate(...)`` with nothing stateful after it: the records are routed by
    their deduplication key, so each shard task decides against its own state and
    emits the kept records themselves (no probe job)."""

    dedup: Deduplication

    def resolve(self, schema: T.StructType) -> ResolvedUniqueRecords:
        self.dedup.key_expr(schema)  # checks the columns and the event time
        fields = [f for f in schema.fields if not f.name.startswith("_volley_")]
        ordered = [schema[c] for c in self.dedup.on] + [f for f in fields if f.name not in self.dedup.on]
        return ResolvedUniqueRecords(self.dedup, tuple(f.name for f in ordered),
                                     tuple(f"`{f.name}` {f.dataType.simpleString()}" for f in ordered),
                                     schema[columns.KEY].dataType.simpleString())


INTERNAL_OUT = (columns.POS, columns.DEDUP_KEY, columns.DEDUP_TIME, columns.DUPLICATE,  # write_duplicates only
                columns.DEDUP_LATE)


@dataclass(frozen=True)
class ResolvedUniqueRecords:
    """The kept records out of the shard tasks: the ``on`` columns first (the first is
    what ``ShardMerge`` calls the key column), then the record's other columns; with
    ``write_duplicates`` every record, flagged, with where it is (``INTERNAL_OUT``)."""

    dedup: Deduplication
    columns: tuple[str, ...] = ()  # empty: rebuilt from a recorded layout, to read state only
    ddl: tuple[str, ...] = ()
    key_type: str = "string"  # the deduplication key's Spark type (``columns.KEY``)
    resident_records: ClassVar[None] = None

    def layout(self) -> JsonObject:
        """The passed-through columns may change between epochs; the deduplication may not."""
        return {"dedup": self.dedup.layout(), "unique_records": True}

    @property
    def namespaces(self) -> StateNamespaces:
        return StateNamespaces(DEDUP_NAMESPACES)

    def decode_state(self, keys: list[bytes], values: list[bytes], key_kind: str, key_name: str,
                     key_group: str | None = None) -> pa.Table:
        """Each remembered key (of the runs ``keys``), the event time of its kept
        record and when it is forgotten. A checkpoint written before runs shows its
        keys once its next epoch has moved them into runs."""
        groups, key_values, times = decoded_runs([run_key_group(k) for k in keys],
                                                 [decode_run(k, v) for k, v in zip(keys, values, strict=True)],
                                                 key_kind)
        front, names = key_columns(key_values, self.dedup.key_name, groups, key_group)
        ts = pa.timestamp("us", tz="UTC")
        bounds = [pa.array(times).cast(ts), pa.array(times + self.dedup.within_us).cast(ts)]
        return pa.table(front + bounds, names=names + [self.dedup.event_time.time_column, "remembered_until"])

    def output_ddl(self) -> list[str]:
        internal = [f"`{columns.POS}` bigint", f"`{columns.DEDUP_KEY}` {self.key_type}",
                    f"`{columns.DEDUP_TIME}` bigint", f"`{columns.DUPLICATE}` boolean", f"`{columns.DEDUP_LATE}` boolean"]
        return list(self.ddl[1:]) + (internal if self.dedup.write_duplicates else [])

    def output_names(self) -> list[str]:
        return list(self.columns[1:]) + (list(INTERNAL_OUT) if self.dedup.write_duplicates else [])

    # -- in the epoch's Spark stage (``operators.base.SparkOperator``) -----------------

    @property
    def event_time(self) -> EventTime:
        return self.dedup.event_time

    runs_without_records: ClassVar[bool] = False

    @property
    def rows_are_sink_rows(self) -> bool:
        """With ``write_duplicates`` the tasks return every record, flagged, for ``sink_output`` to split."""
        return not self.dedup.write_duplicates

    one_row_per_key: ClassVar[bool] = False  # one row per record kept, whichever its key

    def null_key_reason(self, key_column: str) -> str:
        return self.dedup.describe_null()

    def unfit_records(self) -> list[tuple[Column, str]]:
        return []

    def fit_by_footer(self, source: str | None, footer: Mapping[str, ColumnStatistics]) -> bool:
        return True

    def output_schema(self, key_ddl: str) -> list[str]:
        """The records' own columns, the deduplication key's first."""
        return [self.ddl[0]] + self.output_ddl()

    def input_columns(self) -> None:
        """All: the kept records reach the sinks whole."""
        return None

    def assign(self, rows: DataFrame) -> DataFrame:
        return rows

    def late(self, assigned: DataFrame, watermark: int | None) -> None:
        return None  # late copies are decided by the shard tasks, and counted with the duplicates

    def late_bound(self, watermark: int | None) -> None:
        return None

    def acts_from(self, earliest_us: int, next_due: int | None) -> None:
        return None  # W[N] decides which keys it forgets

    def shard_input(self, assigned: DataFrame, clock: StageClock, step: ShardStep) -> tuple[DataFrame, ShardStep]:
        """Each record: its columns, position and event time (no probe job: the shard
        tasks decide)."""
        return assigned.select(columns.KEY, columns.POS, *self.columns,
                               self.dedup.event_time.event_us().alias(columns.DEDUP_TIME), F.lit(1).alias(columns.ROWS)), step

    def partials(self, route: ShardRoute) -> DataFrame:
        return route.rows

    def sink_output(self, output: pa.Table, rng: EpochRange) -> tuple[pa.Table, pa.Table | None]:
        """The kept records; with ``write_duplicates`` the tasks returned every record,
        flagged, and the dropped ones become the duplicates side output."""
        if not self.dedup.write_duplicates:
            return output, None
        flags = pc.or_(output.column(columns.DUPLICATE), output.column(columns.DEDUP_LATE))
        dropped = output.filter(flags).select(DROPPED_COLUMNS)
        kept = output.filter(pc.invert(flags)).drop_columns(list(INTERNAL_OUT))
        return kept, self.dedup.side_output(dropped, rng)

    def epoch_figures(self, shards: Sequence[OperatorStats]) -> dict[str, int]:
        return summed(shards, DEDUP_FIGURES)

    def apply(self, txn: ShardTransaction, data: pa.Table, step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
        key_groups = data.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False).astype(np.int64)
        keys = data.column(columns.KEY).combine_chunks()
        times = data.column(columns.DEDUP_TIME).to_numpy(zero_copy_only=False).astype(np.int64)
        remembered = read_remembered(txn, key_kind(keys.type))
        verdicts = decide(self.dedup, remembered, keys, data.column(columns.POS).to_numpy(zero_copy_only=False),
                          times, step.watermark_before)
        kept = verdicts.kept
        figures = SeenKeys(self.dedup, txn, step).settle(key_groups[kept], keys.filter(pa.array(kept)), times[kept],
                                                         remembered)
        rows = data if self.dedup.write_duplicates else data.filter(pa.array(kept))
        outputs = [rows.column(c).combine_chunks() for c in self.columns]
        if self.dedup.write_duplicates:
            outputs += [rows.column(columns.POS).combine_chunks(), keys, pa.array(times), pa.array(verdicts.duplicate),
                        pa.array(verdicts.late)]
        return outputs, OperatorStats(int(kept.sum()), figures["dedup_keys_remembered"],
                                      {DUPLICATES: int(verdicts.duplicate.sum()), DEDUP_LATE: int(verdicts.late.sum()),
                                       **figures},
                                      partial_records(data.filter(pa.array(kept))))



def dedup_namespaces(inner: StateNamespaces) -> StateNamespaces:
    """An operator's namespaces plus the deduplication's (both keyed by key group)."""
    return StateNamespaces(inner.keyed + DEDUP_NAMESPACES, inner.pending, inner.meta)
