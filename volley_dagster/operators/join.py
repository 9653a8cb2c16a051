"""An event-time interval join of two sources: Flink's interval join, Spark Structured
Streaming's stream-stream join with a time-range condition, decided per epoch so that
a re-run of an epoch emits exactly the same rows.

The rules, for epoch N, with ``W[N-1]`` the watermark it starts from and ``W[N]`` the
one after it (the pipeline's one clock, ``operators.event_time``; each record's event
time is its side's column). Each side's watermark trails its own latest event time by
``max_out_of_orderness``; the join's is the lesser of the two (Spark's
``multipleWatermarkPolicy=min``), once both sides have one, and never moves back
(``SideTimes.advance_all``):

- **Match.** A left row at ``tl`` and a right row at ``tr`` of the same key match when
  ``lower <= tr - tl <= upper`` (``between=(lower, upper)``). The pair is emitted once,
  in the epoch in which the later of the two arrives (both in N: in N).
- **Late.** A record whose event time is at or before ``W[N-1]`` is late: it goes to the
  epoch's late-records output (counted) and joins nothing. So a row that left state
  could have matched no record that is not late.
- **Leaving state.** A row waits in state until the watermark reaches its bound: ``tl +
  upper`` for a left row, ``tr - lower`` for a right row (no record still to come can
  match it after that). After N's matches, every row whose bound is at or before
  ``W[N]`` leaves, in the same ``WriteBatch``.
- **Already past its bound.** A record on time (after ``W[N-1]``) whose bound is at or
  before ``W[N]`` (the epoch's own later records moved the watermark past it) still
  matches the epoch's rows and the waiting ones, then leaves in the same epoch, never
  stored; if it matched nothing and its side is outer, it is emitted in that epoch.
- **Outer rows.** With ``how="left"`` (``"right"``, ``"full"``), a left (right, either)
  row that leaves state never matched is emitted once then, with nulls for the other
  side.
- **End of the stream.** The final epoch (``runner.flush()``, ``end_of_stream``) lets
  every row leave, whatever its bound, as it fires every window: each unmatched row of
  an outer side is emitted then.

So what an epoch emits depends only on the recorded ranges and the watermark in N-1's
manifest, never on timing: Spark's outer-join null rows depend on when micro-batches
ran; here a re-run, a retry after ``kill -9`` or a backfill emits the same rows.

Each output row is the key, each side's row id and each side's columns. A row id
(``<left>_row``, ``<right>_row``; null for the missing side of an outer row) is
``"<epoch>:<position>"``: the epoch that read the record and its event position there,
``columns.POS``: ``segment id << 40 | the record's offset in that segment's part of the
range`` (the segment numbered among the epoch's segments, of both sources), not a count
of records; ``".<rank>"`` follows for the second and later rows one record gives one
key (``join_state.row_numbers``). A side carries its own source's columns (or
``left_columns``/``right_columns``) but the key and the source column; a name both
sides carry is prefixed with its side's source name and ``_`` (``amount`` on both:
``payments_amount``, ``refunds_amount``), and a name that would still appear twice is
refused (``IntervalJoin.resolve``). An upsert sink keys rows by the key and both row
ids. The shard side is ``operators/join_state.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, ClassVar, Literal, Sequence

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.checkpoint.carried import CARRIED_COLUMNS
from volley_dagster.errors import ConfigError, SnapshotError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.base import OperatorStats, ShardStep, StageClock, StateNamespaces, summed
from volley_dagster.operators.event_time import Duration, EventTime, duration_us
from volley_dagster.operators.join_rows import RowCodec
from volley_dagster.operators.join_state import (
    FIGURES,
    JOIN_NAMESPACES_KEYED,
    LEFT,
    JoinBounds,
    JoinShard,
    apply_join,
    decode_index,
    legacy_index,
    row_ids,
)
from volley_dagster.sources.base import ColumnStatistics
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.partitioning import ShardRoute
from volley_dagster.state.keys import decode_keys, key_columns
from volley_dagster.state.transaction import ShardTransaction
from volley_dagster.watermarks import Watermarks

if TYPE_CHECKING:
    from volley_dagster.sources.multi import MultiSource

JoinHow = Literal["inner", "left", "right", "full"]
_OUTER: dict[str, tuple[bool, bool]] = {"inner": (False, False), "left": (True, False), "right": (False, True),
                                        "full": (True, True)}
END_OF_STREAM_US = np.iinfo(np.int64).max - 1  # the leave limit of the final epoch: every row leaves
LATE_REASON = "late: event time at or before the watermark the epoch started from"
JOIN_NAMESPACES = StateNamespaces(JOIN_NAMESPACES_KEYED)


def signed_duration_us(value: Duration, what: str) -> int:
    """``"-10 minutes"``, ``"+30 minutes"``, ``"0 seconds"`` or a ``timedelta``, in microseconds."""
    if isinstance(value, timedelta):
        return value // timedelta(microseconds=1)
    text = str(value).strip()
    sign = -1 if text.startswith("-") else 1
    return sign * duration_us(text.lstrip("+-"), what)


@dataclass(frozen=True)
class SideTimes(EventTime):
    """The join's clock: each record's event time from its own side's column."""

    source_column: str = ""
    sides: tuple[str, str] = ("", "")
    times: tuple[str, str] = ("", "")

    def column(self) -> Column:
        side = F.col(self.source_column)
        return (F.when(side == self.sides[0], F.col(self.times[0]).cast("timestamp"))
                .when(side == self.sides[1], F.col(self.times[1]).cast("timestamp")))

    @property
    def shown(self) -> str:
        return f"{self.times[0]!r} (of {self.sides[0]!r}) or {self.times[1]!r} (of {self.sides[1]!r})"

    def check(self, schema: T.StructType, what: str) -> None:
        for argument, column in zip(("left_time", "right_time"), self.times, strict=True):
            if column not in schema.names:
                raise ConfigError(f"{what}({argument}={column!r}): no such column; columns are {schema.names}")
            kind = schema[column].dataType
            if not isinstance(kind, (T.TimestampType, T.TimestampNTZType)):
                raise ConfigError(f"{what}({argument}={column!r}): an event-time column must be a timestamp, "
                                  f"got {kind.simpleString()}")

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.sides

    def time_column_of(self, name: str) -> str:
        return self.times[self.sides.index(name)]

    def input_of(self, source: str | None, source_column: str | None) -> str | None:
        """A side is the source its records came from, when the join tells sides by the
        column the sources fill with their names."""
        return source if source in self.sides and source_column == self.source_column else None

    def maxima(self, valid_time: Column) -> dict[str, Column]:
        side = F.col(self.source_column)
        return {name: F.max(F.when(side == name, valid_time)) for name in self.sides}

    def advance_all(self, previous: Watermarks, maxima: dict[str, int | None]) -> Watermarks:
        """Each side's watermark trails its own latest event time; the join's is the
        smaller, once both sides have one (before: none, nothing is late yet), and never
        moves back."""
        inputs = {name: mark for name in self.sides
                  if (mark := self.advance(previous.inputs.get(name), maxima.get(name))) is not None}
        value = min(inputs.values()) if len(inputs) == len(self.sides) else None
        if previous.value is not None:
            value = previous.value if value is None else max(previous.value, value)
        return Watermarks(value, inputs)


@dataclass(frozen=True)
class IntervalJoin:
    """``Pipeline.join(...)`` before it has seen a schema."""

    left: str
    right: str
    on: str
    left_time: str
    right_time: str
    lower_us: int
    upper_us: int
    how: JoinHow = "inner"
    source_column: str = columns.SOURCE
    out_of_orderness_us: int = 0
    max_skew_us: int | None = None
    left_columns: tuple[str, ...] | None = None
    right_columns: tuple[str, ...] | None = None
    max_state_rows: int | None = None
    sources: MultiSource | None = field(default=None, compare=False)  # whose own columns each side carries
    clock: SideTimes | None = field(default=None, compare=False)  # a chain's later stage: handed its watermark

    def __post_init__(self) -> None:
        if self.how not in _OUTER:
            raise ConfigError(f"join(how={self.how!r}): use 'inner', 'left', 'right' or 'full'")
        if self.left == self.right:
            raise ConfigError(f"join(left={self.left!r}, right={self.right!r}): join two different sources")
        if self.lower_us > self.upper_us:
            raise ConfigError(f"join(between=...): the lower bound ({self.lower_us} us) is after the upper "
                              f"({self.upper_us} us); give (lower, upper), e.g. ('-10 minutes', '+30 minutes')")
        if self.max_state_rows is not None and self.max_state_rows < 1:
            raise ConfigError(f"join(max_state_rows={self.max_state_rows}): give a positive number of rows, or None")
        if self.on.startswith("_volley_"):
            raise ConfigError(f"join(on={self.on!r}) uses the engine's reserved prefix _volley_")

    @property
    def event_time(self) -> SideTimes:
        if self.clock is not None:
            return self.clock
        return SideTimes("event_time", self.out_of_orderness_us, self.max_skew_us, self.source_column,
                         (self.left, self.right), (self.left_time, self.right_time))

    @property
    def row_ids(self) -> tuple[str, str]:
        """The output's columns naming each side's row (``"<epoch>:<position>"``)."""
        return f"{self.left}_row", f"{self.right}_row"

    def layout(self) -> JsonObject:
        """What must not change between epochs of one checkpoint root (the columns carried may)."""
        return {"join": {"left": self.left, "right": self.right, "on": self.on, "left_time": self.left_time,
                         "right_time": self.right_time, "lower_us": self.lower_us, "upper_us": self.upper_us,
                         "how": self.how, "out_of_orderness_us": self.out_of_orderness_us}}

    @classmethod
    def recorded(cls, layout: JsonObject) -> IntervalJoin:
        return cls(**layout["join"])

    def resolve(self, schema: T.StructType) -> ResolvedJoin:
        if self.on not in schema.names:
            raise ConfigError(f"join(on={self.on!r}): no such column; columns are {schema.names}")
        self.event_time.check(schema, "join")
        left = self._carried(schema, self.left, self.left_columns)
        right = self._carried(schema, self.right, self.right_columns)
        both = set(left) & set(right)
        names = ([f"{self.left}_{c}" if c in both else c for c in left],
                 [f"{self.right}_{c}" if c in both else c for c in right])
        taken = [self.on, *self.row_ids]
        for name in names[0] + names[1]:
            if name in taken:
                raise ConfigError(f"join: the output would have two columns named {name!r}; rename one with "
                                  "with_column(...) or choose left_columns=/right_columns=")
            taken.append(name)
        return ResolvedJoin(self, RowCodec.of(schema, left, self.left), RowCodec.of(schema, right, self.right),
                            (tuple(names[0]), tuple(names[1])))

    def _carried(self, schema: T.StructType, side: str, chosen: tuple[str, ...] | None) -> tuple[str, ...]:
        """The columns a side's rows carry: ``chosen``, or its own source's columns after the transforms."""
        if chosen is not None:
            missing = [c for c in chosen if c not in schema.names]
            if missing:
                raise ConfigError(f"join({side}_columns=...): no column {missing[0]!r}; columns are {schema.names}")
            return chosen
        own = set(self.sources.sources[side].schema().names) if self.sources is not None else set()
        return tuple(c for c in schema.names
                     if c in own and c not in (self.on, self.source_column) and not c.startswith("_volley_"))


@dataclass(frozen=True)
class ResolvedJoin:
    join: IntervalJoin
    left: RowCodec
    right: RowCodec
    names: tuple[tuple[str, ...], tuple[str, ...]]  # each side's columns as the output names them
    resident_records: ClassVar[None] = None

    def layout(self) -> JsonObject:
        """The join's, and the types of the columns each side's waiting rows carry
        (``CARRIED_COLUMNS``): a type may not change under rows written with the old one."""
        return {**self.join.layout(), CARRIED_COLUMNS: {
            side: {name: kind.simpleString() for name, kind in zip(codec.names, codec.types, strict=True)}
            for side, codec in ((self.join.left, self.left), (self.join.right, self.right))}}

    @property
    def namespaces(self) -> StateNamespaces:
        return JOIN_NAMESPACES

    def decode_state(self, keys: list[bytes], values: list[bytes], key_kind: str, key_name: str,
                     key_group: str | None = None) -> pa.Table:
        """Every waiting row: key, source, row id, event time, whether it matched, and
        when it leaves state (the watermark at which it can match nothing more)."""
        try:
            entries, _ = decode_index(values)
            per_row = entries["ki"]
        except SnapshotError:  # a snapshot taken before 2026-12-08, which no epoch has rewritten
            entries, counts = legacy_index(values)
            per_row = np.repeat(np.arange(len(values)), counts)
        groups, key_values = decode_keys(key_kind, keys)
        front, names = key_columns(key_values.take(pa.array(per_row)), key_name, groups[per_row], key_group)
        ts = pa.timestamp("us", tz="UTC")
        times = entries["time"].astype(np.int64)
        sides = entries["side"]
        bounds = JoinBounds(self.join.lower_us, self.join.upper_us, _OUTER[self.join.how])
        return pa.table(front + [pa.array(np.where(sides == LEFT, self.join.left, self.join.right)),
                                 row_ids(entries["epoch"].astype(np.int64), entries["row"].astype(np.int64),
                                         np.arange(len(entries))),
                                 pa.array(times).cast(ts),
                                 pa.array(entries["matched"].astype(bool)),
                                 pa.array(bounds.leaves_at(sides, times)).cast(ts)],
                        names=names + ["source", "row", "event_time", "matched", "leaves_state_at"])

    def output_ddl(self) -> list[str]:
        ids = [f"`{name}` string" for name in self.join.row_ids]
        carried = zip((self.left, self.right), self.names, strict=True)
        return ids + [f"`{name}` {kind.simpleString()}" for codec, side in carried
                      for name, kind in zip(side, codec.types, strict=True)]

    def output_names(self) -> list[str]:
        return [*self.join.row_ids, *self.names[0], *self.names[1]]

    def apply(self, txn: ShardTransaction, data: pa.Table, step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
        join = self.join
        shard = JoinShard(JoinBounds(join.lower_us, join.upper_us, _OUTER[join.how]), (self.left, self.right),
                          join.max_state_rows, (join.left, join.right))
        return apply_join(shard, txn, data, step)

    def epoch_figures(self, shards: Sequence[OperatorStats]) -> dict[str, int]:
        return summed(shards, FIGURES)

    # -- in the epoch's Spark stage (``operators.base.SparkOperator``) -----------------

    @property
    def event_time(self) -> SideTimes:
        return self.join.event_time

    runs_without_records: ClassVar[bool] = False  # without records the watermark stays: nothing leaves (but at the end)
    rows_are_sink_rows: ClassVar[bool] = True
    one_row_per_key: ClassVar[bool] = False

    def null_key_reason(self, key_column: str) -> str:
        return f"null join key: {key_column!r} is null"

    def unfit_records(self) -> list[tuple[Column, str]]:
        """A record with a timestamp or date its side carries outside years 1-9999: its
        JSON text in state could not be read back."""
        side = F.col(self.join.source_column)
        return [((side == F.lit(name)) & condition, reason)
                for name, codec in ((self.join.left, self.left), (self.join.right, self.right))
                for condition, reason in codec.out_of_range(name)]

    def fit_by_footer(self, source: str | None, footer: Mapping[str, ColumnStatistics]) -> bool:
        codecs = {self.join.left: self.left, self.join.right: self.right}
        chosen = [codecs[source]] if source in codecs else [] if source is not None else list(codecs.values())
        return all(codec.fits(footer) for codec in chosen)

    def output_schema(self, key_ddl: str) -> list[str]:
        return [key_ddl] + self.output_ddl()

    def input_columns(self) -> None:
        """All: each side's rows reach the output whole."""
        return None

    def assign(self, rows: DataFrame) -> DataFrame:
        return rows

    def _is_late(self, watermark: int | None) -> Column:
        return F.lit(False) if watermark is None else self.event_time.event_us() <= F.lit(watermark)

    def late(self, assigned: DataFrame, watermark: int | None) -> DataFrame:
        """The records at or before ``watermark``: they join nothing."""
        return assigned.where(self._is_late(watermark)).select(
            F.col(columns.POS), F.lit(LATE_REASON).alias("reason"), F.col(columns.KEY),
            self.event_time.column().alias(columns.LATE_TIME), F.col(self.join.source_column).alias("source"))

    def late_bound(self, watermark: int | None) -> int | None:
        return None if watermark is None else watermark + 1  # late: at or before the watermark

    def acts_from(self, earliest_us: int, next_due: int | None) -> None:
        return None  # W[N] decides which rows leave the join's state

    def shard_input(self, assigned: DataFrame, clock: StageClock, step: ShardStep) -> tuple[DataFrame, ShardStep]:
        """Each record on time: its key, row id, side, event time and columns (as text).
        At the end of the stream every waiting row leaves (no record can come to match
        it), as every window fires: an outer side's unmatched rows are emitted then."""
        if clock.end_of_stream:
            step = replace(step, watermark=END_OF_STREAM_US)
        is_left = F.col(self.join.source_column) == F.lit(self.join.left)
        return assigned.where(~self._is_late(clock.watermark_before)).select(
            F.col(columns.KEY), F.col(columns.POS),
            F.when(is_left, F.lit(0)).otherwise(F.lit(1)).cast("tinyint").alias(columns.JOIN_SIDE),
            self.event_time.event_us().alias(columns.JOIN_TIME),
            F.when(is_left, self.left.encode()).otherwise(self.right.encode()).alias(columns.JOIN_ROW),
            F.lit(1).alias(columns.ROWS)), step

    def partials(self, route: ShardRoute) -> DataFrame:
        return route.rows

    def sink_output(self, output: pa.Table, rng: EpochRange) -> tuple[pa.Table, None]:
        return output, None
