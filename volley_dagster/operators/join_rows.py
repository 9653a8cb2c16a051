"""One side of a join carried through state: each row's columns as one JSON text,
encoded by Spark in the JVM and decoded by Arrow's JSON reader in bulk, so a row that
waits epochs for its match costs one RocksDB value and no Python per record.

Values keep their exact type: timestamps are written with microseconds in UTC (the
deduplication key's rules), and the types Arrow's reader cannot parse from JSON
(floating point, decimals, dates) travel as Spark's text of them (a double's is the
shortest that reads back to the same double, ``NaN`` and infinities included) and are
cast back. A type that cannot travel (binary, maps, floats inside arrays or structs)
is refused when the pipeline is planned, naming the column."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import to_arrow_type

from volley_dagster.errors import ConfigError
from volley_dagster.operators.dedup import EXACT_JSON
from volley_dagster.sources.base import ColumnStatistics

_AS_TEXT = (T.FloatType, T.DoubleType, T.DecimalType, T.DateType)  # Arrow's JSON reader takes these as text
_NATIVE = (T.IntegralType, T.BooleanType, T.StringType, T.TimestampType, T.TimestampNTZType)
_YEAR_1_US, _YEAR_10000_US, _DAY_US = -62_135_596_800_000_000, 253_402_300_800_000_000, 86_400_000_000
_BLOCK = 16 << 20  # Arrow's JSON reader's block: rows longer than this are read too, in fewer blocks


def _travels(kind: T.DataType, nested: bool) -> bool:
    if isinstance(kind, _NATIVE):
        return True
    if isinstance(kind, _AS_TEXT):
        return not nested
    if isinstance(kind, T.ArrayType):
        return _travels(kind.elementType, True)
    if isinstance(kind, T.StructType):
        return all(_travels(f.dataType, True) for f in kind.fields)
    return False


def _holds_time(kind: T.DataType) -> bool:
    if isinstance(kind, (T.TimestampType, T.TimestampNTZType, T.DateType)):
        return True
    if isinstance(kind, T.ArrayType):
        return _holds_time(kind.elementType)
    return isinstance(kind, T.StructType) and any(_holds_time(f.dataType) for f in kind.fields)


@dataclass(frozen=True)
class RowCodec:
    """``names``: one side's columns, in the order the output carries them."""

    names: tuple[str, ...]
    types: tuple[T.DataType, ...]

    @classmethod
    def of(cls, schema: T.StructType, names: tuple[str, ...], side: str) -> RowCodec:
        for name in names:
            kind = schema[name].dataType
            if not _travels(kind, False):
                raise ConfigError(
                    f"join: column {name!r} of {side!r} is {kind.simpleString()}, which join state cannot carry "
                    "(binary, maps, floats, decimals or dates inside arrays or structs); cast it (to a string, "
                    f"or leave it out with {'left' if side == 'left' else 'right'}_columns=[...])")
        return cls(names, tuple(schema[n].dataType for n in names))

    @property
    def arrow_schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, to_arrow_type(t, timezone="UTC"))
                          for n, t in zip(self.names, self.types, strict=True)])

    def out_of_range(self, side: str) -> list[tuple[Column, str]]:
        """A timestamp or date outside years 1-9999 (Spark writes ``+10000-01-01``, which
        Arrow's JSON reader cannot read back): per column, when it holds one, and why the
        record is bad. Inside arrays or structs, the JSON text is searched for such a year."""
        checks = []
        for name, kind in zip(self.names, self.types, strict=True):
            if isinstance(kind, (T.TimestampType, T.TimestampNTZType, T.DateType)):
                year = F.year(F.col(name))
                condition = (year < 1) | (year > 9999)
            elif _holds_time(kind):
                condition = F.to_json(F.struct(F.col(name)), options=EXACT_JSON).rlike(r'"[+-][0-9]{4,}-')
            else:
                continue
            checks.append((F.coalesce(condition, F.lit(False)),
                           f"a time outside years 1-9999: {name!r} of {side!r} holds one, which the join's state "
                           "cannot carry; fix the value or cast the column"))
        return checks

    def fits(self, footer: Mapping[str, ColumnStatistics]) -> bool:
        """Whether a file's footer shows that no row holds a time ``out_of_range`` finds:
        each column that holds a time is a timestamp whose earliest and latest the footer
        gives, within years 1-9999 (a day inside, whatever the session's time zone)."""
        for name, kind in zip(self.names, self.types, strict=True):
            if not _holds_time(kind):
                continue
            stats = footer.get(name)
            if (not isinstance(kind, T.TimestampType) or stats is None or stats.earliest_us is None
                    or stats.latest_us is None):
                return False
            if stats.earliest_us < _YEAR_1_US + _DAY_US or stats.latest_us >= _YEAR_10000_US - _DAY_US:
                return False
        return True

    def encode(self) -> Column:
        """Each row's columns as one JSON text (a Spark expression)."""
        fields = [F.col(n).cast("string").alias(n) if isinstance(t, _AS_TEXT) else F.col(n)
                  for n, t in zip(self.names, self.types, strict=True)]
        return F.to_json(F.struct(*fields), options=EXACT_JSON)

    def decode(self, texts: pa.Array) -> pa.Table:
        """The rows of ``texts`` (JSON objects ``encode`` wrote); a null text is a row of nulls."""
        if not self.names:
            return pa.table({})  # the side carries its key and row id only
        schema = self.arrow_schema
        read_as = pa.schema([pa.field(f.name, pa.string()) if isinstance(t, _AS_TEXT) else f
                             for f, t in zip(schema, self.types, strict=True)])
        valid = texts.is_valid().to_numpy(zero_copy_only=False)
        present = texts.filter(pa.array(valid)).cast(pa.large_string())
        if len(present) == 0:
            read = read_as.empty_table()
        else:
            lines = pc.binary_join_element_wise(present, pa.scalar("", pa.large_string()),
                                          pa.scalar("\n", pa.large_string()))
            offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)[lines.offset:lines.offset + len(lines) + 1]
            data = lines.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
            read = pj.read_json(pa.BufferReader(data), read_options=pj.ReadOptions(block_size=_BLOCK),
                                parse_options=pj.ParseOptions(explicit_schema=read_as))
        rows = pa.table([read.column(f.name).cast(f.type) if isinstance(t, _AS_TEXT) else read.column(f.name)
                         for f, t in zip(schema, self.types, strict=True)], schema=schema)
        if bool(valid.all()):
            return rows
        return rows.take(pa.array(np.cumsum(valid) - 1, pa.int64(), mask=~valid))
