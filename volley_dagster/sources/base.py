"""What the engine needs of a source: a partitioned, replayable log whose epochs are
recorded ranges. The runner cuts a range once, before the first attempt, and every
attempt reads exactly it; Spark tasks read its segments; the Dagster location
observes what waits. Nothing outside a source looks inside its positions: a range's
start and end are per partition, written to the epoch log as the source gives them
and handed back to it to cut the next range from.

Implementations: ``FileLog`` (files in a folder or an S3 prefix), ``KafkaSource``
(offsets of topic partitions), ``DeltaTableSource`` and ``IcebergTableSource``
(another pipeline's table: commits or snapshots), and ``MultiSource`` (several read as one).
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from volley_dagster.io.paths import TableIdentity
from volley_dagster.json_records import JsonObject
from volley_dagster.sources.offsets import Backlog, EpochRange, Segment, SourcePosition

__all__ = ["Source", "SourceSnapshot"]


@dataclass(frozen=True)
class ColumnStatistics:
    """What a Parquet file's footer says of one of its columns over the whole file: how
    many nulls, and for a UTC timestamp its earliest and latest value in microseconds
    since 1970, as Spark reads them. None: the footer does not say."""

    nulls: int | None
    earliest_us: int | None = None
    latest_us: int | None = None

    def __or__(self, other: ColumnStatistics) -> ColumnStatistics:
        """Over the rows of both."""
        def both(a: int | None, b: int | None, f: Callable[[int, int], int]) -> int | None:
            return None if a is None or b is None else f(a, b)
        return ColumnStatistics(both(self.nulls, other.nulls, int.__add__),
                                both(self.earliest_us, other.earliest_us, min), both(self.latest_us, other.latest_us, max))


@dataclass(frozen=True)
class RowGroupStatistics:
    """Rows ``[start, end)`` of a Parquet file, one row group, and what its footer says
    of each top-level column over them, by name."""

    start: int
    end: int
    columns: Mapping[str, ColumnStatistics]


@dataclass(frozen=True)
class NativeParquetFile:
    """A segment's local Parquet file, which Spark's own scan reads: where it is, how
    many records it holds (a segment of all of them needs no row bounds) and what its
    footer says of each row group."""

    path: str
    records: int
    row_groups: tuple[RowGroupStatistics, ...] = ()

    def is_all_of(self, seg: Segment) -> bool:
        """Whether ``seg`` is every record of this file."""
        return seg.start == 0 and seg.end == self.records

    def statistics(self, start: int, end: int) -> dict[str, ColumnStatistics]:
        """What the footer says of each column over the row groups that rows ``[start,
        end)`` touch: exact for the whole file, else bounds of those rows (no fewer nulls,
        no later earliest, no earlier latest). A column some of them do not describe is left out."""
        touched = [g for g in self.row_groups if g.start < end and start < g.end]
        if not touched:
            return {}
        names = set(touched[0].columns).intersection(*(g.columns for g in touched[1:]))
        return {name: reduce(operator.or_, (g.columns[name] for g in touched)) for name in names}

    def time_statistics(self, column: str, start: int, end: int) -> ColumnStatistics:
        """What rows ``[start, end)`` hold of the timestamp ``column`` (nulls, earliest and
        latest in microseconds since 1970), exactly: the one column read from the row
        groups they touch, where the footer only bounds them (``statistics``)."""
        groups = [i for i, g in enumerate(self.row_groups) if g.start < end and start < g.end]
        if not groups:
            return ColumnStatistics(0)
        with pq.ParquetFile(self.path) as parquet:
            read = parquet.read_row_groups(groups, columns=[column]).column(column)
        values = read.slice(start - self.row_groups[groups[0]].start, end - start)
        if not isinstance(values.type, pa.TimestampType):
            raise TypeError(f"{self.path}: column {column!r} is {values.type}, not a timestamp")
        bounds = pc.min_max(values.cast(pa.timestamp("us", values.type.tz)).cast(pa.int64())).as_py()
        return ColumnStatistics(values.null_count, bounds["min"], bounds["max"])


@dataclass(frozen=True)
class SourceSnapshot:
    """What a source looks like now, for its Dagster asset: a version that changes
    when new data lands (Dagster's data version), and metadata to show."""

    version: str
    metadata: dict[str, Any] = field(default_factory=dict)


class Source(ABC):
    """A partitioned log. Implementations are pickled into Spark tasks (``read_segment``
    runs there), so they hold settings and caches, never open connections."""

    uri: str  # where it is, as people and lineage name it

    @abstractmethod
    def describe(self) -> JsonObject:
        """The source's identity as recorded in the pipeline's layout (type, location, format)."""

    @abstractmethod
    def schema(self) -> pa.Schema:
        """The records' columns; the same for every epoch."""

    @abstractmethod
    def cut(self, epoch: int, after: Mapping[str, SourcePosition], max_records: int | None, final: bool = False) -> EpochRange:
        """The range from ``after`` (the previous range's end; empty at the start) to
        what is available now, at most ``max_records`` long, fair across partitions.
        ``final``: the stream ends here."""

    @abstractmethod
    def backlog(self, after: Mapping[str, SourcePosition]) -> Backlog:
        """What waits beyond ``after``: records, and how long the oldest has waited."""

    def available_records(self, after: Mapping[str, SourcePosition]) -> int:
        return self.backlog(after).records

    @abstractmethod
    def verify(self, rng: EpochRange) -> None:
        """Raise ``SourceChangedError`` (or ``SourceError``) naming what changed when the
        recorded range can no longer be read exactly as it was cut."""

    @abstractmethod
    def read_segment(self, seg: Segment, schema: pa.Schema, epoch: int) -> pa.Table:
        """One segment's records (in a Spark task), with their positions, errors and raw
        text (``formats.decode_segment``'s columns)."""

    def native_parquet_files(self, rng: EpochRange, schema: pa.Schema) -> list[NativeParquetFile] | None:
        """The local Parquet file of each segment, when Spark's own scan may read the range
        from them exactly; None (the default): ``read_segment`` reads it in Python workers."""
        return None

    def committed(self, rng: EpochRange) -> None:
        """Called once epoch ``rng.epoch`` is committed (its manifest written), for a
        source to tell its own system how far the pipeline is (a Kafka consumer group).
        Best effort: the epoch log, not this, is where the pipeline resumes."""
        return None  # a file log has nothing to tell

    def parts(self) -> dict[str | None, Source]:
        """The sources this one reads, each shown as its own asset: by name for several
        read as one (``sources/multi.py``); a single source is its one, unnamed part."""
        return {None: self}

    def upstream_table(self) -> TableIdentity | None:
        """The table this source reads, as (kind, location) where a sink names it
        (``SinkLocation``): the pipeline writing that table is upstream of this one in
        Dagster's lineage. None: not a table."""
        return None

    def range_of(self, name: str | None, rng: EpochRange) -> EpochRange:
        """Part ``name``'s share of a recorded range (a single source's: all of it)."""
        return rng

    @abstractmethod
    def snapshot(self) -> SourceSnapshot:
        """The source as its Dagster asset shows it."""
