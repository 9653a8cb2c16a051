"""The shard side of ``Pipeline.process`` (``operators/process.py`` has the rules): a
team's processor runs over one shard's keys, its state variables and timers kept in
namespaces of the shard that owns the key's key group, all keyed ``ns | key group |
...`` so a rescale moves them like any keyed state:

```
0x1000+h  one per state variable (h from its name): kg | key -> the key's rows (``process_rows.PackedRows``)
14  timers   kg | clock (1 B) | time (8 B, ordered) | key -> ""     fires once the watermark reaches time
             kg | 2 (TTL) | earliest expiry (8 B) | variable ns (2 B) | key -> ""   a TTL variable's rows of a key
15  by key   kg | key -> the key's timers: (clock u1, time i8) records, sorted
16  counts   kg | counter (2 B) -> int64: a variable's rows held (counter: its namespace), timers pending (0)
```

One epoch, in bulk against RocksDB: the timers due are one range scan per key group
of namespace 14, from past the previous fire limit to this one (every earlier timer
has fired), so it costs what fires; each variable's rows of every key the epoch
touches are one ``get_many``, written back with one ``set_many`` into the shard's one
``WriteBatch``. The user's handlers run per key in Python (the per-key form's cost);
their state reads and writes stay in memory until then."""

from __future__ import annotations

import copy
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster import columns
from volley_dagster.errors import ProcessorError
from volley_dagster.operators.base import (
    PROCESSING_CLOCK,
    TIMERS_DUE_FROM,
    OperatorStats,
    ShardStep,
    partial_records,
)
from volley_dagster.operators.process_api import (
    ExpiredTimerInfo,
    StatefulProcessorHandle,
    StateVariable,
    TimerValues,
)
from volley_dagster.operators.process_rows import Fields, PackedRows, arrow_schema, parse_schema
from volley_dagster.state.keys import decode_keys, encode_keys, namespace_prefix
from volley_dagster.state.pending_index import ordered_us
from volley_dagster.state.transaction import ShardTransaction

TIMERS_NS, BY_KEY_NS, COUNTS_NS = 14, 15, 16
VARIABLE_NS_BASE, VARIABLE_NS_SPAN = 0x1000, 0xEFFF
EVENT_CLOCK, PROCESSING_CLOCK_ID, TTL_CLOCK = 0, 1, 2  # a timer's clock (namespace 14's byte after the key group)
EXPIRES = "_expires"  # a TTL variable's rows lead with when each expires (µs of processing time)
TIMER_COUNTER = 0  # namespace 16's counter of a key group's timers (a variable's is its namespace)
TIMER = np.dtype([("clock", "u1"), ("time", "<i8")])
_TIMER_PREFIX = np.dtype([("ns", ">u2"), ("kg", ">u2"), ("clock", "u1"), ("time", ">u8")])
_MAX = np.iinfo(np.int64).max
_ENGINE = str(Path(__file__).resolve().parents[1])  # volley_dagster/: frames a processor's traceback leaves out
FIGURES = ("process_rows_in", "process_rows_out", "process_timers_fired", "process_state_rows",
           "process_timers_pending")


@dataclass(frozen=True)
class DeclaredVariable:
    """A state variable as the layout records it: its namespace never changes."""

    name: str
    kind: str
    fields: Fields  # a map's: its user key's fields, then its value's
    ns: int
    key_fields: int = 0  # a map's user key: its first fields
    ttl_us: int | None = None  # each row expires this long after it was written (processing time)

    @property
    def codec(self) -> PackedRows:
        """Rows as stored: a TTL variable's lead with ``EXPIRES``."""
        return PackedRows((((EXPIRES, "bigint"),) if self.ttl_us is not None else ()) + self.fields)

    def matches(self, declared: StateVariable, what: str) -> bool:
        ttl = None if declared.ttl_ms is None else int(declared.ttl_ms) * 1000
        return (declared.kind == self.kind and ttl == self.ttl_us
                and variable_fields(declared, what) == (self.fields, self.key_fields))


def variable_fields(declared: StateVariable, what: str) -> tuple[Fields, int]:
    """A declared variable's fields (a map's: its user key's, then its value's) and how
    many lead as the user key."""
    values = parse_schema(declared.schema, what)
    if declared.kind != "map":
        return values, 0
    keys = parse_schema(declared.key_schema, f"{what} (its user key)")
    both = {n for n, _ in keys} & {n for n, _ in values}
    if both:
        raise ValueError(f"{what}: the user key and the value both name {sorted(both)}; name them apart")
    return keys + values, len(keys)


@dataclass(frozen=True)
class ProcessShard:
    """What a shard task needs of the resolved processor."""

    name: str
    processor: Any  # the user's object: copied per task, so no task sees another's attributes
    variables: tuple[DeclaredVariable, ...]
    input_columns: tuple[str, ...]
    output_fields: Fields  # the output's columns after the key
    key_column: str
    timer_clock: int | None  # EVENT_CLOCK, PROCESSING_CLOCK_ID (time_mode), or None: no timers
    quote_keys: bool = True
    update_keys: tuple[str, ...] | None = None  # update mode: the last row per key and these wins (None: append)


@dataclass
class _Variable:
    declared: DeclaredVariable
    stored: list[bytes | None]
    decoded: dict[int, tuple[list[tuple[Any, ...]], list[int | None]]] = field(default_factory=dict)  # live rows
    changed: dict[int, bytes | None] = field(default_factory=dict)  # key index -> new blob (None: cleared)


@dataclass(frozen=True)
class _SavedKey:
    """One key's state in memory before a handler call: per variable its rows written
    this epoch and read so far, and its timers."""

    changed: dict[str, bytes | None]
    decoded: dict[str, tuple[list[tuple[Any, ...]], list[int | None]]]
    timers: set[int] | None
    timers_changed: bool


class ShardAccess:
    """The state and timers of one shard's keys for one epoch (``process_api.StateAccess``):
    reads decode lazily per key, writes stay here until ``write``."""

    def __init__(self, shard: ProcessShard, variables: dict[str, _Variable], timer_blobs: list[bytes | None],
                 now: int | None = None) -> None:
        self.shard = shard
        self.now = now  # the epoch's processing time (µs): what a TTL counts from
        self.variables = variables
        self.timer_blobs = timer_blobs
        self.timers_of: dict[int, set[int]] = {}  # key index -> its timers (microseconds), once read
        self.timers_changed: set[int] = set()
        self.ki: int | None = None  # the key the handlers act on now
        self.declared: list[str] = []

    def declare(self, variable: StateVariable) -> None:
        recorded = self.variables.get(variable.name)
        if recorded is None or not recorded.declared.matches(variable, f"state variable {variable.name!r}"):
            raise ValueError(f"init() declared state variable {variable.name!r} ({variable.kind}, {variable.schema!r}) "
                             "unlike the driver's init(): init must declare the same variables every time")
        self.declared.append(variable.name)

    def _key(self) -> int:
        if self.ki is None:
            raise RuntimeError("state and timers belong to a key: use them in handleInputRows or handleExpiredTimer")
        return self.ki

    def _variable(self, name: str) -> _Variable:
        found = self.variables.get(name)
        if found is None or name not in self.declared:
            raise KeyError(f"no state variable {name!r} was declared in init()")
        return found

    def _live(self, var: _Variable, ki: int) -> tuple[list[tuple[Any, ...]], list[int | None]]:
        found = var.decoded.get(ki)
        if found is None:
            blob = var.changed[ki] if ki in var.changed else var.stored[ki]
            rows = var.declared.codec.decode(blob) if blob is not None else []
            if var.declared.ttl_us is None:
                found = (rows, [None] * len(rows))
            else:  # an expired row is never shown, as in Spark, whether or not it is cleaned up yet
                now = self._clock()
                live = [r for r in rows if r[0] > now]
                found = ([r[1:] for r in live], [r[0] for r in live])
            var.decoded[ki] = found
        return found

    def _clock(self) -> int:
        if self.now is None:
            raise ValueError("a state TTL counts from the epoch's processing time, which this epoch's range does not "
                             "record (cut by an engine before it was kept): cut the epoch again with this engine")
        return self.now

    def rows(self, name: str) -> list[tuple[Any, ...]]:
        return list(self._live(self._variable(name), self._key())[0])

    def expiries(self, name: str) -> list[int | None]:
        return list(self._live(self._variable(name), self._key())[1])

    def put(self, name: str, rows: list[Any], expires: list[int | None] | None = None) -> None:
        ki, var = self._key(), self._variable(name)
        declared, what = var.declared, f"state variable {name!r}"
        if declared.kind == "value" and len(rows) > 1:
            raise TypeError(f"{what} holds one value per key")
        user = PackedRows(declared.fields)
        normalized = [user.row(r, what) for r in rows]
        if declared.ttl_us is not None:
            fresh = self._clock() // 1000 * 1000 + declared.ttl_us  # in ms, as Spark counts a TTL
            normalized = [(fresh if e is None else e, *r)
                          for r, e in zip(normalized, expires or [None] * len(rows), strict=True)]
        blob = declared.codec.encode(normalized, what) if rows else None
        var.changed[ki] = blob
        var.decoded.pop(ki, None)
        self._live(var, ki)  # what the next epoch will read, and a value that does not fit fails here

    def _timers(self, ki: int) -> set[int]:
        found = self.timers_of.get(ki)
        if found is None:
            blob = self.timer_blobs[ki]
            found = set() if blob is None else set(np.frombuffer(blob, TIMER)["time"].tolist())
            self.timers_of[ki] = found
        return found

    def register_timer(self, ms: int) -> None:
        if self.shard.timer_clock is None:
            raise ValueError("registerTimer: a timer needs a clock; give process(time_mode='EventTime', "
                             "event_time=<column>) or process(time_mode='ProcessingTime')")
        if not -_MAX // 1000 < ms < _MAX // 1000:
            raise ValueError(f"registerTimer({ms}): give milliseconds since the epoch (this is outside the years "
                             "a timer can hold; a pandas Timestamp's .value is nanoseconds)")
        ki = self._key()
        self._timers(ki).add(ms * 1000)
        self.timers_changed.add(ki)

    def delete_timer(self, ms: int) -> None:
        ki = self._key()
        self._timers(ki).discard(ms * 1000)
        self.timers_changed.add(ki)

    def timers(self) -> list[int]:
        return sorted(t // 1000 for t in self._timers(self._key()))

    def drop(self, name: str) -> None:
        raise ValueError(f"deleteIfExists({name!r}): a recorded state variable is dropped with `volley migrate`, "
                         "never as a side effect of code: stop declaring it, then migrate the pipeline")

    def saved(self, ki: int) -> _SavedKey:
        """The key's state before a handler call, to run it again (``_culprit``)."""
        return _SavedKey({n: v.changed[ki] for n, v in self.variables.items() if ki in v.changed},
                         {n: v.decoded[ki] for n, v in self.variables.items() if ki in v.decoded},
                         None if ki not in self.timers_of else set(self.timers_of[ki]), ki in self.timers_changed)

    def restore(self, ki: int, saved: _SavedKey) -> None:
        for name, var in self.variables.items():
            var.changed.pop(ki, None)
            var.decoded.pop(ki, None)
            if name in saved.changed:
                var.changed[ki] = saved.changed[name]
            if name in saved.decoded:
                rows, expires = saved.decoded[name]
                var.decoded[ki] = (list(rows), list(expires))
        self.timers_of.pop(ki, None)
        if saved.timers is not None:
            self.timers_of[ki] = set(saved.timers)
        self.timers_changed.discard(ki)
        if saved.timers_changed:
            self.timers_changed.add(ki)


def apply_process(shard: ProcessShard, txn: ShardTransaction, data: pa.Table,
                  step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
    """Run the processor over one shard's rows of the epoch (``KEY``, ``KEY_GROUP``,
    ``POS``, ``ROWS`` and the input columns): each key's rows in log order, then the
    timers due on the processor's clock; returns the output columns (key first)."""
    data = _in_log_order(data, shard.input_columns)
    kg_rows = data.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False).astype(np.int64)
    key_rows = data.column(columns.KEY).combine_chunks()
    starts = _runs(kg_rows, key_rows)
    keys: list[Any] = key_rows.take(pa.array(starts, pa.int64())).to_pylist() if len(starts) else []
    key_groups = kg_rows[starts].tolist()
    lower, limit = timer_bounds(shard, step)
    due_kg, due_keys = _due(txn, step, shard.timer_clock, lower, limit)
    if any(v.ttl_us is not None for v in shard.variables):  # the keys whose TTL rows expire by now
        ttl_kg, ttl_keys = _due(txn, step, TTL_CLOCK, step.processing_time_before, step.processing_time, 2)
        due_kg, due_keys = np.concatenate([due_kg, ttl_kg]), pa.concat_arrays([due_keys, ttl_keys.cast(due_keys.type)])
    seen = set(zip(key_groups, keys, strict=True))
    for kg, key in zip(due_kg.tolist(), due_keys.to_pylist(), strict=True):
        if (kg, key) not in seen:
            seen.add((kg, key))
            key_groups.append(kg)
            keys.append(key)
    groups = np.array(key_groups, dtype=np.int64)
    key_array = pa.array(keys, pa.int64() if step.key_kind == "int" else pa.string())

    variables = {v.name: _Variable(v, txn.get_many(encode_keys(v.ns, groups, key_array), namespace_prefix(v.ns)))
                 for v in shard.variables}
    by_key = encode_keys(BY_KEY_NS, groups, key_array)
    access = ShardAccess(shard, variables, txn.get_many(by_key, namespace_prefix(BY_KEY_NS)), step.processing_time)
    processor = copy.deepcopy(shard.processor)
    run = _Run(shard, step, access, processor, keys)
    run.call(None, "init", None, processor.init, StatefulProcessorHandle(access))

    frame = spark_frame(data.select(list(shard.input_columns))) if data.num_rows else None
    positions = data.column(columns.POS).to_numpy(zero_copy_only=False)
    ends = np.append(starts[1:], data.num_rows)[:len(starts)]
    for ki, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        assert frame is not None
        rows = frame.iloc[a:b].reset_index(drop=True)
        run.input_rows(ki, rows, positions[a:b])
    fired, waiting = run.fire_timers(limit)
    if callable(getattr(processor, "close", None)):  # optional, as in Spark
        run.call(None, "close", None, processor.close)

    held = _write(txn, step, access, groups, key_array, by_key)
    output = run.output(key_array)
    figures = {"process_rows_in": data.num_rows, "process_rows_out": len(output[0]), "process_timers_fired": fired,
               "process_state_rows": int(held[0]), "process_timers_pending": int(held[1])}
    if step.processing_time is not None:
        figures[PROCESSING_CLOCK] = step.processing_time
    if waiting is not None:
        figures[TIMERS_DUE_FROM] = waiting
    new_keys = sum(1 for ki in range(len(keys)) if access.timer_blobs[ki] is None
                   and all(v.stored[ki] is None for v in variables.values()))
    return output, OperatorStats(len(keys), new_keys, figures, partial_records(data))


def _in_log_order(data: pa.Table, inputs: Sequence[str]) -> pa.Table:
    """The shard's rows by key, each key's in log order (``POS``). Rows of one record
    (a transform's explode) share a position, and the exchange hands them over in any
    order: they are ordered by their values (the sortable input columns), so every
    attempt sees one order."""
    keys = [(columns.KEY_GROUP, "ascending"), (columns.KEY, "ascending"), (columns.POS, "ascending")]
    data = data.take(pc.sort_indices(data, sort_keys=keys))
    pos = data.column(columns.POS).to_numpy(zero_copy_only=False)
    if len(pos) < 2 or not (pos[1:] == pos[:-1]).any():
        return data
    sortable = [c for c in inputs if _sortable(data.schema.field(c).type)]
    return data.take(pc.sort_indices(data, sort_keys=keys + [(c, "ascending") for c in sortable]))


def _sortable(kind: pa.DataType) -> bool:
    return (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
            or pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_temporal(kind) or pa.types.is_decimal(kind))


def _runs(kg_rows: np.ndarray, key_rows: pa.Array) -> np.ndarray:
    """Where each key's rows start in rows sorted by (key group, key)."""
    if not len(kg_rows):
        return np.zeros(0, dtype=np.int64)
    changed = pc.not_equal(key_rows.slice(1), key_rows.slice(0, len(key_rows) - 1)).to_numpy(zero_copy_only=False)
    changed = changed | (kg_rows[1:] != kg_rows[:-1])
    return np.concatenate([[0], np.flatnonzero(changed) + 1]).astype(np.int64)


class _Run:
    """One shard task's calls into the user's processor, and what they emitted."""

    def __init__(self, shard: ProcessShard, step: ShardStep, access: ShardAccess, processor: Any,
                 keys: list[Any]) -> None:
        self.shard, self.step, self.access, self.processor, self.keys = shard, step, access, processor, keys
        self.emitted: list[tuple[int, pd.DataFrame]] = []
        watermark = -1 if step.watermark is None else step.watermark // 1000
        processing = -1 if step.processing_time is None else step.processing_time // 1000
        self.timer_values = TimerValues(processing, watermark)

    def call(self, ki: int | None, phase: str, where: str | None, fn: Any, *args: Any) -> Any:
        self.access.ki = ki
        try:
            return fn(*args)
        except Exception as exc:
            raise self.error(ki, phase, where, exc) from exc
        finally:
            self.access.ki = None

    def error(self, ki: int | None, phase: str, where: str | None, exc: BaseException) -> ProcessorError:
        step = self.step
        key = "" if ki is None else f" on key {self.keys[ki]!r}" if self.shard.quote_keys else " on a key (withheld)"
        user = "".join(traceback.format_exception_only(type(exc), exc)).strip().replace("\n", " ")
        return ProcessorError(
            f"processor {self.shard.name!r} failed in {phase}{key}, epoch {step.epoch}, shard {step.shard}"
            f"{', ' + where if where else ''}: {user}. Nothing was committed; fix the processor, then run epoch "
            f"{step.epoch} again (it reads the same recorded range)\n{user_traceback(exc)}")

    def input_rows(self, ki: int, rows: pd.DataFrame, positions: np.ndarray) -> None:
        key = (self.keys[ki],)
        saved = self.access.saved(ki)
        try:
            self.emitted.extend((ki, frame) for frame in self._handle(ki, key, rows))
        except ProcessorError as exc:
            culprit = self._culprit(ki, key, rows, saved)
            where = f"handling position {int(positions[culprit])}" if culprit is not None else \
                f"handling its records at positions {int(positions[0])}..{int(positions[-1])}"
            raise self.error(ki, "handleInputRows", where, exc.__cause__ or exc) from exc.__cause__

    def _handle(self, ki: int, key: tuple[Any, ...], rows: pd.DataFrame) -> Any:
        def drained() -> list[Any]:
            return _frames(self.processor.handleInputRows(key, iter([rows]), self.timer_values), "handleInputRows")
        return self.call(ki, "handleInputRows", None, drained)

    def _culprit(self, ki: int, key: tuple[Any, ...], rows: pd.DataFrame, saved: _SavedKey) -> int | None:
        """The first row whose prefix of the key's rows makes the handler raise: the
        record it was handling (processors are deterministic), by bisection from the
        key's state before the call; None when no prefix does."""
        low, high = 1, len(rows)  # the full prefix raises
        while low < high:
            mid = (low + high) // 2
            self.access.restore(ki, saved)
            try:
                self._handle(ki, key, rows.iloc[:mid].reset_index(drop=True))
                low = mid + 1
            except ProcessorError:
                high = mid
        return low - 1 if len(rows) else None

    def fire_timers(self, limit: int | None) -> tuple[int, int | None]:
        """Every timer at or before ``limit`` (µs) when the timers' turn comes, by time;
        one a timer's handler registers waits for the next epoch (Spark's next
        micro-batch), so a timer that re-arms itself fires once an epoch. Returns how
        many fired and the earliest such one at or before ``limit`` (the next epoch's
        scan starts there)."""
        if limit is None:
            return 0, None
        for ki in range(len(self.keys)):
            self.access._timers(ki)
        due = sorted((t, ki) for ki, times in self.access.timers_of.items() for t in times if t <= limit)
        for time, ki in due:
            if time not in self.access._timers(ki):
                continue  # deleted by a handler of its key that fired before it
            where = f"its timer at {pd.Timestamp(time, unit='us', tz='UTC').isoformat()}"

            def expired(ki: int = ki, time: int = time) -> list[Any]:
                out = self.processor.handleExpiredTimer((self.keys[ki],), self.timer_values,
                                                        ExpiredTimerInfo(time // 1000))
                return _frames(out, "handleExpiredTimer")
            self.emitted.extend((ki, frame) for frame in self.call(ki, "handleExpiredTimer", where, expired))
            self.access._timers(ki).discard(time)  # after the handler, as Spark does
            self.access.timers_changed.add(ki)
        waiting = [t for times in self.access.timers_of.values() for t in times if t <= limit]
        return len(due), min(waiting, default=None)

    def output(self, key_array: pa.Array) -> list[pa.Array]:
        fields = self.shard.output_fields
        schema = arrow_schema(fields)
        frames = [(ki, f) for ki, f in self.emitted if len(f)]
        if not frames:
            return [key_array.slice(0, 0), *(pa.array([], t) for t in schema.types)]
        for ki, frame in frames:  # each frame whole: a missing column is an error, never nulls
            missing = [n for n, _ in fields if n not in frame.columns]
            if missing:
                raise self.error(ki, "output", None, ValueError(
                    f"an emitted frame lacks output column {missing[0]!r}; output_schema declares "
                    f"{[n for n, _ in fields]}, the frame has {list(frame.columns)}"))
        index = np.concatenate([np.full(len(f), ki, dtype=np.int64) for ki, f in frames])
        try:
            table = pa.Table.from_pandas(pd.concat([f for _, f in frames], ignore_index=True), preserve_index=False)
        except (pa.ArrowException, ValueError, TypeError) as exc:
            raise self.error(None, "output", None, exc) from exc
        keys = key_array.take(pa.array(index))
        out = [keys]
        for name, _ in fields:
            out.append(self._output_column(table, name, schema.field(name).type))
        if self.shard.update_keys is not None:
            out = _last_rows(out, [self.shard.key_column, *(n for n, _ in fields)], self.shard.update_keys)
        if self.shard.key_column in table.column_names:  # a frame without it takes the key it was emitted for
            try:
                given = pc.coalesce(table.column(self.shard.key_column).combine_chunks().cast(keys.type), keys)
            except (pa.ArrowException, ValueError) as exc:
                culprit = next((k for k, f in frames if self.shard.key_column in f.columns
                                and not _casts(f[self.shard.key_column], keys.type)), None)
                raise self.error(culprit, "output", None, ValueError(
                    f"an output row's {self.shard.key_column!r} does not read as the key's type ({keys.type}): "
                    f"{exc}")) from exc
            wrong = np.flatnonzero(~pc.fill_null(pc.equal(given, keys), False).to_numpy(zero_copy_only=False))
            if len(wrong):
                ki = int(index[wrong[0]])
                raise self.error(ki, "output", None, ValueError(
                    f"an output row's {self.shard.key_column!r} is {given[int(wrong[0])].as_py()!r}, not the key "
                    "it was emitted for: a processor emits rows of its own key"))
        return out

    def _output_column(self, table: pa.Table, name: str, kind: pa.DataType) -> pa.Array:
        column = table.column(name).combine_chunks()
        try:
            return column.cast(kind) if column.type != kind else column
        except (pa.ArrowException, ValueError) as exc:
            raise self.error(None, "output", None, ValueError(
                f"output column {name!r} is {column.type}, which does not cast to the declared {kind}: {exc}")) from exc


def spark_frame(table: pa.Table) -> pd.DataFrame:
    """The rows as ``transformWithStateInPandas`` hands them over: timestamps without a
    time zone (UTC's wall clock, the engine's session zone), so Spark's processors run
    unchanged."""
    frame = table.to_pandas()
    for name, kind in zip(table.column_names, table.schema.types, strict=True):
        if pa.types.is_timestamp(kind) and kind.tz is not None:
            frame[name] = frame[name].dt.tz_convert("UTC").dt.tz_localize(None)
    return frame


def _last_rows(out: list[pa.Array], names: list[str], keys: tuple[str, ...]) -> list[pa.Array]:
    """Update mode: of the rows with one key and ``keys``, the last emitted."""
    table = pa.table(out, names=names).append_column("_volley_at", pa.array(np.arange(len(out[0]), dtype=np.int64)))
    last = table.group_by([names[0], *keys], use_threads=False).aggregate([("_volley_at", "max")])
    at = np.sort(last.column("_volley_at_max").to_numpy())
    return [column.take(pa.array(at)) for column in out]


def user_traceback(exc: BaseException) -> str:
    """The processor's own frames of ``exc``'s traceback (the engine's left out): the
    first line a person reads (Spark shows a worker's last exception only)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_ENGINE)]
    return "".join(["Traceback (most recent call last):\n", *traceback.format_list(frames),
                    *traceback.format_exception_only(type(exc), exc)]).rstrip()


def _casts(values: pd.Series, kind: pa.DataType) -> bool:
    try:
        pa.array(values).cast(kind)
        return True
    except (pa.ArrowException, ValueError):
        return False


def _frames(result: Any, phase: str) -> list[Any]:
    """A handler's result drained: an iterator of pandas DataFrames (None or one frame also do)."""
    if result is None:
        return []
    items: Iterable[Any] = [result] if isinstance(result, pd.DataFrame) else result
    frames = list(items)
    for item in frames:
        if not isinstance(item, pd.DataFrame):
            raise TypeError(f"{phase} returned a {type(item).__name__} among its output; yield pandas DataFrames")
    return frames


def timer_bounds(shard: ProcessShard, step: ShardStep) -> tuple[int | None, int | None]:
    """The processor's clock before the epoch and the limit its timers fire up to (µs):
    the watermark (every timer at the stream's end: ``fire_limit``), or the processing
    time of the epoch's cut."""
    if shard.timer_clock == EVENT_CLOCK:
        before, limit = step.watermark_before, step.fire_limit
    elif shard.timer_clock == PROCESSING_CLOCK_ID:
        before, limit = step.processing_time_before, step.processing_time
    else:
        return None, None
    if step.due_from is not None and before is not None:  # timers a timer's handler registered, still due
        before = min(before, step.due_from - 1)
    return before, limit


def _due(txn: ShardTransaction, step: ShardStep, clock_id: int | None, before: int | None,
         limit: int | None, tag: int = 0) -> tuple[np.ndarray, pa.Array]:
    """The keys with a timer in (the previous fire limit, this one]: one range scan per
    key group of namespace 14, from past the previous limit (every earlier timer has
    fired), so it costs what fires. ``tag``: the bytes between time and key (a TTL
    entry's variable namespace)."""
    layout = step.layout
    empty = (np.zeros(0, dtype=np.int64), pa.array([], pa.int64() if step.key_kind == "int" else pa.string()))
    if clock_id is None or limit is None or layout is None or step.shard is None or \
            (before is not None and before >= limit):
        return empty
    upper_at = ordered_us(np.array([min(limit, _MAX - 1) + 1])).tobytes()
    lower_at = b"" if before is None else ordered_us(np.array([min(before, _MAX - 1) + 1])).tobytes()
    found: list[bytes] = []
    start, end = layout.key_group_range(step.shard)
    clock = bytes([clock_id])
    for kg in range(start, end):
        group = namespace_prefix(TIMERS_NS) + int(kg).to_bytes(2, "big") + clock
        found.extend(k for k, _ in txn.scan_flushed(group + lower_at, group + upper_at))
    if not found:
        return empty
    entries = pa.array(found, pa.binary())  # ns | kg | clock | time | key -> ns 15 | kg | key
    by_key = pc.binary_join_element_wise(pa.scalar(namespace_prefix(BY_KEY_NS)), pc.binary_slice(entries, 2, 4),
                                         pc.binary_slice(entries, _TIMER_PREFIX.itemsize + tag, 1 << 30), pa.scalar(b""))
    kg_found, keys = decode_keys(step.key_kind, by_key.to_pylist())
    unique = pa.table({"kg": kg_found, "key": keys}).group_by(["kg", "key"], use_threads=False).aggregate([])
    return unique.column("kg").to_numpy(), unique.column("key").combine_chunks()


def _write(txn: ShardTransaction, step: ShardStep, access: ShardAccess, groups: np.ndarray, key_array: pa.Array,
           by_key: list[bytes]) -> np.ndarray:
    """Every change of the epoch into the transaction (one ``WriteBatch`` at flush), each
    list in state-key order; returns the rows and timers the shard holds after it."""
    deltas = {TIMER_COUNTER: np.zeros(len(groups), dtype=np.int64)}
    index_added: list[bytes] = []
    index_removed: list[bytes] = []
    for var in access.variables.values():
        deltas[var.declared.ns] = delta = np.zeros(len(groups), dtype=np.int64)
        if var.declared.ttl_us is not None:
            _expire(var, access, len(groups))
            _index_expiries(var, groups, by_key, index_added, index_removed)
        if not var.changed:
            continue
        kis = np.array(sorted(var.changed), dtype=np.int64)
        encoded = encode_keys(var.declared.ns, groups[kis], key_array.take(pa.array(kis)))
        codec = var.declared.codec
        for ki in kis.tolist():
            delta[ki] = codec.count(var.changed[ki]) - codec.count(var.stored[ki])
        _set_and_delete(txn, encoded, [var.changed[ki] for ki in kis.tolist()])
    delta_timers = deltas[TIMER_COUNTER]
    added: list[tuple[bytes, bytes]] = []
    removed: list[bytes] = []
    changed = sorted(access.timers_changed)
    clock = access.shard.timer_clock or 0
    for ki in changed:
        blob = access.timer_blobs[ki]
        old = set() if blob is None else set(np.frombuffer(blob, TIMER)["time"].tolist())
        new = access.timers_of[ki]
        tail = by_key[ki][4:]  # the key's bytes
        for time in new - old:
            added.append((_timer_key(int(groups[ki]), clock, time) + tail, b""))
        removed.extend(_timer_key(int(groups[ki]), clock, time) + tail for time in old - new)
        delta_timers[ki] = len(new) - len(old)
    if changed:
        blobs = []
        for ki in changed:
            times = np.array(sorted(access.timers_of[ki]), dtype=np.int64)
            records = np.zeros(len(times), dtype=TIMER)
            records["clock"], records["time"] = access.shard.timer_clock or 0, times
            blobs.append(records.tobytes() if len(times) else None)
        _set_and_delete(txn, [by_key[ki] for ki in changed], blobs)
    added += [(k, b"") for k in index_added]
    removed += index_removed
    added.sort()
    txn.set_many([k for k, _ in added], [v for _, v in added])
    txn.delete_many(sorted(removed))
    return _count(txn, step, groups, deltas)


def _expire(var: _Variable, access: ShardAccess, n_keys: int) -> None:
    """Every row of the epoch's keys whose TTL ran out by its processing time leaves
    state (the keys an expiry entry named due are among them); none is ever shown."""
    now, codec = access._clock(), var.declared.codec
    for ki in range(n_keys):
        blob = var.changed[ki] if ki in var.changed else var.stored[ki]
        if blob is None:
            continue
        rows = codec.decode(blob)
        live = [r for r in rows if r[0] > now]
        if len(live) < len(rows):
            var.changed[ki] = codec.encode(live, var.declared.name) if live else None


def _index_expiries(var: _Variable, groups: np.ndarray, by_key: list[bytes], added: list[bytes],
                    removed: list[bytes]) -> None:
    """Each key's rows of a TTL variable have one namespace-14 entry, at their earliest
    expiry: moved when the rows change."""
    codec, tag = var.declared.codec, var.declared.ns.to_bytes(2, "big")
    for ki, blob in var.changed.items():
        old = var.stored[ki]
        before = min(r[0] for r in codec.decode(old)) if old is not None else None
        after = min(r[0] for r in codec.decode(blob)) if blob is not None else None
        if before == after:
            continue
        tail = tag + by_key[ki][4:]
        if before is not None:
            removed.append(_timer_key(int(groups[ki]), TTL_CLOCK, before) + tail)
        if after is not None:
            added.append(_timer_key(int(groups[ki]), TTL_CLOCK, after) + tail)


def _timer_key(kg: int, clock: int, time: int) -> bytes:
    return namespace_prefix(TIMERS_NS) + kg.to_bytes(2, "big") + bytes([clock]) + ordered_us(np.array([time])).tobytes()


def _set_and_delete(txn: ShardTransaction, keys: Sequence[bytes], values: Sequence[bytes | None]) -> None:
    pairs = sorted(zip(keys, values, strict=True))
    txn.set_many([k for k, v in pairs if v is not None], [v for _, v in pairs if v is not None])
    txn.delete_many([k for k, v in pairs if v is None])


def _count(txn: ShardTransaction, step: ShardStep, groups: np.ndarray, deltas: dict[int, np.ndarray]) -> np.ndarray:
    """The state rows and timers the shard holds after the epoch, kept per key group and
    counter (a rescale moves the counts with the state; a migration that drops a
    variable drops its counter with it)."""
    layout = step.layout
    if layout is None or step.shard is None:
        return np.zeros(2, dtype=np.int64)
    start, end = layout.key_group_range(step.shard)
    kgs, counters = np.arange(start, end), sorted(deltas)
    count_keys = [count_key(int(kg), c) for kg in kgs for c in counters]  # ascending: key group, then counter
    stored = txn.get_many(count_keys, namespace_prefix(COUNTS_NS), may_scan=False)
    held = np.frombuffer(b"".join(v if v is not None else bytes(8) for v in stored), dtype="<i8")
    held = held.reshape(len(kgs), len(counters)).astype(np.int64)
    changed = np.zeros(held.shape, dtype=bool)
    for j, counter in enumerate(counters):
        delta = np.bincount(groups - start, weights=deltas[counter], minlength=len(kgs)).astype(np.int64)
        held[:, j] += delta
        changed[:, j] = np.bincount(groups - start, weights=deltas[counter] != 0, minlength=len(kgs)) > 0
    at = np.flatnonzero(changed.ravel())
    flat = held.ravel()
    txn.set_many([count_keys[i] for i in at], [flat[i:i + 1].astype("<i8").tobytes() for i in at])
    timers = counters.index(TIMER_COUNTER)
    return np.array([held.sum() - held[:, timers].sum(), held[:, timers].sum()], dtype=np.int64)


def count_key(kg: int, counter: int) -> bytes:
    return namespace_prefix(COUNTS_NS) + kg.to_bytes(2, "big") + counter.to_bytes(2, "big")
