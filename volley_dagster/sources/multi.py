"""Several named sources read as one: each epoch records one range of every source, in
the same ``offsets.json``, before its first attempt, and every attempt reads exactly
those ranges. This is the epoch-level form of barrier alignment across input streams
(Volley's exactly-once design): an epoch is a consistent cut of all of them.

The combined range is an ordinary ``EpochRange`` whose partitions are named
``<source>/<partition>`` and whose segments are numbered across the sources, so
event positions, side outputs (file and offset), range digests and lineage marks
work unchanged. Each source keeps its own positions, which only it reads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

import pyarrow as pa

from volley_dagster.errors import ConfigError, SourceError, SourceNotReadyError
from volley_dagster.json_records import JsonObject
from volley_dagster.sources.base import Source, SourceSnapshot
from volley_dagster.sources.offsets import Backlog, EpochRange, Segment, SourcePosition, fair_shares

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
SEPARATOR = "/"  # <source>/<partition>: a source name never holds it


class MultiSource(Source):
    """``sources``: name -> source. Their records share the columns of every source, by
    name (a column one source lacks is null in its rows; one name of two types is
    refused); ``source_column`` adds the name of the source each record came from."""

    def __init__(self, sources: Mapping[str, Source], source_column: str | None = None) -> None:
        if len(sources) < 2:
            raise ConfigError(f"a pipeline of several sources reads two or more; got {sorted(sources)}")
        for name in sources:
            if not _NAME.match(name):
                raise ConfigError(f"source name {name!r}: use a letter, then letters, digits or '_' (max 64)")
        self.sources = dict(sources)
        self.source_column = source_column
        self.uri = ", ".join(f"{name}={source.uri}" for name, source in self.sources.items())
        self._schema: pa.Schema | None = None

    def describe(self) -> JsonObject:
        return {"type": "sources", "source_column": self.source_column,
                "sources": {name: source.describe() for name, source in self.sources.items()}}

    def schema(self) -> pa.Schema:
        """Every source's columns, by name. A column is nullable unless every source has
        it non-nullable: a source that lacks it gives its rows nulls."""
        if self._schema is None:
            fields: dict[str, tuple[str, pa.Field]] = {}
            schemas = {name: source.schema() for name, source in self.sources.items()}
            for name, schema in schemas.items():
                for f in schema:
                    seen = fields.setdefault(f.name, (name, f))
                    if not seen[1].type.equals(f.type):
                        raise ConfigError(f"column {f.name!r} is {seen[1].type} in source {seen[0]!r} and {f.type} in "
                                          f"source {name!r}; cast one of them in its source's schema")
            required = {column for column in fields
                        if all(column in s.names and not s.field(column).nullable for s in schemas.values())}
            merged = [f if f.name in required else f.with_nullable(True) for _, f in fields.values()]
            if self.source_column is not None:
                if self.source_column in fields:
                    raise ConfigError(f"source_column {self.source_column!r} is already a column of source "
                                      f"{fields[self.source_column][0]!r}; name it otherwise")
                merged.append(pa.field(self.source_column, pa.string()))
            self._schema = pa.schema(merged)
        return self._schema

    # -- ranges: one per source, in one EpochRange ---------------------------------------

    def split(self, positions: Mapping[str, SourcePosition]) -> dict[str, dict[str, SourcePosition]]:
        """``<source>/<partition>`` positions back into each source's own."""
        parts: dict[str, dict[str, SourcePosition]] = {name: {} for name in self.sources}
        for key, pos in positions.items():
            name, sep, partition = key.partition(SEPARATOR)
            if not sep or name not in parts:
                raise SourceError(f"position {key!r} names no source of {sorted(self.sources)}; was the pipeline's "
                                  "set of sources changed? A checkpoint root reads the sources it started with")
            parts[name][partition] = pos
        return parts

    def parts(self) -> dict[str | None, Source]:
        return {name: source for name, source in self.sources.items()}

    def range_of(self, name: str | None, rng: EpochRange) -> EpochRange:
        """Source ``name``'s part of a combined range, in its own partition names (the
        segments keep their combined ids, which the records' positions are built on);
        None: all of it."""
        if name is None:
            return rng
        prefix = name + SEPARATOR
        own = lambda d: {p[len(prefix):]: pos for p, pos in d.items() if p.startswith(prefix)}  # noqa: E731
        segments = tuple(replace(s, partition=s.partition[len(prefix):]) for s in rng.segments
                         if s.partition.startswith(prefix))
        return replace(rng, start=own(rng.start), end=own(rng.end), segments=segments)

    def waiting_for(self) -> list[str]:
        """The sources whose schema is not known yet (no files, no ``schema=``): until
        each has one, the columns of the records are not known, so nothing is cut."""
        waiting = []
        for name, source in self.sources.items():
            try:
                source.schema()
            except SourceNotReadyError:
                waiting.append(name)
        return waiting

    def cut(self, epoch: int, after: Mapping[str, SourcePosition], max_records: int | None,
            final: bool = False) -> EpochRange:
        """Each source's range from where it stopped, at most ``max_records`` together,
        shared fairly between the sources (a quiet one leaves its share to the others);
        nothing while a source's schema is not known yet (``waiting_for``)."""
        split = self.split(after)
        quota: dict[str, int | None] = dict.fromkeys(self.sources)
        if self._schema is None and self.waiting_for():
            quota = dict.fromkeys(self.sources, 0)
        elif max_records is not None:
            waiting = {name: source.available_records(split[name]) for name, source in self.sources.items()}
            quota = dict(fair_shares(waiting, max_records))
        segments: list[Segment] = []
        start: dict[str, SourcePosition] = {}
        end: dict[str, SourcePosition] = {}
        for name, source in self.sources.items():
            part = source.cut(epoch, split[name], quota[name], final)
            for seg in part.segments:
                segments.append(replace(seg, id=len(segments), partition=f"{name}{SEPARATOR}{seg.partition}"))
            start.update({f"{name}{SEPARATOR}{p}": pos for p, pos in part.start.items()})
            end.update({f"{name}{SEPARATOR}{p}": pos for p, pos in part.end.items()})
        return EpochRange(epoch, start, end, tuple(segments))

    def backlog(self, after: Mapping[str, SourcePosition]) -> Backlog:
        """What waits in all of them, and in each (``parts``: the sensor observes each)."""
        split = self.split(after)
        parts = {name: source.backlog(split[name]) for name, source in self.sources.items()}
        oldest = [b.oldest_written_at for b in parts.values() if b.oldest_written_at]
        return Backlog(sum(b.records for b in parts.values()), sum(b.files for b in parts.values()),
                       min(oldest) if oldest else None,
                       {f"{name}{SEPARATOR}{p}": n for name, b in parts.items() for p, n in b.per_partition.items()},
                       parts)

    def verify(self, rng: EpochRange) -> None:
        for name, source in self.sources.items():
            source.verify(self.range_of(name, rng))

    def committed(self, rng: EpochRange) -> None:
        for name, source in self.sources.items():
            source.committed(self.range_of(name, rng))

    # -- reading (in Spark tasks) ------------------------------------------------------------

    def read_segment(self, seg: Segment, schema: pa.Schema, epoch: int) -> pa.Table:
        """The segment read by its own source, in that source's columns, then laid out in
        the combined ones: nulls where the source has no such column."""
        name, _, partition = seg.partition.partition(SEPARATOR)
        source = self.sources[name]
        table = source.read_segment(replace(seg, partition=partition), source.schema(), epoch)
        columns = []
        for f in schema:
            if f.name == self.source_column:
                columns.append(pa.array([name] * table.num_rows, pa.string()))
            elif f.name in table.column_names:
                columns.append(table.column(f.name))
            else:
                columns.append(pa.nulls(table.num_rows, f.type))
        meta = [n for n in table.column_names if n not in schema.names]  # position, error, raw text
        return pa.table(columns + [table.column(n) for n in meta], names=schema.names + meta)

    def snapshot(self) -> SourceSnapshot:
        parts = {name: source.snapshot() for name, source in self.sources.items()}
        return SourceSnapshot(str(sorted((name, s.version) for name, s in parts.items())),
                              {f"{name}_{k}": v for name, s in parts.items() for k, v in s.metadata.items()})
