"""Positions in an append-only file log and the ranges epochs are cut into.

A position is per partition: the file it points into (by name and by index in
the partition's name-sorted listing) and how many of that file's records are
consumed. The index lets a cut notice a file that appeared *before* the
position, which would otherwise be skipped silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from volley_dagster.columns import POS_OFFSET_BITS


@dataclass(frozen=True)
class Position:
    file: str | None = None  # None: nothing of the partition consumed yet
    file_index: int = 0
    record: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Position:
        return cls(d.get("file"), int(d["file_index"]), int(d["record"]))


@dataclass(frozen=True)
class Segment:
    """Records ``[start, end)`` of one file: the unit a Spark read task handles."""

    id: int
    partition: str
    file: str  # path relative to the log root
    start: int
    end: int
    size: int  # bytes when cut; a different size on read means the file was rewritten
    version: str = ""  # the file's version when cut (storage.FileInfo); "" in ranges cut before versions

    @property
    def records(self) -> int:
        return self.end - self.start

    def position_base(self) -> int:
        return self.id << POS_OFFSET_BITS


@dataclass(frozen=True)
class EpochRange:
    """Exactly what epoch N reads. Recorded before the first attempt; never recomputed."""

    epoch: int
    start: dict[str, Position]
    end: dict[str, Position]
    segments: tuple[Segment, ...] = field(default_factory=tuple)
    end_of_stream: bool = False  # the final epoch: windows all fire, nothing is cut after it
    cut_at_us: int | None = None  # wall clock when cut (microseconds); None in ranges cut before it was kept

    @property
    def records(self) -> int:
        return sum(s.records for s in self.segments)

    def segment_of(self, pos: int) -> tuple[Segment, int]:
        """The segment and file record index of an event position."""
        seg = self.segments[pos >> POS_OFFSET_BITS]
        return seg, pos & ((1 << POS_OFFSET_BITS) - 1)

    def to_dict(self) -> dict[str, Any]:
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
    def from_dict(cls, d: dict[str, Any]) -> EpochRange:
        return cls(
            epoch=int(d["epoch"]),
            start={p: Position.from_dict(v) for p, v in d["start"].items()},
            end={p: Position.from_dict(v) for p, v in d["end"].items()},
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
        def fmt(pos: Position) -> str:
            return f"{pos.file}:{pos.record}" if pos.file else "start"

        return {p: f"{fmt(self.start[p])} -> {fmt(self.end[p])}" for p in sorted(self.end)}


@dataclass(frozen=True)
class Backlog:
    """What waits in a source beyond a position: records, the files holding them, and
    when the oldest of those files was written (None: nothing waits, or unknown)."""

    records: int = 0
    files: int = 0
    oldest_written_at: float | None = None

    def oldest_age_s(self, now: float) -> float:
        """How long the oldest waiting record has waited (0 when nothing waits)."""
        return max(0.0, now - self.oldest_written_at) if self.oldest_written_at else 0.0
