"""Window pipelines over generated logs, and their reference: the documented rule
(``volley_dagster.operators.window``) applied epoch by epoch in plain Python,
one record at a time, straight from the source files (or from any cut of the log
into epochs: ``reference_epochs``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.helpers import spark_max, spark_sum, with_tables
from volley_dagster import FileLog, ParquetSink, Pipeline, count, first, last, max_, sum_
from volley_dagster.operators.window import Windows

KEY = "merchant_id"
VALUES = ["events", "total", "largest", "first_event", "last_event"]


def window_pipeline(
    events: Path, output: Path, windows: Windows, *, delay: str, lateness: str,
    max_pending: int | None = None, shards: int = 2, name: str = "windows", tables: Path | None = None,
    ntz: bool = False, skew: str | None = None, parquet: bool = True,
) -> Pipeline:
    """``ntz``: event time as TIMESTAMP_NTZ (same wall-clock values: the session is UTC);
    ``parquet``: a Parquet file per epoch under ``output`` too."""
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
        .with_shards(shards)
    )
    if parquet:
        pipeline = pipeline.sink(ParquetSink(output))
    return with_tables(pipeline, tables, delta_mode="append", iceberg_table="volley.windows")


@dataclass
class _Acc:
    start: int
    end: int
    events: int = 0
    total: float | None = None
    largest: float | None = None
    first: tuple = ((float("inf"), 0), None)  # ((epoch, index in the epoch), event_id)
    last: tuple = ((float("-inf"), 0), None)

    def add(self, at: tuple, amount: float | None, event_id: int) -> None:
        self.events += 1
        self.total = spark_sum(self.total, amount)
        self.largest = spark_max(self.largest, amount)
        self.first = min(self.first, (at, event_id), key=lambda x: x[0])
        self.last = max(self.last, (at, event_id), key=lambda x: x[0])

    def absorb(self, other: _Acc) -> None:
        self.start, self.end = min(self.start, other.start), max(self.end, other.end)
        self.events += other.events
        self.total = spark_sum(self.total, other.total)
        self.largest = spark_max(self.largest, other.largest)
        self.first = min(self.first, other.first, key=lambda x: x[0])
        self.last = max(self.last, other.last, key=lambda x: x[0])

    def row(self, key: object) -> tuple:
        return (key, self.start, self.end, self.events, _comparable(self.total, 6), _comparable(self.largest),
                self.first[1], self.last[1])


def _comparable(value: float | None, digits: int | None = None) -> object:
    """A float as a row holds it for set comparison: NaN as the string "NaN" (NaN is
    not equal to itself), a sum rounded (folded in another order)."""
    if value is not None and math.isnan(value):
        return "NaN"
    return value if value is None or digits is None else round(value, digits)


@dataclass
class Reference:
    fired: dict[int, set[tuple]] = field(default_factory=dict)  # epoch -> window rows
    late: dict[int, set[tuple]] = field(default_factory=dict)  # epoch -> (file, offset, window start)
    watermark: dict[int, int | None] = field(default_factory=dict)
    open: set[tuple] = field(default_factory=set)  # windows still open after the last epoch
    dead: dict[int, set[tuple]] = field(default_factory=dict)  # epoch -> (file, offset) of its bad records


def assigned_windows(windows: Windows, t: int) -> list[tuple[int, int]]:
    if windows.kind == "session":
        return [(t, t + windows.gap_us)]
    size, slide = windows.size_us, windows.slide_us
    last_start = t - t % slide
    return [(s, s + size) for s in range(last_start, t - size, -slide) if s <= t < s + size]


def reference(files: list[Path], windows: Windows, delay_us: int, lateness_us: int, end_of_stream: bool) -> Reference:
    """Each file is one epoch; the last one ends the stream when ``end_of_stream``."""
    epochs = []
    for path in files:
        table = pq.read_table(path)
        epochs.append(table.append_column("file", pa.array([path.name] * table.num_rows, pa.string()))
                      .append_column("offset", pa.array(range(table.num_rows), pa.int64())))
    return reference_epochs(epochs, windows, delay_us, lateness_us, end_of_stream)


def reference_epochs(epochs: list[pa.Table], windows: Windows, delay_us: int, lateness_us: int, end_of_stream: bool,
                     bounds: list[int | None] | None = None, handed: list[int | None] | None = None) -> Reference:
    """Each table is one epoch's records in log order, with ``file`` and ``offset``
    columns saying where each is in the log; the last epoch ends the stream when
    ``end_of_stream``. ``bounds``: per epoch, the latest event time believed
    (``max_event_time_skew``). A record with a null key or event time, or one later
    than its epoch's bound, is a bad record (``dead``), before any window sees it."""
    ref = Reference()
    open_: dict[tuple, _Acc] = {}
    watermark = None
    for epoch, table in enumerate(epochs, start=1):
        bound = bounds[epoch - 1] if bounds is not None else None
        t_us = table.column("event_time").cast(pa.int64()).to_pylist()
        late: set[tuple] = set()
        dead: set[tuple] = set()
        fresh: dict[tuple, _Acc] = {}
        latest = None
        for i, (row, t) in enumerate(zip(table.to_pylist(), t_us, strict=True)):
            if row["status"] == "failed":
                continue
            where = (row["file"], row["offset"])
            if row[KEY] is None or t is None or (bound is not None and t > bound):
                dead.add(where)
                continue
            latest = t if latest is None else max(latest, t)
            for start, end in assigned_windows(windows, t):
                if watermark is not None and end + lateness_us <= watermark:
                    late.add((*where, start))
                    continue
                target = fresh if windows.kind == "session" else open_
                acc = target.setdefault((row[KEY], start) if windows.kind != "session" else (row[KEY], start, i), _Acc(start, end))
                acc.add((epoch, i), row["amount"], row["event_id"])
        if windows.kind == "session":
            _merge_sessions(open_, fresh)
        if handed is not None:
            latest = handed[epoch - 1]
        if latest is not None:
            watermark = latest - delay_us if watermark is None else max(watermark, latest - delay_us)
        final = end_of_stream and epoch == len(epochs)
        fire = [k for k, acc in open_.items() if final or (watermark is not None and acc.end + lateness_us <= watermark)]
        ref.fired[epoch] = {open_.pop(k).row(k[0]) for k in fire}
        ref.late[epoch] = late
        ref.dead[epoch] = dead
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
                   [_comparable(x, 6) for x in d["total"]], [_comparable(x) for x in d["largest"]], d["first_event"],
                   d["last_event"], strict=True))


def crash_window_pipeline(events: Path, output: Path, tables: Path | None = None) -> Pipeline:
    """The window pipeline the kill -9 tests run: sessions (they merge across epochs)."""
    from volley_dagster import session

    return window_pipeline(events, output, session("8 seconds"), delay="5 seconds", lateness="0 seconds", tables=tables)


def staged_window_pipeline(events: Path, output: Path, tables: Path) -> Pipeline:
    """The kill -9 tests' window pipeline with one sink, a local Delta append, whose rows
    the shard tasks write into the table's folder themselves (``sinks/staged_files.py``)."""
    from volley_dagster import session
    from volley_dagster.sinks.delta import DeltaSink

    pipeline = window_pipeline(events, output, session("8 seconds"), delay="5 seconds", lateness="0 seconds",
                               parquet=False)
    return pipeline.sink(DeltaSink(tables / "delta", mode="append"))
