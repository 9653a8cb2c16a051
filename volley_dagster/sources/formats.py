"""Decoding log files into Arrow, record by record accountable.

Every record of a segment comes back either as a typed row or as a bad row
with its reason and raw text; nothing is skipped. Valid data is parsed in
bulk; only a chunk that fails is bisected to find the bad lines, so the cost
of a malformed record is O(log n) parses, not a per-line loop.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from volley_dagster import columns
from volley_dagster.sources.base import ColumnStatistics, NativeParquetFile, RowGroupStatistics

FORMATS = {"parquet": (".parquet",), "json": (".json", ".jsonl", ".ndjson")}


_TIMESTAMP_UNIT_US = {"milliseconds": 1_000, "microseconds": 1}  # Spark reads neither nanoseconds nor INT96 exactly
# written by Spark 2 (or in its legacy mode): Spark rebases old timestamps as it reads them
_SPARK_REBASED = (b"org.apache.spark.legacyDateTime", b"org.apache.spark.legacyINT96")


_GLOB = re.compile(r"[\[\]{}*?\\]")  # what Hadoop's path globbing reads as a pattern


def native_parquet_file(path: Path, schema: pa.Schema) -> NativeParquetFile | None:
    """A local file as Spark's own scan would read it, from one open of its footer (its
    schema, record count and statistics); None when its columns are not ``schema``'s,
    name and type, or its name holds a glob character (Spark would read a pattern)."""
    if _GLOB.search(str(path)):
        return None
    try:
        with pq.ParquetFile(path) as footer:
            found = footer.schema_arrow
            fits = all(found.get_field_index(f.name) >= 0 and found.field(f.name).type == f.type for f in schema)
            return NativeParquetFile(str(path), footer.metadata.num_rows, parquet_statistics(footer)) if fits else None
    except (OSError, pa.ArrowInvalid):
        return None


def parquet_statistics(footer: pq.ParquetFile) -> tuple[RowGroupStatistics, ...]:
    """What the footer says of each top-level column that is not nested, per row group
    (a figure a row group does not give is None)."""
    meta = footer.metadata
    flat = {f.name for f in footer.schema_arrow if not pa.types.is_nested(f.type)}
    paths = [meta.schema.column(i).path for i in range(meta.num_columns)]
    rebased = any(key in (meta.metadata or {}) for key in _SPARK_REBASED)
    seen = Counter(paths)  # "a.b" of a struct is not a column "a.b"
    described = [(i, path) for i, path in enumerate(paths) if path in flat and seen[path] == 1]
    units = {i: None if rebased else _utc_timestamp_unit_us(meta.schema.column(i)) for i, _ in described}
    groups, start = [], 0
    for r in range(meta.num_row_groups):
        group = meta.row_group(r)
        columns = {path: _column_statistics(group.column(i).statistics, units[i]) for i, path in described}
        groups.append(RowGroupStatistics(start, start + group.num_rows, columns))
        start += group.num_rows
    return tuple(groups)


def _column_statistics(stats: pq.Statistics | None, unit_us: int | None) -> ColumnStatistics:
    nulls = stats.null_count if stats is not None and stats.has_null_count else None
    if stats is None or unit_us is None or not stats.has_min_max:
        return ColumnStatistics(nulls)
    return ColumnStatistics(nulls, stats.min_raw * unit_us, stats.max_raw * unit_us)


def _utc_timestamp_unit_us(column: pq.ColumnSchema) -> int | None:
    """Microseconds a stored unit of a UTC timestamp column is (None: not one Spark reads as it is stored)."""
    if column.physical_type != "INT64" or column.logical_type.type != "TIMESTAMP":
        return None
    logical = json.loads(column.logical_type.to_json())
    return _TIMESTAMP_UNIT_US.get(logical.get("timeUnit")) if logical.get("isAdjustedToUTC") else None


def complete_part(fmt: str, data: bytes, whole_lines_only: bool = True) -> bytes:
    """What of a file holds whole records: the last line of a JSON-lines file still being
    written (the newest of its partition) is a record only once it ends with a newline;
    it waits for a later epoch, never a dead letter."""
    return data[: data.rfind(b"\n") + 1] if fmt == "json" and whole_lines_only else data


def grows(fmt: str) -> bool:
    """JSON-lines logs may be appended to in place: a range pins the bytes it read
    (their digest), not the file's size or version."""
    return fmt == "json"


def content_version(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def count_records(fmt: str, data: bytes, whole_lines_only: bool = True) -> int:
    if fmt == "parquet":
        return pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
    data = complete_part(fmt, data, whole_lines_only)
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def read_schema(fmt: str, data: bytes) -> pa.Schema:
    return pq.ParquetFile(pa.BufferReader(data)).schema_arrow


def _with_meta(table: pa.Table, positions: np.ndarray, errors: pa.Array, raws: pa.Array) -> pa.Table:
    return (
        table.append_column(columns.POS, pa.array(positions, pa.int64()))
        .append_column(columns.ERROR, errors)
        .append_column(columns.RAW, raws)
    )


def _bad_rows(schema: pa.Schema, positions: np.ndarray, reasons: list[str], raws: Sequence[str | None]) -> pa.Table:
    n = len(positions)
    empty = pa.table({f.name: pa.nulls(n, f.type) for f in schema}, schema=schema)
    return _with_meta(empty, positions, pa.array(reasons, pa.string()), pa.array(raws, pa.string()))


def _good_rows(table: pa.Table, positions: np.ndarray) -> pa.Table:
    n = table.num_rows
    return _with_meta(table, positions, pa.nulls(n, pa.string()), pa.nulls(n, pa.string()))


def decode_segment(fmt: str, data: bytes, start: int, end: int, schema: pa.Schema, position_base: int) -> pa.Table:
    """Records ``[start, end)`` of a file as schema columns plus position, error and raw text."""
    if fmt == "parquet":
        return _decode_parquet(data, start, end, schema, position_base)
    return _decode_json(data, start, end, schema, position_base)


def _decode_parquet(data: bytes, start: int, end: int, schema: pa.Schema, base: int) -> pa.Table:
    positions = base + np.arange(start, end, dtype=np.int64)
    pf = pq.ParquetFile(pa.BufferReader(data))
    missing = [name for name in schema.names if name not in pf.schema_arrow.names]
    if missing:
        reason = f"schema mismatch: file has no column(s) {missing}"
        return _bad_rows(schema, positions, [reason] * len(positions), [None] * len(positions))
    bounds = np.cumsum([0] + [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)])
    groups = [i for i in range(pf.num_row_groups) if bounds[i] < end and bounds[i + 1] > start]
    table = pf.read_row_groups(groups, columns=schema.names) if groups else schema.empty_table()
    table = table.slice(start - (bounds[groups[0]] if groups else 0), end - start)
    try:
        table = table.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        return _bad_rows_by_column(table, schema, positions, exc)
    return _good_rows(table, positions)


def decode_table(table: pa.Table, schema: pa.Schema, positions: np.ndarray) -> pa.Table:
    """Records already in Arrow (a table's data file), cast to ``schema`` by name: a
    column the file lacks is null, a value that does not cast makes its row bad."""
    table = pa.table([table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
                      for f in schema], names=schema.names)
    try:
        return _good_rows(table.cast(schema), positions)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        return _bad_rows_by_column(table, schema, positions, exc)


def _bad_rows_by_column(table: pa.Table, schema: pa.Schema, positions: np.ndarray, exc: Exception) -> pa.Table:
    """A Parquet column that does not cast: the rows it fails on are bad, the rest good."""
    ok = np.ones(table.num_rows, dtype=bool)
    reasons = np.full(table.num_rows, None, dtype=object)
    cast_cols = []
    for f in schema:
        col = table[f.name]
        try:
            cast_cols.append(col.cast(f.type))
            continue
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        values = col.to_pylist()
        out = []
        for i, v in enumerate(values):  # error path only: find exactly which rows fail
            try:
                out.append(pa.scalar(v, col.type).cast(f.type).as_py() if v is not None else None)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError) as e:
                ok[i] = False
                reasons[i] = reasons[i] or f"wrong type: column {f.name!r} value {v!r} is not {f.type} ({e})"
                out.append(None)
        cast_cols.append(pa.chunked_array([pa.array(out, f.type)]))
    casted = pa.table(cast_cols, schema=schema)
    good = _good_rows(casted.filter(pa.array(ok)), positions[ok])
    bad_idx = np.flatnonzero(~ok)
    raws = [str(table.slice(int(i), 1).to_pylist()[0]) for i in bad_idx]
    bad = _bad_rows(schema, positions[~ok], list(reasons[~ok]), raws)
    return pa.concat_tables([good, bad])


def _line_bounds(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.concatenate([[0], newlines + 1])
    ends = np.concatenate([newlines, [len(data)]])
    if len(data) == 0 or data.endswith(b"\n"):
        starts, ends = starts[:-1], ends[:-1]
    return starts, ends


def _parse_json(chunk: bytes, schema: pa.Schema) -> pa.Table:
    return pj.read_json(
        io.BytesIO(chunk),
        read_options=pj.ReadOptions(use_threads=False, block_size=max(1 << 20, len(chunk) + 1)),
        parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
    )


def _decode_json(data: bytes, start: int, end: int, schema: pa.Schema, base: int) -> pa.Table:
    starts, ends = _line_bounds(data)
    good: list[pa.Table] = []
    bad_pos: list[int] = []
    reasons: list[str] = []
    raws: list[str] = []

    def parse(a: int, b: int) -> None:
        chunk = data[starts[a] : ends[b - 1] + 1]
        try:
            table = _parse_json(chunk, schema)
            error = None if table.num_rows == b - a else f"{b - a} lines gave {table.num_rows} records"
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            table, error = None, str(exc)
        if error is None:
            good.append(_good_rows(table.select(schema.names), base + np.arange(a, b, dtype=np.int64)))
        elif b - a == 1:
            line = data[starts[a] : ends[a]].decode("utf-8", errors="replace")
            bad_pos.append(base + a)
            reasons.append("empty line" if not line.strip() else f"unparseable JSON: {error}")
            raws.append(line)
        else:
            mid = (a + b) // 2
            parse(a, mid)
            parse(mid, b)

    if end > start:
        parse(start, end)
    if bad_pos:
        good.append(_bad_rows(schema, np.array(bad_pos, dtype=np.int64), reasons, raws))
    if not good:
        return _good_rows(schema.empty_table(), np.array([], dtype=np.int64))
    return pa.concat_tables(good)


def decode_json_values(values: Sequence[bytes | None], offsets: np.ndarray, schema: pa.Schema,
                       position_base: int) -> pa.Table:
    """Message values (a Kafka partition's), each one JSON object, decoded in bulk as
    JSON lines; a record's position is ``position_base`` plus its offset. A value
    with a line break is one line still (JSON allows any whitespace there); a null
    value (a tombstone) is a bad record, as an empty line is."""
    if not values:
        return _good_rows(schema.empty_table(), np.array([], dtype=np.int64))
    data = b"\n".join(b"" if v is None else v.replace(b"\n", b" ").replace(b"\r", b" ") for v in values) + b"\n"
    table = _decode_json(data, 0, len(values), schema, 0)
    lines = table.column(columns.POS).to_numpy()
    index = table.schema.get_field_index(columns.POS)
    return table.set_column(index, columns.POS, pa.array(position_base + offsets[lines], pa.int64()))


def decode_values_with(decode: Callable[[pa.BinaryArray], pa.Table], values: Sequence[bytes | None],
                       offsets: np.ndarray, schema: pa.Schema, position_base: int) -> pa.Table:
    """Message values decoded in bulk by the user's function: it gets them as one binary
    array (null: a tombstone) and returns the schema's columns, row for row, with an
    optional string column ``_volley_error`` naming why a row could not be decoded. A
    function that raises, or returns another number of rows, makes every value of the
    segment a bad record carrying its message: nothing is dropped."""
    positions = position_base + offsets
    n = len(values)
    try:
        table = decode(pa.array(values, pa.binary()))
        if table.num_rows != n:
            raise ValueError(f"it returned {table.num_rows} rows for {n} values")
        errors = table.column(columns.ERROR).cast(pa.string()) if columns.ERROR in table.column_names \
            else pa.nulls(n, pa.string())
        table = table.select(schema.names).cast(schema)
    except Exception as exc:  # the user's code: whatever it raises is the records' reason
        reason = f"the decoder failed: {type(exc).__name__}: {exc}"
        return _bad_rows(schema, positions, [reason] * n, [_text(v) for v in values])
    bad = np.flatnonzero(errors.is_valid().to_numpy(zero_copy_only=False))
    raws: list[str | None] = [None] * n
    for i in bad:  # error path only
        raws[int(i)] = _text(values[int(i)])
    return _with_meta(table, positions, errors, pa.array(raws, pa.string()))


def _text(value: bytes | None) -> str | None:
    return None if value is None else value[:4096].decode("utf-8", errors="replace")


def plain_type(kind: pa.DataType) -> pa.DataType:
    """Arrow's large and view types as the plain ones Spark reads."""
    if pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return pa.string()
    if pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return pa.binary()
    if pa.types.is_large_list(kind) or pa.types.is_list(kind):
        return pa.list_(pa.field(kind.value_field.name, plain_type(kind.value_type), kind.value_field.nullable))
    if pa.types.is_struct(kind):
        return pa.struct([pa.field(f.name, plain_type(f.type), f.nullable) for f in kind])
    if pa.types.is_map(kind):
        return pa.map_(plain_type(kind.key_type), plain_type(kind.item_type))
    return kind


def plain_schema(schema: pa.Schema) -> pa.Schema:
    """A table format's schema (pyiceberg's, delta-rs's) in the types Spark reads."""
    return pa.schema([pa.field(f.name, plain_type(f.type), f.nullable) for f in schema])
