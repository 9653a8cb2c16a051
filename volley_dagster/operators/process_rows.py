"""The rows a processor's state variable holds for one key (``Pipeline.process``), as
one RocksDB value: a schema of flat fields (Spark DDL), rows packed without pickle so
that ``volley state`` reads them from the recorded layout alone, and a value that does
not fit its declared type is refused when the processor stores it, naming the field.

```
u1 format | u4 rows | per row: null bitmap | fixed-width fields (struct) | u4 length + bytes per string/binary
```

Timestamps are microseconds since the epoch (UTC; a value without a zone is taken as
UTC's wall clock and read back so, as Spark does) and dates days since it, so any year
a record can carry round-trips (Spark's JSON of year 10000 does not)."""

from __future__ import annotations

import datetime as dt
import operator
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from volley_dagster.errors import ConfigError

_FORMAT = 1
_HEAD = struct.Struct("<BI")
_LENGTH = struct.Struct("<I")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_EPOCH_DAY = dt.date(1970, 1, 1)
# Spark's type names (and aliases) -> (the canonical name, its struct code or "" for variable width)
_TYPES: dict[str, tuple[str, str]] = {
    "boolean": ("boolean", "?"), "tinyint": ("tinyint", "b"), "byte": ("tinyint", "b"),
    "smallint": ("smallint", "h"), "short": ("smallint", "h"), "int": ("int", "i"), "integer": ("int", "i"),
    "bigint": ("bigint", "q"), "long": ("bigint", "q"), "float": ("float", "f"), "real": ("float", "f"),
    "double": ("double", "d"), "date": ("date", "i"), "timestamp": ("timestamp", "q"),
    "string": ("string", ""), "binary": ("binary", ""),
}
_ARROW: dict[str, pa.DataType] = {
    "boolean": pa.bool_(), "tinyint": pa.int8(), "smallint": pa.int16(), "int": pa.int32(), "bigint": pa.int64(),
    "float": pa.float32(), "double": pa.float64(), "date": pa.date32(), "timestamp": pa.timestamp("us", tz="UTC"),
    "string": pa.string(), "binary": pa.binary(),
}
_FIELD = re.compile(r"^\s*`?([A-Za-z_][A-Za-z0-9_]*)`?\s*:?\s+([A-Za-z]+(?:\s*[<(].*[>)])?)\s*$")
_INTS = {"tinyint": (-(1 << 7), 1 << 7), "smallint": (-(1 << 15), 1 << 15), "int": (-(1 << 31), 1 << 31),
         "bigint": (-(1 << 63), 1 << 63)}

Fields = tuple[tuple[str, str], ...]  # (name, Spark type name)


def parse_schema(schema: object, what: str) -> Fields:
    """``"ts timestamp, amount double"``, a bare type (``"bigint"``: one field, ``value``)
    or a ``pyspark.sql.types.StructType``; flat fields of the types listed in ``_TYPES``."""
    if hasattr(schema, "fields") and not isinstance(schema, str):
        pairs = [(f.name, f.dataType.simpleString()) for f in schema.fields]
    elif isinstance(schema, str) and schema.strip().lower() in _TYPES:
        pairs = [("value", schema.strip().lower())]
    elif isinstance(schema, str):
        pairs = []
        for part in _top_level(schema):
            match = _FIELD.match(part)
            if match is None:
                raise ConfigError(f"{what}: cannot read {part.strip()!r} of schema {schema!r} as '<name> <type>'; "
                                  "write the schema as Spark DDL, e.g. 'ts timestamp, amount double'")
            pairs.append((match.group(1), match.group(2)))
    else:
        raise ConfigError(f"{what}: a schema is Spark DDL text or a StructType, got {type(schema).__name__}")
    fields = []
    for name, kind in pairs:
        known = _TYPES.get(kind.lower())
        if known is None:
            raise ConfigError(f"{what}: field {name!r} has type {kind!r}; state and output fields may be "
                              f"{', '.join(sorted({t for t, _ in _TYPES.values()}))} (keep several rows per key in "
                              "list state, or a nested value as a string)")
        fields.append((name, known[0]))
    names = [n for n, _ in fields]
    if not fields or len(set(names)) != len(names):
        raise ConfigError(f"{what}: schema {schema!r} must name one or more fields, each once")
    return tuple(fields)


def _top_level(ddl: str) -> list[str]:
    """The DDL's fields: split at commas outside ``<...>`` and ``(...)``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(ddl):
        depth += (char in "<(") - (char in ">)")
        if char == "," and depth == 0:
            parts.append(ddl[start:i])
            start = i + 1
    return [*parts, ddl[start:]]


def fields_ddl(fields: Fields) -> str:
    return ", ".join(f"{name} {kind}" for name, kind in fields)


def arrow_schema(fields: Fields) -> pa.Schema:
    return pa.schema([(name, _ARROW[kind]) for name, kind in fields])


@dataclass(frozen=True)
class PackedRows:
    """The codec of one state variable's rows."""

    fields: Fields

    @property
    def _fixed(self) -> struct.Struct:
        codes = "".join(_TYPES[kind][1] for _, kind in self.fields if _TYPES[kind][1])
        return struct.Struct("<" + "B" * self._mask_bytes + codes)

    @property
    def _mask_bytes(self) -> int:
        return (len(self.fields) + 7) // 8

    def row(self, value: object, what: str) -> tuple[Any, ...]:
        """A value as one row: a tuple of the fields, or a scalar when there is one field."""
        if isinstance(value, tuple):
            row = value
        elif len(self.fields) == 1 and not isinstance(value, (list, dict)):
            row = (value,)
        else:
            raise TypeError(f"{what}: expected a tuple of ({fields_ddl(self.fields)}), got {type(value).__name__}")
        if len(row) != len(self.fields):
            raise TypeError(f"{what}: expected {len(self.fields)} field(s) ({fields_ddl(self.fields)}), "
                            f"got {len(row)}: {row!r}")
        return row

    def encode(self, rows: Sequence[tuple[Any, ...]], what: str) -> bytes:
        fixed, out = self._fixed, [_HEAD.pack(_FORMAT, len(rows))]
        for number, row in enumerate(rows):
            mask = [0] * self._mask_bytes
            values: list[Any] = []
            tail: list[bytes] = []
            for i, ((name, kind), value) in enumerate(zip(self.fields, row, strict=True)):
                if _is_null(value):
                    mask[i // 8] |= 1 << (i % 8)
                    if _TYPES[kind][1]:
                        values.append(False if kind == "boolean" else 0)
                    else:
                        tail.append(_LENGTH.pack(0))
                    continue
                try:
                    if _TYPES[kind][1]:
                        values.append(_fixed_value(kind, value))
                    else:
                        data = _variable_value(kind, value)
                        tail.append(_LENGTH.pack(len(data)) + data)
                except (TypeError, ValueError, OverflowError) as exc:
                    raise TypeError(f"{what}: row {number} field {name!r} ({kind}) cannot hold {value!r}: {exc}") from None
            out.append(fixed.pack(*mask, *values))
            out.extend(tail)
        return b"".join(out)

    def decode(self, blob: bytes) -> list[tuple[Any, ...]]:
        form, n = _HEAD.unpack_from(blob, 0)
        if form != _FORMAT:
            raise ValueError(f"state value format {form} is not one this engine reads ({_FORMAT})")
        fixed, at, rows = self._fixed, _HEAD.size, []
        for _ in range(n):
            packed = fixed.unpack_from(blob, at)
            at += fixed.size
            mask, values = packed[:self._mask_bytes], iter(packed[self._mask_bytes:])
            row: list[Any] = []
            for i, (_, kind) in enumerate(self.fields):
                null = bool(mask[i // 8] & (1 << (i % 8)))
                if _TYPES[kind][1]:
                    value = next(values)
                    row.append(None if null else _from_fixed(kind, value))
                else:
                    (length,) = _LENGTH.unpack_from(blob, at)
                    data = blob[at + 4:at + 4 + length]
                    at += 4 + length
                    row.append(None if null else data.decode() if kind == "string" else data)
            rows.append(tuple(row))
        return rows

    def count(self, blob: bytes | None) -> int:
        return 0 if blob is None else int(_HEAD.unpack_from(blob, 0)[1])


def rows_table(fields: Fields, rows: Iterable[tuple[Any, ...]]) -> pa.Table:
    """Decoded rows as an Arrow table of the declared types."""
    columns = list(zip(*rows, strict=True)) or [() for _ in fields]
    return pa.table([pa.array(list(c), _ARROW[kind]) for c, (_, kind) in zip(columns, fields, strict=True)],
                    names=[name for name, _ in fields])


def _is_null(value: Any) -> bool:
    """None, pandas' NA and NaT (a float NaN is a value, as in Spark)."""
    return value is None or value is pd.NA or value is pd.NaT or (isinstance(value, np.datetime64) and np.isnat(value))


def _fixed_value(kind: str, value: Any) -> Any:
    if kind == "boolean":
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError("not a boolean")
        return bool(value)
    if isinstance(value, (bool, np.bool_)):
        raise TypeError("a boolean, not a number")
    if kind in _INTS:
        number = operator.index(value)
        low, high = _INTS[kind]
        if not low <= number < high:
            raise OverflowError(f"outside {kind}'s range")
        return number
    if kind in ("float", "double"):
        if isinstance(value, (str, bytes)):
            raise TypeError("not a number")
        return float(value)
    if kind == "date":
        if isinstance(value, dt.datetime) or not isinstance(value, dt.date):
            raise TypeError("not a date")
        return (value - _EPOCH_DAY).days
    return _micros(value)


def _micros(value: Any) -> int:
    """A timestamp (datetime, pandas Timestamp or NumPy datetime64; naive means UTC) in microseconds."""
    if isinstance(value, pd.Timestamp):
        value = value.tz_localize("UTC") if value.tzinfo is None else value
        return int(value.as_unit("us").asm8.astype(np.int64))
    if isinstance(value, np.datetime64):
        return int(value.astype("datetime64[us]").astype(np.int64))
    if isinstance(value, dt.datetime):
        value = value.replace(tzinfo=dt.timezone.utc) if value.tzinfo is None else value
        delta = value - _EPOCH
        return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    raise TypeError("not a timestamp (datetime, pandas Timestamp or numpy datetime64)")


def _from_fixed(kind: str, value: Any) -> Any:
    if kind == "date":
        return _EPOCH_DAY + dt.timedelta(days=value)
    if kind == "timestamp":
        return pd.Timestamp(value, unit="us")  # UTC's wall clock, as Spark's state gives it back
    return value


def _variable_value(kind: str, value: Any) -> bytes:
    if kind == "string":
        if not isinstance(value, str):
            raise TypeError("not a string")
        return value.encode()
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError("not bytes")
    return bytes(value)
