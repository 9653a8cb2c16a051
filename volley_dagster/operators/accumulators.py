"""Accumulators: how one aggregate is pre-combined in Spark, stored in state,
merged and emitted.

Each has three faces: Spark partial-aggregate expressions (combined per key
before state is touched, the way Spark's own stateful aggregation does), a
fixed-width state record (NumPy fields, so a batch of states is one buffer),
and vectorised folds: partials loaded as states (``load``), and state into
state (``combine``), which window merging needs as well as the running
aggregate. ``combine`` is associative and commutative: first/last keep the log
position (epoch, event position) of their value, so any fold order agrees.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.errors import ConfigError

ValueKind = Literal["int", "float", "timestamp", "date"]

_NUMPY = {"int": np.int64, "float": np.float64, "timestamp": np.int64, "date": np.int64}
_ARROW = {
    "int": pa.int64(),
    "float": pa.float64(),
    "timestamp": pa.timestamp("us", tz="UTC"),
    "date": pa.date32(),
}
_SPARK_DDL = {"int": "bigint", "float": "double", "timestamp": "timestamp", "date": "date"}


class StateOverflow(ArithmeticError):
    """Rows of a state batch whose integer aggregate would wrap; the operator names their keys."""

    def __init__(self, aggregate: str, rows: np.ndarray) -> None:
        super().__init__(aggregate)
        self.aggregate, self.rows = aggregate, rows


def value_kind(column: str, dtype: T.DataType) -> ValueKind:
    if isinstance(dtype, T.IntegralType):
        return "int"
    if isinstance(dtype, T.DecimalType):
        raise ConfigError(
            f"cannot aggregate column {column!r} of type {dtype.simpleString()}: state holds int64 or float64, and "
            f"a decimal would silently lose digits; convert it explicitly, e.g. .with_column({column!r}, "
            f"'CAST({column} AS DOUBLE)') or, exactly, in integer units: 'CAST({column} * {10 ** dtype.scale} AS BIGINT)'"
        )
    if isinstance(dtype, (T.FloatType, T.DoubleType)):
        return "float"
    if isinstance(dtype, T.TimestampType):
        return "timestamp"
    if isinstance(dtype, T.DateType):
        return "date"
    raise ConfigError(f"cannot aggregate column {column!r} of type {dtype.simpleString()}: numeric, timestamp or date only")


def numeric_expr(column: str, kind: ValueKind) -> Column:
    """The column as the int64/float64 that state stores."""
    col = F.col(column)
    if kind == "timestamp":
        return F.unix_micros(col)
    if kind == "date":
        return F.unix_date(col).cast("long")
    return col.cast("long" if kind == "int" else "double")


def to_output(values: np.ndarray, valid: np.ndarray | None, kind: ValueKind) -> pa.Array:
    mask = None if valid is None else ~valid.astype(bool)
    arr = pa.array(values, type=pa.from_numpy_dtype(values.dtype), mask=mask)
    if kind == "date":
        arr = arr.cast(pa.int32())
    return arr.cast(_ARROW[kind])


def _filled(arr: pa.Array, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """Values with nulls as 0, and the validity mask."""
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    values = pc.fill_null(arr, 0).to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return values, valid


@dataclass(frozen=True)
class Accumulator(ABC):
    """One named aggregate over an optional input column."""

    column: str | None = None

    def kind(self, schema: T.StructType) -> ValueKind | None:
        if self.column is None:
            return None
        if self.column not in schema.names:
            raise ConfigError(f"{type(self).__name__.lower()}({self.column!r}): no such column; columns are {schema.names}")
        return value_kind(self.column, schema[self.column].dataType)

    def input_columns(self) -> tuple[str, ...]:
        """The columns of the keyed rows ``partials`` reads."""
        return () if self.column is None else (self.column,)

    @abstractmethod
    def partials(self, name: str, kind: ValueKind | None) -> dict[str, Column]:
        """Spark aggregate expressions, by partial column name."""

    @abstractmethod
    def fields(self, name: str, kind: ValueKind | None) -> list[tuple[str, type]]:
        """State record fields (name, NumPy type)."""

    @abstractmethod
    def load(self, name: str, kind: ValueKind | None, state: np.ndarray, partials: pa.Table, epoch: int) -> None:
        """Write the state of exactly these partials (from ``epoch``) into blank rows."""

    @abstractmethod
    def combine(self, name: str, kind: ValueKind | None, state: np.ndarray, other: np.ndarray) -> None:
        """Fold the ``other`` states into ``state``, row by row, in place."""

    @abstractmethod
    def output(self, name: str, kind: ValueKind | None, state: np.ndarray) -> pa.Array:
        """The value users see."""

    @abstractmethod
    def output_kind(self, kind: ValueKind | None) -> ValueKind:
        """The kind of the emitted value."""


@dataclass(frozen=True)
class Count(Accumulator):
    """Rows per key (or non-null values of ``column``)."""

    def kind(self, schema: T.StructType) -> ValueKind | None:
        if self.column is not None and self.column not in schema.names:
            raise ConfigError(f"count({self.column!r}): no such column; columns are {schema.names}")
        return None

    def partials(self, name, kind):
        expr = F.count(F.lit(1)) if self.column is None else F.count(F.col(self.column))
        return {f"{name}:n": expr.cast("long")}

    def fields(self, name, kind):
        return [(f"{name}:n", np.int64)]

    def load(self, name, kind, state, partials, epoch):
        state[f"{name}:n"] = partials[f"{name}:n"].to_numpy(zero_copy_only=False)

    def combine(self, name, kind, state, other):
        state[f"{name}:n"] += other[f"{name}:n"]

    def output(self, name, kind, state):
        return pa.array(state[f"{name}:n"], pa.int64())

    def output_kind(self, kind):
        return "int"


@dataclass(frozen=True)
class _ValueAccumulator(Accumulator):
    """A single value with a validity flag: sum, min, max, first, last."""

    def fields(self, name, kind):
        return [(f"{name}:v", _NUMPY[kind]), (f"{name}:ok", np.bool_)]

    def load(self, name, kind, state, partials, epoch):
        state[f"{name}:v"], state[f"{name}:ok"] = _filled(partials[f"{name}:v"], _NUMPY[kind])

    def output(self, name, kind, state):
        return to_output(state[f"{name}:v"], state[f"{name}:ok"], kind)

    def output_kind(self, kind):
        return kind


@dataclass(frozen=True)
class _Reducing(_ValueAccumulator):
    """A value folded by one binary operation: sum, min, max."""

    def partials(self, name, kind):
        return {f"{name}:v": self._spark_partial(numeric_expr(self.column, kind))}

    def combine(self, name, kind, state, other):
        old, old_ok = state[f"{name}:v"], state[f"{name}:ok"]
        new, new_ok = other[f"{name}:v"], other[f"{name}:ok"]
        state[f"{name}:v"] = self._combine(old, old_ok, new, new_ok)
        state[f"{name}:ok"] = old_ok | new_ok

    @abstractmethod
    def _spark_partial(self, value: Column) -> Column: ...

    @abstractmethod
    def _combine(self, old: np.ndarray, old_ok: np.ndarray, new: np.ndarray, new_ok: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class Sum(_Reducing):
    """Sum of non-null values; null until the key has seen one (SQL semantics)."""

    def kind(self, schema):
        kind = super().kind(schema)
        if kind in ("timestamp", "date"):
            raise ConfigError(f"sum({self.column!r}): cannot sum a {kind}")
        return kind

    def _spark_partial(self, value):
        return F.sum(value)

    def combine(self, name, kind, state, other):
        if kind == "int":
            old, new = state[f"{name}:v"], other[f"{name}:v"]
            with np.errstate(over="ignore"):
                total = old + new
            wrapped = np.flatnonzero(((old ^ total) & (new ^ total)) < 0)  # both addends' sign differs from the sum's
            if len(wrapped):
                raise StateOverflow(f"sum({self.column!r}) as {name!r}", wrapped)
        super().combine(name, kind, state, other)

    def _combine(self, old, old_ok, new, new_ok):
        return old + new  # invalid slots hold 0


@dataclass(frozen=True)
class Min(_Reducing):
    def _spark_partial(self, value):
        return F.min(value)

    def _combine(self, old, old_ok, new, new_ok):
        # Spark orders NaN above every number: the min is NaN only when both sides are
        return np.where(old_ok & new_ok, np.fmin(old, new), np.where(new_ok, new, old))


@dataclass(frozen=True)
class Max(_Reducing):
    def _spark_partial(self, value):
        return F.max(value)

    def _combine(self, old, old_ok, new, new_ok):
        # Spark orders NaN above every number: the max is NaN when either side is
        return np.where(old_ok & new_ok, np.maximum(old, new), np.where(new_ok, new, old))


@dataclass(frozen=True)
class _Positional(_ValueAccumulator):
    """A value chosen by log order; its position (epoch, event position) is kept with it."""

    def input_columns(self) -> tuple[str, ...]:
        return (*super().input_columns(), columns.POS)

    def partials(self, name, kind):
        value = numeric_expr(self.column, kind)
        pos = F.when(value.isNotNull(), F.col(columns.POS))
        # rows of one record (a transform's explode) share a position: the value breaks
        # the tie (first: the least, last: the greatest), the same on every re-run
        order = F.when(value.isNotNull(), F.struct(F.col(columns.POS), value))
        pick, at = (F.min_by, F.min) if self._earliest else (F.max_by, F.max)
        return {f"{name}:v": pick(value, order), f"{name}:p": at(pos)}

    def fields(self, name, kind):
        return super().fields(name, kind) + [(f"{name}:e", np.int64), (f"{name}:p", np.int64)]

    def load(self, name, kind, state, partials, epoch):
        super().load(name, kind, state, partials, epoch)
        state[f"{name}:e"] = np.where(state[f"{name}:ok"], epoch, 0)
        state[f"{name}:p"] = _filled(partials[f"{name}:p"], np.int64)[0]

    def combine(self, name, kind, state, other):
        ok, o_ok = state[f"{name}:ok"], other[f"{name}:ok"]
        e, o_e, p, o_p = state[f"{name}:e"], other[f"{name}:e"], state[f"{name}:p"], other[f"{name}:p"]
        before = (o_e < e) | ((o_e == e) & (o_p < p))
        take = o_ok & (~ok | (before if self._earliest else ~before))
        for field in ("v", "e", "p"):
            state[f"{name}:{field}"] = np.where(take, other[f"{name}:{field}"], state[f"{name}:{field}"])
        state[f"{name}:ok"] = ok | o_ok

    _earliest = True


@dataclass(frozen=True)
class First(_Positional):
    """The first non-null value in log order (earlier epochs first, then log position)."""

    _earliest = True


@dataclass(frozen=True)
class Last(_Positional):
    """The last non-null value in log order."""

    _earliest = False


@dataclass(frozen=True)
class Mean(Accumulator):
    """Mean of non-null values, kept as (sum, count) so it merges exactly."""

    def partials(self, name, kind):
        value = numeric_expr(self.column, kind).cast("double")
        return {f"{name}:s": F.sum(value), f"{name}:n": F.count(value).cast("long")}

    def fields(self, name, kind):
        return [(f"{name}:s", np.float64), (f"{name}:n", np.int64)]

    def load(self, name, kind, state, partials, epoch):
        state[f"{name}:s"] = _filled(partials[f"{name}:s"], np.float64)[0]
        state[f"{name}:n"] = partials[f"{name}:n"].to_numpy(zero_copy_only=False)

    def combine(self, name, kind, state, other):
        state[f"{name}:s"] += other[f"{name}:s"]
        state[f"{name}:n"] += other[f"{name}:n"]

    def output(self, name, kind, state):
        n = state[f"{name}:n"]
        ok = n > 0
        return to_output(np.divide(state[f"{name}:s"], n, out=np.zeros(len(n)), where=ok), ok, "float")

    def output_kind(self, kind):
        return "float"


def count(column: str | None = None) -> Accumulator:
    return Count(column)


def sum_(column: str) -> Accumulator:
    return Sum(column)


def min_(column: str) -> Accumulator:
    return Min(column)


def max_(column: str) -> Accumulator:
    return Max(column)


def mean(column: str) -> Accumulator:
    return Mean(column)


def first(column: str) -> Accumulator:
    return First(column)


def last(column: str) -> Accumulator:
    return Last(column)


def arrow_type(kind: ValueKind) -> pa.DataType:
    return _ARROW[kind]


def spark_ddl(kind: ValueKind) -> str:
    return _SPARK_DDL[kind]
