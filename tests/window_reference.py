"""Window pipelines over generated logs, and their reference: the documented rule
(``volley_dagster.operators.window``) applied epoch by epoch in plain Python,
one record at a time, straight from the source files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.helpers import with_tables
from volley_dagster import FileLog, ParquetSink, Pipeline, count, first, last, max_, sum_
from volley_dagster.operators.window import Windows

KEY = "merchant_id"
VALUES = ["events", "total", "largest", "first_event", "last_event"]


def window_pipeline(
    events: Path, output: Path, windows: Windows, *, delay: str, lateness: str,
    max_pending: int | None = None, shards: int = 2, name: str = "windows", tables: Path | None = None,
    ntz: bool = False, skew: str | None = None,
) -> Pipeline:
    """``ntz``: event time as TIMESTAMP_NTZ (same wall-clock values: the session is UTC)."""
    pipeline = Pipeline(name).source(FileLog(events, format="parquet")).where("status != 'failed'")
    if ntz:
        pipeline = pipeline.with_column("event_time", "cast(event_time as timestamp_ntz)")
    pipeline = (
        pipeline
        .key_by(KEY)
        .window(windows, on="event_time", max_out_of_orderness=delay, allowed_lateness=lateness,
                max_pending_windows=max_pending, max_event_time_skew=skew)
        .aggregate(events=count(), total=sum_("amount"), largest=max_("amount"),
                   first_event=first("event_id"), last_event=last("event_id"))
        .sink(ParquetSink(output))
        .with_shards(shards)
    )
    return with_tables(pipeline, tables, delta_mode="append", iceberg_table="volley.windows")


@dataclass
class _Acc:
    start: int
    end: int
    events: int = 0
    total: float = 0.0
    largest: float = float("-inf")
    first: tuple = ((float("inf"), 0), None)  # ((epoch, offset), event_id)
    last: tuple = ((float("-inf"), 0), None)

    def add(self, at: tuple, amount: float, event_id: int) -> None:
        self.events += 1
        self.total += amount
        self.largest = max(self.largest, amount)
        self.first = min(self.first, (at, event_id), key=lambda x: x[0])
        self.last = max(self.last, (at, event_id), key=lambda x: x[0])

    def absorb(self, other: _Acc) -> None:
        self.start, self.end = min(self.start, other.start), max(self.end, other.end)
        self.events += other.events
        self.total += other.total
        self.largest = max(self.largest, other.largest)
        self.first = min(self.first, other.first, key=lambda x: x[0])
        self.last = max(self.last, other.last, key=lambda x: x[0])

    def row(self, key: int) -> tuple:
        return (key, self.start, self.end, self.events, round(self.total, 6), self.largest, self.first[1], self.last[1])


@dataclass
class Reference:
    fired: dict[int, set[tuple]] = field(default_factory=dict)  # epoch -> window rows
    late: dict[int, set[tuple]] = field(default_factory=dict)  # epoch -> (file, offset, window start)
    watermark: dict[int, int | None] = field(default_factory=dict)
    open: set[tuple] = field(default_factory=set)  # windows still open after the last epoch


def assigned_windows(windows: Windows, t: int) -> list[tuple[int, int]]:
    if windows.kind == "session":
        return [(t, t + windows.gap_us)]
    size, slide = windows.size_us, windows.slide_us
    last_start = t - t % slide
    return [(s, s + size) for s in range(last_start, t - size, -slide) if s <= t < s + size]


def reference(files: list[Path], windows: Windows, delay_us: int, lateness_us: int, end_of_stream: bool) -> Reference:
    """Each file is one epoch; the last one ends the stream when ``end_of_stream``."""
    ref = Reference()
    open_: dict[tuple[int, int], _Acc] = {}
    watermark = None
    for epoch, path in enumerate(files, start=1):
        table = pq.read_table(path)
        t_us = table.column("event_time").cast(pa.int64()).to_pylist()
        late, latest, fresh = set(), None, {}
        for offset, (row, t) in enumerate(zip(table.to_pylist(), t_us)):
            if row["status"] == "failed":
                continue
            latest = t if latest is None else max(latest, t)
            for start, end in assigned_windows(windows, t):
                if watermark is not None and end + lateness_us <= watermark:
                    late.add((path.name, offset, start))
                    continue
                target = fresh if windows.kind == "session" else open_
                acc = target.setdefault((row[KEY], start) if windows.kind != "session" else (row[KEY], start, offset), _Acc(start, end))
                acc.add((epoch, offset), row["amount"], row["event_id"])
        if windows.kind == "session":
            _merge_sessions(open_, fresh)
        if latest is not None:
            watermark = latest - delay_us if watermark is None else max(watermark, latest - delay_us)
        final = end_of_stream and epoch == len(files)
        fire = [k for k, acc in open_.items() if final or (watermark is not None and acc.end + lateness_us <= watermark)]
        ref.fired[epoch] = {open_.pop(k).row(k[0]) for k in fire}
        ref.late[epoch] = late
        ref.watermark[epoch] = watermark
    ref.open = {acc.row(k[0]) for k, acc in open_.items()}
    return ref


def _merge_sessions(open_: dict, fresh: dict) -> None:
    """Sessions of a key that overlap or touch become one (any order gives the same)."""
    by_key: dict[int, list[_Acc]] = {}
    for (key, *_), acc in list(open_.items()) + list(fresh.items()):
        by_key.setdefault(key, []).append(acc)
    open_.clear()
    for key, accs in by_key.items():
        accs.sort(key=lambda a: a.start)
        current = accs[0]
        for acc in accs[1:]:
            if acc.start <= current.end:
                current.absorb(acc)
            else:
                open_[(key, current.start)] = current
                current = acc
        open_[(key, current.start)] = current


def window_rows(table: pa.Table) -> set[tuple]:
    """Engine output (or state) as the reference's rows."""
    d = table.to_pydict()
    to_us = lambda col: table.column(col).cast(pa.int64()).to_pylist()  # noqa: E731
    return set(zip(d[KEY], to_us("window_start"), to_us("window_end"), d["events"],
                   [round(x, 6) for x in d["total"]], d["largest"], d["first_event"], d["last_event"]))


def crash_window_pipeline(events: Path, output: Path, tables: Path | None = None) -> Pipeline:
    """The window pipeline the kill -9 tests run: sessions (they merge across epochs)."""
    from volley_dagster import session

    return window_pipeline(events, output, session("8 seconds"), delay="5 seconds", lateness="0 seconds", tables=tables)
