"""Epoch rows the shard tasks write straight into a sink's folder as Parquet files, for
the sink to commit as they are (``Sink.staging_folder``): the rows never travel to the
driver to be encoded there, one core's work, and the tasks write side by side.

Each file carries the statistics the Delta log keeps for it, read from the file's own
footer (what the Parquet writer computed), per the Delta protocol's per-file
statistics: ``numRecords``, and per top-level column ``nullCount`` and
``minValues``/``maxValues``, as readers prune files by them. Every column of a kind
delta-rs keeps bounds for gets them whenever the footer has them: delta-rs's own reader
skips a file whose bound for a filtered column is missing. Bounds are never tighter
than the data, but for one case: timestamps are written to the millisecond, the
minimum rounded down and the maximum up; a decimal as the nearest float outward; a
string whole; an infinite float as the largest finite one (the log is JSON, which has
no infinity: only a filter beyond 1.8e308 could miss that row); binary and nested
columns get none (delta-rs keeps none for them either).

A file that no commit adds (the attempt failed, or the sink already held the epoch, or
wrote the rows themselves) is in no table version: readers never see it, and the
format's own cleanup (Delta's ``vacuum``) removes it.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster.json_records import JsonObject

if TYPE_CHECKING:
    from deltalake.transaction import AddAction

    from volley_dagster.sinks.shard_files import ShardFilesPlan

Bound = int | float | str  # a column's minimum or maximum as the log writes it (bool is an int)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class StagingTarget:
    """Where the shard tasks write one sink's rows: the sink's name and its folder.
    ``rewrite``: an upsert table laid out by shard, whose files each task rewrites with
    its rows (``sinks/shard_files.py``); None: the rows are appended as they are."""

    sink: str
    folder: str
    rewrite: ShardFilesPlan | None = None


@dataclass(frozen=True)
class StagedFile:
    """One Parquet file written into a table's folder, not yet in its log: its path
    relative to the table, its size, its rows and its Delta statistics (JSON)."""

    path: str
    size: int
    rows: int
    stats: str

    def to_dict(self) -> JsonObject:
        return {"path": self.path, "size": self.size, "rows": self.rows, "stats": self.stats}

    @classmethod
    def from_dict(cls, d: JsonObject) -> StagedFile:
        return cls(d["path"], d["size"], d["rows"], d["stats"])

    def add_action(self) -> AddAction:
        """The file in a Delta commit (on the driver: the tasks never import delta-rs)."""
        from deltalake.transaction import AddAction

        return AddAction(self.path, self.size, {}, int(time.time() * 1000), True, self.stats)


def stage_rows(rows: pa.Table, target: StagingTarget, name: str, key: str | None = None) -> StagedFile:
    """``rows`` as the Parquet file ``name`` in the target's folder. Only text columns
    other than the key (``key``: its values mostly distinct) get dictionary pages: a
    number's or a distinct value's dictionary outgrows its page and is dropped, after
    the writer built it (half of a shard's write time, for a larger file)."""
    footers: list[pq.FileMetaData] = []
    path = Path(target.folder) / name
    path.parent.mkdir(parents=True, exist_ok=True)  # the table's first commit creates the rest
    dictionary = [f.name for f in rows.schema if f.name != key and _is_text(f.type)]
    pq.write_table(rows, path, metadata_collector=footers, use_dictionary=dictionary)
    return StagedFile(name, path.stat().st_size, rows.num_rows, delta_stats(footers[0]))


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def same_columns(table: pa.Schema, output: pa.Schema) -> bool:
    """Whether files of ``output``'s columns hold exactly the table's (a string column
    in whichever Arrow string type the format reads it back as)."""
    def kind(t: pa.DataType) -> object:
        return "string" if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t) else t
    return table.names == output.names and all(kind(a.type) == kind(b.type) for a, b in zip(table, output, strict=True))


def delta_stats(metadata: pq.FileMetaData) -> str:
    """The add action's ``stats`` for a Parquet file, from its footer."""
    nulls: dict[str, int] = {}
    lows: dict[str, Bound] = {}
    highs: dict[str, Bound] = {}
    columns = [metadata.schema.column(i) for i in range(metadata.num_columns)]
    for i, column in enumerate(columns):
        if "." in column.path:  # nested: its statistics are the struct's, not kept here
            continue
        name = column.path
        groups = [metadata.row_group(g).column(i).statistics for g in range(metadata.num_row_groups)]
        if any(s is None for s in groups):
            continue
        nulls[name] = sum(s.null_count for s in groups)
        bounded = [s for s in groups if s.has_min_max]
        if len(bounded) != len(groups) or not bounded:
            continue
        low = _bound(min(s.min for s in bounded), up=False)
        high = _bound(max(s.max for s in bounded), up=True)
        if low is not None and high is not None:
            lows[name], highs[name] = low, high
    stats: JsonObject = {"numRecords": metadata.num_rows, "minValues": lows, "maxValues": highs, "nullCount": nulls}
    return json.dumps(stats, separators=(",", ":"))


def _bound(value: object, up: bool) -> Bound | None:
    """A footer's bound as the log writes it (None: none written for this kind)."""
    if isinstance(value, bool) or isinstance(value, int):
        return value
    if isinstance(value, float):  # the footer leaves NaNs out, as delta-rs does
        return max(-sys.float_info.max, min(sys.float_info.max, value))  # JSON has no infinity
    if isinstance(value, Decimal):
        near = float(value)
        outward = math.nextafter(near, math.inf if up else -math.inf)
        return near if Decimal(near) == value else outward
    if isinstance(value, str):
        return value  # the footer's own, whole (a writer drops statistics it would truncate)
    if isinstance(value, datetime):
        micros = ((value if value.tzinfo else value.replace(tzinfo=timezone.utc)) - _EPOCH) // timedelta(microseconds=1)
        millis = -(-micros // 1000) if up else micros // 1000
        at = _EPOCH + timedelta(milliseconds=millis)
        if value.tzinfo is None:  # without a zone, as delta-rs writes it
            return at.strftime("%Y-%m-%d %H:%M:%S.") + f"{at.microsecond // 1000:03d}"
        return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"
    if isinstance(value, date):
        return value.isoformat()
    return None
