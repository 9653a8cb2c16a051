"""Event-time windows per key: tumbling, sliding and session, with a watermark.

The rules (Flink's and Spark Structured Streaming's, decided per epoch so a
re-run decides the same):

- The watermark after epoch N is ``max(W[N-1], max event time of epochs <= N
  - max_out_of_orderness)``; it never moves back and is stored in the epoch's
  manifest.
- Epoch N judges lateness with the watermark it starts from, ``W[N-1]`` (as a
  Structured Streaming micro-batch does): a record's window is closed when
  ``window end + allowed_lateness <= W[N-1]``. Such a (record, window) pair
  goes to the epoch's late-records output, counted, and never reopens the
  window. For a session, the window judged is the record's own ``[t, t+gap)``.
- After the epoch's records are merged, every open window with
  ``end + allowed_lateness <= W[N]`` fires: its result is emitted once
  (append) and its state deleted. An end-of-stream epoch fires all of them.
- Windows are ``[start, end)``. Tumbling and sliding windows start at
  multiples of the slide from the Unix epoch (as Spark's ``window``); a
  session is ``[first event, last event + gap)`` and sessions of one key that
  overlap or touch merge (as Flink's and Spark's ``session_window``), also
  with a session opened in an earlier epoch.

Spark assigns windows and pre-aggregates per (key, window) in the JVM; the
shard tasks merge those partials with state (``window_state``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Literal, Sequence

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.errors import AggregateOverflowError, ConfigError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.accumulators import StateOverflow
from volley_dagster.operators.aggregate import Aggregate, ResolvedAggregate
from volley_dagster.operators.base import (
    FillRecords,
    KeyedRows,
    OperatorStats,
    ShardStep,
    StageClock,
    StatefulOperator,
    StateNamespaces,
    summed,
)
from volley_dagster.operators.event_time import Duration, EventTime, duration_us
from volley_dagster.operators.window_state import (
    WINDOW_NAMESPACES,
    apply_windows,
    decode_windows,
    encode_windows,
    window_dtype,
)
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.partitioning import ShardRoute
from volley_dagster.state.keys import decode_keys, key_columns
from volley_dagster.state.resident import ResidentRecords
from volley_dagster.state.transaction import ShardTransaction

WindowKind = Literal["tumbling", "sliding", "session"]

WINDOW_START = "window_start"
WINDOW_END = "window_end"
LATE_REASON = "window closed: window end + allowed lateness <= watermark"
NO_LIMIT = np.iinfo(np.int64).max  # an end-of-stream epoch fires every window

@dataclass(frozen=True)
class Windows:
    """Which windows a record belongs to; build with ``tumbling``, ``sliding`` or ``session``."""

    kind: WindowKind
    size_us: int = 0  # tumbling, sliding
    slide_us: int = 0  # sliding (tumbling: == size)
    gap_us: int = 0  # session

    def to_dict(self) -> JsonObject:
        return {"kind": self.kind, "size_us": self.size_us, "slide_us": self.slide_us, "gap_us": self.gap_us}


def tumbling(size: Duration) -> Windows:
    us = duration_us(size, "tumbling window size")
    if us == 0:
        raise ConfigError("tumbling window size must be positive")
    return Windows("tumbling", size_us=us, slide_us=us)


def sliding(size: Duration, slide: Duration) -> Windows:
    size_us, slide_us = duration_us(size, "sliding window size"), duration_us(slide, "sliding window slide")
    if not 0 < slide_us <= size_us:
        raise ConfigError(
            f"sliding window slide must be positive and at most the size ({size!r}), got {slide!r}: "
            "a longer slide would leave records in no window"
        )
    return Windows("sliding", size_us=size_us, slide_us=slide_us)


def session(gap: Duration) -> Windows:
    us = duration_us(gap, "session gap")
    if us == 0:
        raise ConfigError("session gap must be positive")
    return Windows("session", gap_us=us)


@dataclass(frozen=True)
class Windowing:
    """``Pipeline.window(...)``: the windows, their event-time column and the watermark policy."""

    windows: Windows
    time_column: str
    out_of_orderness_us: int = 0
    lateness_us: int = 0
    max_pending_windows: int | None = None  # per shard; None: the pending index stays in memory
    max_skew_us: int | None = None  # None: any event time is believed
    clock: EventTime | None = None  # a chain's later stage: the clock handed its watermark (``chain.py``)

    def __post_init__(self) -> None:
        if not isinstance(self.windows, Windows):
            raise ConfigError(f"window(...) takes tumbling(...), sliding(...) or session(...), got {self.windows!r}")
        if self.max_pending_windows is not None and self.max_pending_windows < 1:
            raise ConfigError(f"max_pending_windows must be positive or None, got {self.max_pending_windows}")
        _ = self.event_time  # checks the watermark policy

    @property
    def event_time(self) -> EventTime:
        return self.clock or EventTime(self.time_column, self.out_of_orderness_us, self.max_skew_us)

    def layout(self) -> JsonObject:
        """What must not change between epochs of one checkpoint root (the bound may)."""
        return {
            "windows": self.windows.to_dict(),
            "time_column": self.time_column,
            "out_of_orderness_us": self.out_of_orderness_us,
            "lateness_us": self.lateness_us,
        }

    def fire_limit(self, watermark: int | None, end_of_stream: bool) -> int | None:
        """Windows ending at or before this fire; None: none can."""
        if end_of_stream:
            return int(NO_LIMIT)
        return None if watermark is None else watermark - self.lateness_us


@dataclass(frozen=True)
class WindowedAggregate:
    """``window(...)`` + ``aggregate(...)`` before it has seen a schema."""

    windowing: Windowing
    aggregate: Aggregate

    def resolve(self, schema: T.StructType) -> ResolvedWindowAggregate:
        self.windowing.event_time.check(schema, "window")
        clash = [n for n, _ in self.aggregate.accumulators if n in (WINDOW_START, WINDOW_END)]
        if clash:
            raise ConfigError(f"aggregate output {clash[0]!r} is reserved for the window bounds")
        return ResolvedWindowAggregate(self.windowing, self.aggregate.resolve(schema))

    def recorded(self, layout: JsonObject) -> ResolvedWindowAggregate:
        """Resolved as the checkpoint root recorded it (``layout()``), without Spark."""
        return ResolvedWindowAggregate(self.windowing, self.aggregate.recorded(layout))


@dataclass(frozen=True)
class ResolvedWindowAggregate(KeyedRows):
    windowing: Windowing
    aggregate: ResolvedAggregate

    @property
    def windows(self) -> Windows:
        return self.windowing.windows

    @property
    def resident_records(self) -> ResidentRecords:
        return ResidentRecords(window_dtype(self.aggregate), windows=True)

    def layout(self) -> JsonObject:
        return {**self.aggregate.layout(), "windowing": self.windowing.layout()}

    @property
    def namespaces(self) -> StateNamespaces:
        return WINDOW_NAMESPACES

    def decode_state(self, keys: list[bytes], values: list[bytes], key_kind: str, key_name: str,
                     key_group: str | None = None) -> pa.Table:
        """Every open window: key, window_start, window_end, the aggregates."""
        rows, key_index = decode_windows(values, window_dtype(self.aggregate))
        groups, key_values = decode_keys(key_kind, [keys[i] for i in key_index])
        front, names = key_columns(key_values, key_name, groups, key_group)
        ts = pa.timestamp("us", tz="UTC")
        bounds = [pa.array(rows["start"]).cast(ts), pa.array(rows["end"]).cast(ts)]
        return pa.table(front + bounds + self.aggregate.outputs(rows),
                        names=names + [WINDOW_START, WINDOW_END] + self.aggregate.output_names())

    def input_columns(self) -> None:
        """All: a deduplication before a window probes in a job of its own, which hands no rows on."""
        return None

    def assign(self, keyed: DataFrame) -> DataFrame:
        """One row per (record, window) with the window's bounds in microseconds; for a
        session, the record's own ``[t, t+gap)`` (sessions are formed by ``partials``)."""
        w = self.windows
        t = self.windowing.event_time.event_us()
        if w.kind == "session":
            return keyed.withColumn(columns.WINDOW_START, t).withColumn(columns.WINDOW_END, t + F.lit(w.gap_us))
        spark_window = F.window(
            F.col(self.windowing.time_column), f"{w.size_us} microseconds", f"{w.slide_us} microseconds"
        )
        return (
            keyed.withColumn("_volley_window", spark_window)
            .withColumn(columns.WINDOW_START, F.unix_micros(F.col("_volley_window.start")))
            .withColumn(columns.WINDOW_END, F.unix_micros(F.col("_volley_window.end")))
            .drop("_volley_window")
        )

    def is_late(self, watermark: int | None) -> Column:
        """Whether an assigned (record, window) pair belongs to a window already closed."""
        if watermark is None:
            return F.lit(False)
        return F.col(columns.WINDOW_END) + F.lit(self.windowing.lateness_us) <= F.lit(watermark)

    def partials(self, route: ShardRoute) -> DataFrame:
        """Pre-aggregate per (grouping, key, window) in Spark; sessions are merged here
        within the epoch."""
        on_time, by, exprs = route.rows, route.grouping, self.aggregate.partial_exprs()
        if self.windows.kind != "session":
            return on_time.groupBy(*by, columns.KEY, columns.WINDOW_START, columns.WINDOW_END).agg(*exprs)
        gap = f"{self.windows.gap_us} microseconds"
        column = self.windowing.time_column
        time = F.col(column)
        # the shard marker rows and a deduplication's kept-key rows have no event time: give
        # them one so that no session window drops them (their groups, key null, are no
        # records to the operator)
        epoch_start = F.lit("1970-01-01 00:00:00").cast(on_time.schema[column].dataType)  # timestamp or _ntz
        on_time = on_time.withColumn(column, F.coalesce(time, epoch_start))
        return (
            on_time.groupBy(*by, columns.KEY, F.session_window(time, gap).alias("_volley_s"))
            .agg(*exprs)
            .withColumn(columns.WINDOW_START, F.unix_micros(F.col("_volley_s.start")))
            .withColumn(columns.WINDOW_END, F.unix_micros(F.col("_volley_s.end")))
            .drop("_volley_s")
        )

    def migrate_records(self, old: StatefulOperator, values: list[bytes], fill: FillRecords) -> list[bytes]:
        """Each key's open windows keep their bounds; their aggregates are rewritten."""
        assert isinstance(old, ResolvedWindowAggregate)
        rows, key_index = decode_windows(values, window_dtype(old.aggregate))
        out = np.zeros(len(rows), dtype=window_dtype(self.aggregate))
        out["start"], out["end"] = rows["start"], rows["end"]
        fill(out, rows, self.aggregate)
        return encode_windows(out, key_index, len(values))[0]

    # -- in the epoch's Spark stage (``operators.base.SparkOperator``) -----------------

    @property
    def event_time(self) -> EventTime:
        return self.windowing.event_time

    runs_without_records: ClassVar[bool] = True  # the end of the stream fires every window
    rows_are_sink_rows: ClassVar[bool] = True
    one_row_per_key: ClassVar[bool] = False

    def late(self, assigned: DataFrame, watermark: int | None) -> DataFrame:
        """The (record, window) pairs whose window had closed at ``watermark``. Every window
        ends after its records, so only a record earlier than ``watermark - lateness`` can
        have one: that test, on the event-time column itself, Spark applies before the
        windows are assigned and pushes into a Parquet scan (row groups of later records
        are skipped)."""
        bound = self.late_bound(watermark)
        if bound is not None:
            assigned = assigned.where(self.windowing.event_time.before(bound))
        return assigned.where(self.is_late(watermark)).select(
            F.col(columns.POS), F.lit(LATE_REASON).alias("reason"), F.col(columns.KEY),
            F.col(self.windowing.time_column).cast("timestamp").alias(columns.LATE_TIME),
            F.timestamp_micros(columns.WINDOW_START).alias(WINDOW_START),
            F.timestamp_micros(columns.WINDOW_END).alias(WINDOW_END),
        )

    def late_bound(self, watermark: int | None) -> int | None:
        """A window ends after its records: a record at or after ``watermark - lateness`` is in no closed one."""
        return None if watermark is None else watermark - self.windowing.lateness_us

    def acts_from(self, earliest_us: int, next_due: int | None) -> None:
        return None  # W[N] decides which windows fire

    def shard_input(self, assigned: DataFrame, clock: StageClock, step: ShardStep) -> tuple[DataFrame, ShardStep]:
        """The pairs on time; the tasks fire the windows ending at or before the fire limit."""
        step = replace(step, fire_limit=self.windowing.fire_limit(clock.watermark, clock.end_of_stream))
        return assigned.where(~self.is_late(clock.watermark_before)), step

    def sink_output(self, output: pa.Table, rng: EpochRange) -> tuple[pa.Table, None]:
        return output, None

    def output_ddl(self) -> list[str]:
        return [f"`{WINDOW_START}` timestamp", f"`{WINDOW_END}` timestamp"] + self.aggregate.output_ddl()

    def output_names(self) -> list[str]:
        return [WINDOW_START, WINDOW_END] + [n for n, _ in self.aggregate.output_fields()]

    def epoch_figures(self, shards: Sequence[OperatorStats]) -> dict[str, int]:
        return summed(shards, ["windows_fired", "windows_opened"])

    def apply(self, txn: ShardTransaction, data: pa.Table, step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
        try:
            return apply_windows(self.aggregate, self.windows.kind == "session", self.windowing.max_pending_windows,
                                 txn, data, step)
        except StateOverflow as overflow:
            raise AggregateOverflowError(
                f"epoch {step.epoch}: {overflow.aggregate} leaves int64 in {len(overflow.rows)} window(s); nothing was "
                "committed. Sum a float instead (.with_column(name, 'CAST(name AS DOUBLE)')) or scale the values down"
            ) from None
