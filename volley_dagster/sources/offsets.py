"""Positions in a source and the ranges epochs are cut into.

A position is per partition, and only its source reads it. In a file log it is the
file it points into (by name and by index in the partition's name-sorted listing)
and how many of that file's records are consumed; the index lets a cut notice a
file that appeared *before* the position, which would otherwise be skipped
silently. In a Kafka topic it is the next offset to read.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Union

import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster.columns import POS_OFFSET_BITS, POS_SEGMENT_BITS
from volley_dagster.errors import EpochTooLargeError
from volley_dagster.json_records import JsonObject


@dataclass(frozen=True)
class Position:
    file: str | None = None  # None: nothing of the partition consumed yet
    file_index: int = 0
    record: int = 0

    @classmethod
    def from_dict(cls, d: JsonObject) -> Position:
        return cls(d.get("file"), int(d["file_index"]), int(d["record"]))


@dataclass(frozen=True)
class Offset:
    """The next offset to read in a Kafka topic partition."""

    offset: int

    @classmethod
    def from_dict(cls, d: JsonObject) -> Offset:
        return cls(int(d["offset"]))


@dataclass(frozen=True)
class TableVersion:
    """How far a table is read (``sources/table.py``): the last Delta version or
    Iceberg snapshot whose records were cut into an epoch; None: none yet."""

    table_version: int | None

    @classmethod
    def from_dict(cls, d: JsonObject) -> TableVersion:
        value = d["table_version"]
        return cls(None if value is None else int(value))


SourcePosition = Union[Position, Offset, TableVersion]


def position_from_dict(d: JsonObject) -> SourcePosition:
    if "table_version" in d:
        return TableVersion.from_dict(d)
    return Offset.from_dict(d) if "offset" in d else Position.from_dict(d)


def fair_shares(available: dict[str, int], budget: int | None) -> dict[str, int]:
    """Split ``budget`` between partitions: each gets an equal share, and what a small
    partition leaves over goes to the others (water-filling)."""
    if budget is None:
        return dict(available)
    shares = {p: 0 for p in available}
    left = budget
    hungry = sorted((n, p) for p, n in available.items() if n > 0)
    while hungry and left > 0:
        each = max(1, left // len(hungry))
        n, p = hungry[0]
        if n <= each:
            shares[p] = n
            left -= n
            hungry.pop(0)
            continue
        for _, p in hungry:
            give = min(each, left)
            shares[p] = give
            left -= give
        break
    return shares


@dataclass(frozen=True)
class Segment:
    """Records ``[start, end)`` of one file, or offsets ``[start, end)`` of one topic
    partition: the unit a Spark read task handles."""

    id: int
    partition: str
    file: str  # path relative to the log root; a Kafka segment's topic
    start: int
    end: int
    size: int  # bytes when cut; a different size on read means the file was rewritten (0: a topic)
    version: str = ""  # the file's version when cut (storage.FileInfo); "" in ranges cut before versions

    @property
    def records(self) -> int:
        return self.end - self.start

    def position_base(self) -> int:
        """What a record's offset adds up to for its event position (``columns.POS``): the
        segment in the high bits and the offset *from the segment's start* in the low ones,
        since a Kafka offset itself may pass 2^40."""
        return (self.id << POS_OFFSET_BITS) - self.start


@dataclass(frozen=True)
class EpochRange:
    """Exactly what epoch N reads. Recorded before the first attempt; never recomputed."""

    epoch: int
    start: dict[str, SourcePosition]
    end: dict[str, SourcePosition]
    segments: tuple[Segment, ...] = field(default_factory=tuple)
    end_of_stream: bool = False  # the final epoch: windows all fire, nothing is cut after it
    cut_at_us: int | None = None  # wall clock when cut (microseconds); None in ranges cut before it was kept

    @property
    def records(self) -> int:
        return sum(s.records for s in self.segments)

    def segment_of(self, pos: int) -> tuple[Segment, int]:
        """The segment and file record index (or Kafka offset) of an event position."""
        seg = self.segments[pos >> POS_OFFSET_BITS]
        return seg, seg.start + (pos & ((1 << POS_OFFSET_BITS) - 1))

    def where_in_log(self, positions: pa.Array) -> list[pa.Array]:
        """Event positions back as (partition, file, record offset) columns, in bulk (late
        records can be many): segment = position >> 40, offset = its start + the low 40 bits."""
        pos = positions.cast(pa.int64())
        segment = pc.shift_right(pos, POS_OFFSET_BITS)
        by_segment = [pa.array([getattr(s, a) for s in self.segments], pa.string()) for a in ("partition", "file")]
        starts = pa.array([s.start for s in self.segments], pa.int64())
        offsets = pc.add(pc.take(starts, segment), pc.bit_wise_and(pos, (1 << POS_OFFSET_BITS) - 1))
        return [pc.take(values, segment) for values in by_segment] + [offsets]

    def check_positions(self) -> None:
        """Refuse a cut whose records' event positions could not tell apart (``columns.POS``):
        a segment of 2^40 records or more, or 2^23 segments or more."""
        if len(self.segments) >= 1 << POS_SEGMENT_BITS:
            partition, count = Counter(s.partition for s in self.segments).most_common(1)[0]
            raise EpochTooLargeError(
                f"epoch {self.epoch}: the cut has {len(self.segments)} segments (partition {partition} alone "
                f"{count} files), and an epoch holds fewer than 2^23; nothing was cut. Set max_records_per_epoch "
                "lower (e.g. 1,000,000) so each epoch takes fewer files")
        for seg in self.segments:
            if seg.records >= 1 << POS_OFFSET_BITS:
                raise EpochTooLargeError(
                    f"epoch {self.epoch}: partition {seg.partition} ({seg.file}) would give it {seg.records} records "
                    f"(offsets {seg.start}..{seg.end - 1}), and an epoch reads fewer than 2^40 of one segment; nothing "
                    "was cut. Set max_records_per_epoch (e.g. 1,000,000): it bounds each partition's share")

    def to_dict(self) -> JsonObject:
        return {
            "epoch": self.epoch,
            "records": self.records,
            "start": {p: asdict(pos) for p, pos in self.start.items()},
            "end": {p: asdict(pos) for p, pos in self.end.items()},
            "segments": [asdict(s) for s in self.segments],
            "end_of_stream": self.end_of_stream,
            "cut_at_us": self.cut_at_us,
        }

    @classmethod
    def from_dict(cls, d: JsonObject) -> EpochRange:
        return cls(
            epoch=int(d["epoch"]),
            start={p: position_from_dict(v) for p, v in d["start"].items()},
            end={p: position_from_dict(v) for p, v in d["end"].items()},
            segments=tuple(Segment(**s) for s in d["segments"]),
            end_of_stream=bool(d.get("end_of_stream", False)),
            cut_at_us=d.get("cut_at_us"),
        )

    def digest(self) -> str:
        """A short fingerprint of exactly what the epoch reads (files, versions, records):
        sinks store it so a re-cut range over other records is told apart from a retry."""
        read = {k: v for k, v in self.to_dict().items() if k != "cut_at_us"}
        canonical = json.dumps(read, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()[:32]

    def summary(self) -> dict[str, str]:
        """The range as people read it: per partition, file:record from and to."""
        def fmt(pos: SourcePosition) -> str:
            if isinstance(pos, Offset):
                return f"offset {pos.offset}"
            if isinstance(pos, TableVersion):
                return "start" if pos.table_version is None else f"version {pos.table_version}"
            return f"{pos.file}:{pos.record}" if pos.file else "start"

        return {p: f"{fmt(self.start[p])} -> {fmt(self.end[p])}" for p in sorted(self.end)}


@dataclass(frozen=True)
class Backlog:
    """What waits in a source beyond a position: records, the files holding them, and
    when the oldest of those files was written (None: nothing waits, or unknown)."""

    records: int = 0
    files: int = 0  # the files holding them (a Kafka topic: the partitions)
    oldest_written_at: float | None = None
    per_partition: dict[str, int] = field(default_factory=dict)  # records waiting, where a source tells (Kafka lag)
    parts: dict[str, Backlog] = field(default_factory=dict)  # several sources read as one: each one's

    def oldest_age_s(self, now: float) -> float:
        """How long the oldest waiting record has waited (0 when nothing waits)."""
        return max(0.0, now - self.oldest_written_at) if self.oldest_written_at else 0.0
