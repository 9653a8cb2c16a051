"""``Pipeline.process(...)``: a team's own keyed logic with state variables and
event-time timers (Spark 4's ``transformWithStateInPandas``, Flink's
``KeyedProcessFunction``), run exactly once per epoch.

The rules, for epoch N with ``W[N-1]`` the watermark it starts from and ``W[N]`` the
one its own records move it to (the pipeline's one clock, ``operators.event_time``):

- **Rows.** A record at or before ``W[N-1]`` is late (the epoch's late-records output,
  counted) and never reaches the processor. Each key's records on time reach
  ``handleInputRows`` once per epoch, as one pandas frame, in log order (the order the
  recorded range gives on every retry; Spark's order is arbitrary).
- **Timers.** After every key's rows, each event-time timer at or before ``W[N]``
  fires once (``handleExpiredTimer``), by time; one a timer's handler registers waits
  for the next epoch (Spark's next micro-batch: a timer that re-arms itself never
  loops within an epoch; ``TIMERS_DUE_FROM`` tells the next epoch where to scan from).
  Spark fires at the previous micro-batch's watermark; here the epoch's own, as
  windows fire. At the end of the stream (``runner.flush()``) every timer pending then
  fires, as every window does. ``time_mode="ProcessingTime"``: the same on the wall
  clock recorded with the epoch's range.
- **Output.** The rows the handlers yield, the key first (added when
  ``output_schema`` lacks it), to the sinks in append mode.
- **Errors.** An exception in the processor fails the epoch with a
  ``ProcessorError`` naming the processor, the key and the record (or timer); nothing
  is committed, and a person fixes the code (it is permanent).

The state layout is ``operators/process_state.py``."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, Sequence

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.errors import ConfigError, ProcessorError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.base import (
    PROCESSING_CLOCK,
    TIMERS_DUE_FROM,
    KeyedRows,
    OperatorStats,
    ShardStep,
    StageClock,
    StateNamespaces,
    summed,
)
from volley_dagster.operators.event_time import EventTime
from volley_dagster.operators.join import END_OF_STREAM_US
from volley_dagster.operators.process_api import StatefulProcessorHandle, StateVariable
from volley_dagster.operators.process_rows import Fields, fields_ddl, parse_schema
from volley_dagster.operators.process_state import (
    BY_KEY_NS,
    COUNTS_NS,
    EVENT_CLOCK,
    FIGURES,
    PROCESSING_CLOCK_ID,
    TIMER,
    TIMERS_NS,
    VARIABLE_NS_BASE,
    VARIABLE_NS_SPAN,
    DeclaredVariable,
    ProcessShard,
    apply_process,
    variable_fields,
)
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.partitioning import ShardRoute
from volley_dagster.state.keys import decode_keys, key_columns
from volley_dagster.state.transaction import ShardTransaction

TimeMode = Literal["None", "EventTime", "ProcessingTime"]
OutputMode = Literal["append", "update"]
LATE_REASON = "late: event time at or before the watermark the epoch started from"


def variable_namespace(name: str) -> int:
    """A state variable's namespace, from its name: the same across code changes."""
    return VARIABLE_NS_BASE + zlib.crc32(name.encode()) % VARIABLE_NS_SPAN


class DeclaringAccess:
    """The driver's pass over ``init``: it records the variables it declares."""

    def __init__(self) -> None:
        self.variables: list[StateVariable] = []

    def declare(self, variable: StateVariable) -> None:
        self.variables.append(variable)

    def _outside(self, *_: object) -> Any:
        raise RuntimeError("state and timers belong to a key: use them in handleInputRows or handleExpiredTimer, "
                           "not in init()")

    rows = expiries = put = register_timer = delete_timer = timers = drop = _outside


@dataclass(frozen=True)
class Processing:
    """``Pipeline.process(...)`` before it has seen a schema."""

    processor: Any
    output_schema: str
    key_column: str
    time_mode: TimeMode = "None"
    event_time: EventTime | None = None
    input_columns: tuple[str, ...] | None = None
    name: str = ""
    quote_keys: bool = True  # errors name the key (``on_bad_records(quote_records=False)``: withheld)
    output_mode: OutputMode = "append"
    output_keys: tuple[str, ...] = ()  # with the key, what identifies an output row ("update": the last one wins)

    def __post_init__(self) -> None:
        if self.output_mode not in ("append", "update"):
            raise ConfigError(f"process(output_mode={self.output_mode!r}): use 'append' or 'update'")
        if self.output_keys and self.output_mode != "update":
            raise ConfigError("process(output_keys=...) names what an update replaces; give output_mode='update'")
        if self.time_mode not in ("None", "EventTime", "ProcessingTime"):
            raise ConfigError(f"process(time_mode={self.time_mode!r}): use 'None', 'EventTime' or 'ProcessingTime'")
        if (self.time_mode == "EventTime") != (self.event_time is not None):
            raise ConfigError("process(time_mode='EventTime') needs event_time=<timestamp column>, and event_time= "
                              "needs time_mode='EventTime'")
        missing = [m for m in ("init", "handleInputRows") if not callable(getattr(self.processor, m, None))]
        if missing:
            raise ConfigError(f"process({type(self.processor).__name__}): a processor has init(handle) and "
                              f"handleInputRows(key, rows, timerValues); it lacks {', '.join(missing)}")

    @property
    def shown(self) -> str:
        return self.name or type(self.processor).__name__

    def declared(self) -> tuple[DeclaredVariable, ...]:
        """The variables ``init`` declares, run once on the driver (Spark's PRE_INIT)."""
        access = DeclaringAccess()
        try:
            self.processor.init(StatefulProcessorHandle(access))
        except Exception as exc:
            raise ProcessorError(f"processor {self.shown!r} failed in init on the driver: "
                                 f"{type(exc).__name__}: {exc}") from exc
        out: dict[str, DeclaredVariable] = {}
        taken: dict[int, str] = {}
        for v in access.variables:
            what = f"process({self.shown}): state variable {v.name!r}"
            if v.ttl_ms is not None and (not isinstance(v.ttl_ms, int) or v.ttl_ms <= 0):
                raise ConfigError(f"{what}: ttlDurationMs={v.ttl_ms!r}; give a positive number of milliseconds")
            try:
                fields, key_fields = variable_fields(v, what)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            declared = DeclaredVariable(v.name, v.kind, fields, variable_namespace(v.name), key_fields,
                                        None if v.ttl_ms is None else v.ttl_ms * 1000)
            if v.name in out:
                if out[v.name] != declared:
                    raise ConfigError(f"{what} is declared twice, differently")
                continue
            if declared.ns in taken:
                raise ConfigError(f"{what} and {taken[declared.ns]!r} hash to one namespace ({declared.ns:#x}); "
                                  "rename one of them")
            taken[declared.ns] = v.name
            out[v.name] = declared
        return tuple(out.values())

    def resolve(self, schema: T.StructType) -> ResolvedProcessor:
        if self.event_time is not None:
            self.event_time.check(schema, "process")
        names = [n for n in schema.names if not n.startswith("_volley_")]
        chosen = self.input_columns if self.input_columns is not None else tuple(names)
        unknown = [c for c in chosen if c not in schema.names]
        if unknown:
            raise ConfigError(f"process(input_columns=...): no column {unknown[0]!r}; columns are {names}")
        output = parse_schema(self.output_schema, f"process({self.shown}, output_schema=...)")
        after_key = tuple((n, k) for n, k in output if n != self.key_column)
        if not after_key:
            raise ConfigError(f"process({self.shown}, output_schema={self.output_schema!r}): declare the columns "
                              "the processor emits besides the key")
        missing = [k for k in self.output_keys if k not in dict(after_key)]
        if missing:
            raise ConfigError(f"process({self.shown}, output_keys={list(self.output_keys)}): {missing[0]!r} is not "
                              f"among output_schema's columns {[n for n, _ in after_key]}")
        return ResolvedProcessor(self, self.declared(), tuple(chosen), after_key)

    def layout(self, variables: Sequence[DeclaredVariable]) -> JsonObject:
        """What must not change between epochs of one checkpoint root: the variables and the clock."""
        clock = self.event_time
        return {"process": {
            "time_mode": self.time_mode,
            "event_time": None if clock is None else clock.time_column,
            "out_of_orderness_us": 0 if clock is None else clock.out_of_orderness_us,
            "variables": [_recorded_variable(v) for v in variables]}}


def process_namespaces(variables: Sequence[int]) -> StateNamespaces:
    """Every variable's namespace and the timers'; ``volley state`` shows the variables'
    rows and each key's timers (variable ``timer``)."""
    return StateNamespaces((*sorted(variables), BY_KEY_NS, TIMERS_NS, COUNTS_NS),
                           shown=(*sorted(variables), BY_KEY_NS))


@dataclass(frozen=True)
class ResolvedProcessor(KeyedRows):
    processing: Processing
    variables: tuple[DeclaredVariable, ...]
    columns_in: tuple[str, ...]
    output_fields: Fields
    resident_records: ClassVar[None] = None
    state_row_keys: ClassVar[tuple[str, ...]] = ("variable", "entry")  # with the key, one row of ``decode_state``

    @classmethod
    def recorded(cls, layout: JsonObject) -> ResolvedProcessor:
        """From the layout alone (``volley state``, rescale): no user class, no handlers."""
        p = layout["process"]
        variables = tuple(_declared_variable(v) for v in p["variables"])
        clock = None if p["event_time"] is None else EventTime(p["event_time"], p["out_of_orderness_us"])
        processing = Processing(_Recorded(), "value string", "", p["time_mode"], clock)
        return cls(processing, variables, (), (("value", "string"),))

    def layout(self) -> JsonObject:
        return self.processing.layout(self.variables)

    @property
    def namespaces(self) -> StateNamespaces:
        return process_namespaces([v.ns for v in self.variables])

    def decode_state(self, keys: list[bytes], values: list[bytes], key_kind: str, key_name: str,
                     key_group: str | None = None) -> pa.Table:
        """One row per state row: key, variable, its index among the key's rows, the row
        as JSON and when it expires (a TTL's; else null); each pending timer a row of
        variable ``timer`` (its time in ms)."""
        by_ns = {v.ns: v for v in self.variables}
        owners, names, entries, texts, expires = [], [], [], [], []
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            ns = int.from_bytes(key[:2], "big")
            if ns == BY_KEY_NS:
                rows: list[Any] = [(int(t) // 1000,) for t in np.frombuffer(value, TIMER)["time"]]
                name = "timer"
            elif ns in by_ns:
                var = by_ns[ns]
                rows, name = var.codec.decode(value), var.name
            else:
                continue
            ttl = ns in by_ns and by_ns[ns].ttl_us is not None
            for n, row in enumerate(rows):
                owners.append(i)
                names.append(name)
                entries.append(n)
                texts.append(json.dumps([_jsonable(x) for x in (row[1:] if ttl else row)]))
                expires.append(row[0] if ttl else None)
        kept = [keys[i] for i in owners]
        groups, key_values = decode_keys(key_kind, kept) if kept else \
            (pa.array([], pa.int64()).to_numpy(), pa.array([], pa.int64() if key_kind == "int" else pa.string()))
        front, front_names = key_columns(key_values, key_name, groups, key_group)
        return pa.table(front + [pa.array(names, pa.string()), pa.array(entries, pa.int64()),
                                 pa.array(texts, pa.string()),
                                 pa.array(expires, pa.int64()).cast(pa.timestamp("us", tz="UTC"))],
                        names=front_names + ["variable", "entry", "value", "expires_at"])

    def output_ddl(self) -> list[str]:
        return [f"`{name}` {kind}" for name, kind in self.output_fields]

    def output_names(self) -> list[str]:
        return [name for name, _ in self.output_fields]

    def shard(self) -> ProcessShard:
        p = self.processing
        clock = {"EventTime": EVENT_CLOCK, "ProcessingTime": PROCESSING_CLOCK_ID}.get(p.time_mode)
        return ProcessShard(p.shown, p.processor, self.variables, self.columns_in, self.output_fields,
                            p.key_column, clock, p.quote_keys,
                            p.output_keys if p.output_mode == "update" else None)

    def apply(self, txn: ShardTransaction, data: pa.Table, step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
        return apply_process(self.shard(), txn, data, step)

    def epoch_figures(self, shards: Sequence[OperatorStats]) -> dict[str, int]:
        clock = max((s.figures[PROCESSING_CLOCK] for s in shards if PROCESSING_CLOCK in s.figures), default=None)
        waiting = min((s.figures[TIMERS_DUE_FROM] for s in shards if TIMERS_DUE_FROM in s.figures), default=None)
        return {**summed(shards, FIGURES), **({} if clock is None else {PROCESSING_CLOCK: clock}),
                **({} if waiting is None else {TIMERS_DUE_FROM: waiting})}

    # -- in the epoch's Spark stage (``operators.base.SparkOperator``) -----------------

    @property
    def event_time(self) -> EventTime | None:
        return self.processing.event_time

    @property
    def runs_without_records(self) -> bool:
        """Without records the watermark stays and no event-time timer falls due (but at
        the stream's end); a processing-time timer may, on the cut's wall clock."""
        return self.processing.time_mode == "ProcessingTime"

    rows_are_sink_rows: ClassVar[bool] = True

    @property
    def one_row_per_key(self) -> bool:
        """In update mode with no output keys besides the key: each key's last row."""
        return self.processing.output_mode == "update" and not self.processing.output_keys

    def input_columns(self) -> tuple[str, ...]:
        clock = self.event_time
        extra = () if clock is None or clock.time_column in self.columns_in else (clock.time_column,)
        return (*self.columns_in, *extra)

    def assign(self, rows: DataFrame) -> DataFrame:
        return rows

    def _is_late(self, watermark: int | None) -> Column:
        clock = self.event_time
        return F.lit(False) if watermark is None or clock is None else clock.event_us() <= F.lit(watermark)

    def late(self, assigned: DataFrame, watermark: int | None) -> DataFrame | None:
        clock = self.event_time
        if clock is None:
            return None
        return assigned.where(self._is_late(watermark)).select(
            F.col(columns.POS), F.lit(LATE_REASON).alias("reason"), F.col(columns.KEY),
            clock.column().cast("timestamp").alias(columns.LATE_TIME))

    def late_bound(self, watermark: int | None) -> int | None:
        return None if watermark is None or self.event_time is None else watermark + 1

    def acts_from(self, earliest_us: int, next_due: int | None) -> None:
        return None  # W[N] decides which timers fire

    def shard_input(self, assigned: DataFrame, clock: StageClock, step: ShardStep) -> tuple[DataFrame, ShardStep]:
        """Each record on time: the key, its position and the processor's input columns;
        the step's fire limit is W[N] (every timer at the end of the stream)."""
        if self.event_time is not None:
            step = replace(step, fire_limit=END_OF_STREAM_US if clock.end_of_stream else clock.watermark)
        return assigned.where(~self._is_late(clock.watermark_before)).select(
            F.col(columns.KEY), F.col(columns.POS), F.lit(1).alias(columns.ROWS),
            *(F.col(f"`{c}`") for c in self.columns_in)), step

    def partials(self, route: ShardRoute) -> DataFrame:
        return route.rows

    def sink_output(self, output: pa.Table, rng: EpochRange) -> tuple[pa.Table, None]:
        return output, None


def _recorded_variable(v: DeclaredVariable) -> JsonObject:
    recorded: JsonObject = {"name": v.name, "kind": v.kind, "schema": fields_ddl(v.fields[v.key_fields:]), "ns": v.ns}
    if v.kind == "map":
        recorded["key_schema"] = fields_ddl(v.fields[:v.key_fields])
    if v.ttl_us is not None:
        recorded["ttl_us"] = v.ttl_us
    return recorded


def _declared_variable(recorded: JsonObject) -> DeclaredVariable:
    keys = parse_schema(recorded["key_schema"], recorded["name"]) if "key_schema" in recorded else ()
    return DeclaredVariable(recorded["name"], recorded["kind"], keys + parse_schema(recorded["schema"], recorded["name"]),
                            recorded["ns"], len(keys), recorded.get("ttl_us"))


class _Recorded:
    """The processor of a layout read back without its code: it cannot run."""

    def init(self, handle: object) -> None:
        pass

    def handleInputRows(self, *_: object) -> None:
        raise ProcessorError("this processor was rebuilt from the recorded layout to read its state; run the "
                             "pipeline with its own processor")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value
