"""The keyed running aggregate: Spark pre-aggregates per key, shard tasks fold
those partials into RocksDB state and emit each changed key's new value."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Sequence

import numpy as np
import pyarrow as pa
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.errors import AggregateOverflowError, ConfigError, StateLayoutError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.accumulators import Accumulator, StateOverflow, ValueKind, spark_ddl
from volley_dagster.operators.base import (
    LATEST_EVENT,
    FillRecords,
    KeyedRows,
    OperatorStats,
    ShardStep,
    StageClock,
    StatefulOperator,
    StateNamespaces,
    partial_records,
    summed,
)
from volley_dagster.operators.event_time import EventTime
from volley_dagster.operators.ttl import (
    EXPIRED,
    KEYS_EXPIRED,
    TOUCHED,
    TOUCHED_PARTIAL,
    ShardExpiry,
    StateTtl,
    with_ttl_namespaces,
)
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.partitioning import ShardRoute
from volley_dagster.state import bulk_rows
from volley_dagster.state.keys import decode_keys, encode_keys, in_state_order, key_columns, namespace_prefix
from volley_dagster.state.resident import MirrorKeys, ResidentRecords, ResidentShard
from volley_dagster.state.transaction import ShardTransaction

STATE_FORMAT = 2  # 2: first/last keep their log position


@dataclass(frozen=True)
class Aggregate:
    """``aggregate(total=sum_("amount"), events=count())`` before it has seen a schema."""

    accumulators: tuple[tuple[str, Accumulator], ...]
    namespace: int = 1
    ttl: StateTtl | None = None

    def __post_init__(self) -> None:
        if not self.accumulators:
            raise ConfigError("aggregate() needs at least one accumulator, e.g. aggregate(events=count())")
        for name, acc in self.accumulators:
            if not isinstance(acc, Accumulator):
                raise ConfigError(f"aggregate({name}=...) must be an accumulator such as sum_('x'), got {acc!r}")
            if name.startswith("_volley") or ":" in name or (self.ttl is not None and name == EXPIRED):
                raise ConfigError(f"aggregate output name {name!r} is reserved")

    def resolve(self, schema: T.StructType) -> ResolvedAggregate:
        kinds = tuple(acc.kind(schema) for _, acc in self.accumulators)
        if self.ttl is not None and self.ttl.event_time is not None:
            self.ttl.event_time.check(schema, "aggregate(ttl=...) event_time")
        return ResolvedAggregate(self.accumulators, kinds, self.namespace, self.ttl)

    def recorded(self, layout: JsonObject) -> ResolvedAggregate:
        """Resolved as the checkpoint root recorded it (``layout()``), without Spark."""
        ttl = (self.ttl or StateTtl.recorded(layout["ttl"])) if "ttl" in layout else None
        return ResolvedAggregate(self.accumulators, tuple(a["kind"] for a in layout["accumulators"]),
                                 layout["namespace"], ttl)


@dataclass(frozen=True)
class ResolvedAggregate(KeyedRows):
    """An aggregate bound to the input's column types: a fixed state record layout."""

    accumulators: tuple[tuple[str, Accumulator], ...]
    kinds: tuple[ValueKind | None, ...]
    namespace: int
    ttl: StateTtl | None = None
    dtype: np.dtype = field(init=False, compare=False)

    def __post_init__(self) -> None:
        fields: list[tuple[str, Any]] = [("_format", np.uint8)]
        for (name, acc), kind in zip(self.accumulators, self.kinds, strict=True):
            fields.extend(acc.fields(name, kind))
        if self.ttl is not None:
            fields.append((TOUCHED, np.int64))
        object.__setattr__(self, "dtype", np.dtype(fields))

    @property
    def resident_records(self) -> ResidentRecords:
        return ResidentRecords(self.dtype)

    @property
    def namespaces(self) -> StateNamespaces:
        return with_ttl_namespaces(self.namespace, self.ttl)

    def decode_state(self, keys: list[bytes], values: list[bytes], key_kind: str, key_name: str,
                     key_group: str | None = None) -> pa.Table:
        groups, key_values = decode_keys(key_kind, keys)
        state, _ = self.decode(values)
        front, names = key_columns(key_values, key_name, groups, key_group)
        return pa.table(front + self.outputs(state), names=names + [n for n, _ in self.output_fields()])

    def layout(self) -> JsonObject:
        """What must not change between epochs of one checkpoint root."""
        layout: JsonObject = {
            "namespace": self.namespace,
            "format": STATE_FORMAT,
            "accumulators": [
                {"name": name, "type": type(acc).__name__, "column": acc.column, "kind": kind}
                for (name, acc), kind in zip(self.accumulators, self.kinds, strict=True)
            ],
        }
        if self.ttl is not None:
            layout["ttl"] = self.ttl.layout()
        return layout

    def partial_exprs(self) -> list[Column]:
        exprs = [F.count(F.lit(1)).alias(columns.ROWS)]
        for (name, acc), kind in zip(self.accumulators, self.kinds, strict=True):
            exprs.extend(expr.alias(col) for col, expr in acc.partials(name, kind).items())
        return exprs + (self.ttl.partial_exprs() if self.ttl is not None else [])

    def migrate_records(self, old: StatefulOperator, values: list[bytes], fill: FillRecords) -> list[bytes]:
        assert isinstance(old, ResolvedAggregate)
        state, _ = old.decode(values)
        out = self.blank_rows(len(state))
        fill(out, state, self)
        return self.encode(out)

    # -- in the epoch's Spark stage (``operators.base.SparkOperator``) -----------------

    @property
    def event_time(self) -> EventTime | None:
        """An event-time TTL's clock: keys expire at the watermark after the epoch."""
        return self.ttl.event_time if self.ttl is not None else None

    @property
    def runs_without_records(self) -> bool:
        """With ``ttl_epochs``, keys expire in epochs without records too."""
        return self.ttl is not None and self.ttl.by_epochs

    rows_are_sink_rows: ClassVar[bool] = True
    one_row_per_key: ClassVar[bool] = True

    def input_columns(self) -> tuple[str, ...]:
        reads = [columns.KEY] + [c for _, acc in self.accumulators for c in acc.input_columns()]
        if self.ttl is not None and self.ttl.event_time is not None:
            reads.append(self.ttl.event_time.time_column)
        return tuple(dict.fromkeys(reads))

    def assign(self, rows: DataFrame) -> DataFrame:
        return rows

    def late(self, assigned: DataFrame, watermark: int | None) -> None:
        return None  # a running aggregate takes every record

    def late_bound(self, watermark: int | None) -> None:
        return None

    def acts_from(self, earliest_us: int, next_due: int | None) -> int | None:
        """An event-time TTL acts on W[N] only by expiring a key whose deadline is at or
        before it: an entry of the expiry index (none before ``next_due``) or a key the
        epoch updates (its deadline no earlier than the epoch's earliest record's)."""
        if self.ttl is None or self.ttl.by_epochs or next_due is None:
            return None
        return min(next_due, earliest_us + self.ttl.amount)

    def shard_input(self, assigned: DataFrame, clock: StageClock, step: ShardStep) -> tuple[DataFrame, ShardStep]:
        if self.event_time is not None:
            step = replace(step, expire_limit=clock.watermark)
        return assigned, step

    def partials(self, route: ShardRoute) -> DataFrame:
        """The partials per key, in their shard's partition (null keys too: one row,
        counted by the shard task)."""
        return route.rows.groupBy(*route.grouping, columns.KEY).agg(*self.partial_exprs())

    def sink_output(self, output: pa.Table, rng: EpochRange) -> tuple[pa.Table, None]:
        return output, None

    def output_fields(self) -> list[tuple[str, ValueKind]]:
        return [(name, acc.output_kind(kind)) for (name, acc), kind in zip(self.accumulators, self.kinds, strict=True)]

    def output_ddl(self) -> list[str]:
        expired = [f"`{EXPIRED}` boolean"] if self.ttl is not None else []
        return [f"`{name}` {spark_ddl(kind)}" for name, kind in self.output_fields()] + expired

    def output_names(self) -> list[str]:
        return [name for name, _ in self.output_fields()] + ([EXPIRED] if self.ttl is not None else [])

    def epoch_figures(self, shards: Sequence[OperatorStats]) -> dict[str, int]:
        return summed(shards, [KEYS_EXPIRED]) if self.ttl is not None else {}

    def apply(self, txn: ShardTransaction, data: pa.Table, step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
        """Running aggregate: every touched key's new value is the output; with a TTL,
        also every key that expires, once, flagged ``expired``."""
        # by key: the mirror looks int keys up in one sweep and the rows leave in the task's
        # output order (``ShardMerge._output`` then sorts sorted rows); RocksDB is written
        # in state-key order (``_write``)
        data = data.sort_by([(columns.KEY, "ascending")])
        n = data.num_rows
        key_groups = data.column(columns.KEY_GROUP).to_numpy(zero_copy_only=False)
        key_values = data.column(columns.KEY).combine_chunks()
        keys: list[bytes] | None = None  # each row's state key: for the TTL and for reads the mirror cannot answer
        expiry = None
        if self.ttl is not None:
            keys = encode_keys(self.namespace, key_groups, key_values)
            expiry = ShardExpiry(self.ttl, txn, step, keys)
            if expiry.due:  # untouched keys whose TTL entry came due: read them too
                keys = keys + expiry.due
                due = decode_keys(step.key_kind, expiry.due)[1].cast(key_values.type)
                key_values = pa.concat_arrays([key_values, due])
        resident = txn.resident if isinstance(txn.resident, ResidentShard) else None
        mirror_keys = MirrorKeys.of(key_values) if resident is not None else None
        found = resident.lookup(mirror_keys, self.blank_rows) if resident is not None and mirror_keys is not None else None
        if found is not None:
            state, existed = found
        else:
            keys = keys if keys is not None else encode_keys(self.namespace, key_groups, key_values)
            state, existed = self.decode(txn.get_many(keys, namespace_prefix(self.namespace)))
            if resident is not None:
                self._mirror(resident, txn.scanned_entries, step.key_kind)
        touched = state[:n]
        try:
            self.merge(touched, data, step.epoch)
        except StateOverflow as overflow:
            keys_shown = key_values.take(pa.array(overflow.rows[:5])).to_pylist()
            raise AggregateOverflowError(
                f"epoch {step.epoch}: {overflow.aggregate} leaves int64 for {len(overflow.rows)} key(s), e.g. {keys_shown}; "
                "nothing was committed. Sum a float instead (.with_column(name, 'CAST(name AS DOUBLE)')) or scale "
                "the values down, in a new checkpoint root"
            ) from None
        state[:n] = touched
        outputs = [key_values] + self.outputs(state)
        stats = OperatorStats(n, int((~existed[:n]).sum()), records=partial_records(data))
        if expiry is None:
            self._write(txn, key_groups, key_values, state)
            if resident is not None and mirror_keys is not None:
                resident.update(mirror_keys, state)
            return outputs, stats
        assert keys is not None
        touched_now = self._touched_now(data, step)
        expired = expiry.settle(keys, state, existed, touched_now)
        written = ~expired[:n]
        lives = bulk_rows.select(state[:n], written)
        self._write(txn, key_groups, key_values, state, written)
        if expired.any():
            txn.delete_many(np.array(keys, dtype=object)[expired].tolist())
        if resident is not None and mirror_keys is not None:
            if expired.any() or len(state) > n:
                resident.update(mirror_keys[:n][written], lives)
                resident.remove(mirror_keys[expired])
            else:  # the lookup's own keys: the mirror finds them where the lookup did
                resident.update(mirror_keys, state)
        emitted = np.arange(len(state)) < n
        emitted |= expired
        rows = pa.array(emitted)
        out = [arr.filter(rows) for arr in outputs] + [pa.array(expired[emitted])]
        figures = expiry.figures()
        if not expiry.ttl.by_epochs and n:  # for a watermark the stage learns from its shards (``acts_from``)
            figures[LATEST_EVENT] = int(touched_now.max())
        return out, OperatorStats(stats.keys_touched, stats.new_keys, figures, stats.records)

    def _write(self, txn: ShardTransaction, key_groups: np.ndarray, key_values: pa.Array, state: np.ndarray,
               written: np.ndarray | None = None) -> None:
        """The touched rows' states (those ``written`` only, when given) in one batch in
        state-key order, encoded in that order: the rows are sorted by key, and moving
        Python's bytes objects into another order took as long as the sort it saves."""
        rows = in_state_order(key_groups)
        if written is not None:
            rows = rows[written[rows]]
        txn.set_many(encode_keys(self.namespace, key_groups[rows], key_values.take(pa.array(rows))),
                     self.encode(bulk_rows.take(state, rows)))

    def _touched_now(self, data: pa.Table, step: ShardStep) -> np.ndarray:
        """What the epoch stamps on the keys it updates: its number, or each key's latest event time."""
        assert self.ttl is not None
        if self.ttl.by_epochs:
            return np.full(data.num_rows, step.epoch, dtype=np.int64)
        return data.column(TOUCHED_PARTIAL).to_numpy(zero_copy_only=False).astype(np.int64)

    def _mirror(self, resident: ResidentShard, scanned: dict[bytes, bytes] | None, key_kind: str) -> None:
        """Build the shard's mirror from a scan that read all of it (else drop it)."""
        if scanned is None:
            resident.discard()
            return
        _, keys = decode_keys(key_kind, list(scanned))
        states, _ = self.decode(list(scanned.values()))
        resident.adopt(MirrorKeys.of(keys), states)

    def decode(self, values: Sequence[bytes | None]) -> tuple[np.ndarray, np.ndarray]:
        """States for a batch of lookups (misses start zeroed) and which existed."""
        existed = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        blank = self.blank()
        buf = b"".join([v if v is not None else blank for v in values])
        if len(buf) != len(values) * self.dtype.itemsize:
            raise StateLayoutError(
                f"stored state records do not match the layout {self.layout()} "
                f"({len(buf)} bytes for {len(values)} records of {self.dtype.itemsize}): "
                "the checkpoint root belongs to a different aggregate"
            )
        state = np.frombuffer(buf, dtype=self.dtype).copy()
        if existed.any() and (state["_format"][existed] != STATE_FORMAT).any():
            raise StateLayoutError(f"stored state has an unknown format; this engine writes format {STATE_FORMAT}")
        return state, existed

    def blank(self) -> bytes:
        return self.blank_rows(1).tobytes()

    def encode(self, state: np.ndarray) -> list[bytes]:
        return np.ascontiguousarray(state).view(f"V{self.dtype.itemsize}").tolist()

    def load(self, state: np.ndarray, partials: pa.Table, epoch: int) -> None:
        """Fill blank state rows with exactly these partials (from ``epoch``)."""
        for (name, acc), kind in zip(self.accumulators, self.kinds, strict=True):
            acc.load(name, kind, state, partials, epoch)

    def combine(self, state: np.ndarray, other: np.ndarray) -> None:
        for (name, acc), kind in zip(self.accumulators, self.kinds, strict=True):
            acc.combine(name, kind, state, other)

    def merge(self, state: np.ndarray, partials: pa.Table, epoch: int) -> None:
        """Fold one epoch's partials into the matching state rows, in place."""
        loaded = self.blank_rows(len(state))
        self.load(loaded, partials, epoch)
        self.combine(state, loaded)

    def blank_rows(self, n: int) -> np.ndarray:
        rows = np.zeros(n, dtype=self.dtype)
        rows["_format"] = STATE_FORMAT
        return rows

    def outputs(self, state: np.ndarray) -> list[pa.Array]:
        return [acc.output(name, kind, state) for (name, acc), kind in zip(self.accumulators, self.kinds, strict=True)]
