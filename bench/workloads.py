"""The side-by-side benchmark's workloads: their event logs, our pipelines for them,
and references computed straight from the files, so a fast wrong answer cannot pass.

A   running total and count per merchant of active events, upserted to Delta
As  A over the same events with the merchant stored as a string (``m-000123``)
Ad  A after ``deduplicate(on="event_id", within="10 minutes")``, over a log whose every
    file from the second on re-sends the first 5% of the one before it (``resend_log``)
At  A with an event-time TTL of 30 days (nothing expires within a run: A's answer)
B   1-minute tumbling windows per merchant over all events, 30 s watermark, appended to Delta
Bsl B with 5-minute windows sliding every minute
Bse B with session windows, 5-minute gap
C   state-size scaling: a state of N keys built by one epoch, then epochs that each
    touch the same number of keys (changed rows appended to Delta); run for two N
    (also S, the same pipeline with the records per epoch fixed and N growing)
D   the floor: a stateless Spark batch groupBy over the same epoch's files
DB  B's floor: a stateless Spark groupBy(merchant, window) of the same epoch's file
    (DBsl, DBse: Bsl's and Bse's)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import Column
from pyspark.sql import functions as F

from volley_dagster import DeltaSink, FileLog, Pipeline, count, max_, session, sliding, sum_, tumbling
from volley_dagster.demo.events import EVENT_SCHEMA, START_US, generate, write_events
from volley_dagster.operators.window import Windows
from volley_dagster.sources.storage import storage_for

WATERMARK_DELAY_US = 30_000_000
RESEND_SHARE = 0.05  # Ad: of each file, re-sent by the next


@dataclass(frozen=True)
class WindowSpec:
    """A windowed workload's windows, one definition for our pipeline, the peer's
    query, the floors and the reference. ``size_s`` is a session's gap."""

    kind: Literal["tumbling", "sliding", "session"]
    size_s: int
    slide_s: int = 0  # sliding only

    def ours(self) -> Windows:
        """``Pipeline.window``'s argument."""
        if self.kind == "session":
            return session(f"{self.size_s} seconds")
        if self.kind == "sliding":
            return sliding(f"{self.size_s} seconds", f"{self.slide_s} seconds")
        return tumbling(f"{self.size_s} seconds")

    def spark(self, column: str = "event_time") -> Column:
        """Spark's window column: a struct of start and end."""
        if self.kind == "session":
            return F.session_window(column, f"{self.size_s} seconds")
        slide = self.slide_s if self.kind == "sliding" else self.size_s
        return F.window(column, f"{self.size_s} seconds", f"{slide} seconds")


WINDOWS = {"B": WindowSpec("tumbling", 60), "Bsl": WindowSpec("sliding", 300, 60), "Bse": WindowSpec("session", 300)}


@dataclass(frozen=True)
class Workload:
    name: str
    events: Path  # the log: one file per epoch
    files: tuple[str, ...]
    shards: int
    format: str = "parquet"  # json: the log is read by the Python reader, not Spark's scan

    def records(self, index: int) -> int:
        """Records in file ``index`` (one epoch), from the Parquet footer."""
        return pq.ParquetFile(self.events / self.files[index]).metadata.num_rows

    def pipeline(self, tables: Path) -> Pipeline:
        """Our engine's pipeline for this workload, its one sink under ``tables``."""
        log = FileLog(self.events, format=self.format, schema=EVENT_SCHEMA if self.format == "json" else None)
        base = Pipeline(f"bench_{self.name.lower()}").source(log)
        if self.name in WINDOWS:
            return (
                base.key_by("merchant_id")
                .window(WINDOWS[self.name].ours(), on="event_time", max_out_of_orderness="30 seconds")
                .aggregate(events=count(), total=sum_("amount"), largest=max_("amount"))
                .sink(DeltaSink(tables / "delta", mode="append"))
                .with_shards(self.shards)
            )
        if self.name == "Ad":
            base = base.deduplicate(on="event_id", within="10 minutes", event_time="event_time")
        ttl = {"ttl": "30 days", "event_time": "event_time"} if self.name == "At" else {}
        mode = "append" if self.name == "C" else "upsert"  # C: the changed keys, so the sink follows them too
        return (
            base.where("status = 'active'")
            .key_by("merchant_id")
            .aggregate(total=sum_("amount"), events=count(), **ttl)
            .sink(DeltaSink(tables / "delta", mode=mode))
            .with_shards(self.shards)
        )


def event_log(events: Path, epochs: int, records: int, keys: int, zipf: float | None) -> tuple[str, ...]:
    """A and B (and D): the demo generator's seeded log, one file per epoch."""
    if events.exists():
        return tuple(sorted(p.name for p in events.glob("*.parquet")))
    return tuple(generate(events, epochs, records // epochs, keys, zipf=zipf))


def string_key_log(events: Path, ints: Path, files: tuple[str, ...]) -> tuple[str, ...]:
    """As: the events of ``ints``, each file rewritten with merchant 123 as ``"m-000123"``."""
    events.mkdir(parents=True, exist_ok=True)
    storage = storage_for(events)
    for name in files:
        if not (events / name).exists():
            table = pq.read_table(ints / name)
            digits = pc.utf8_lpad(pc.cast(table.column("merchant_id"), pa.string()), 6, "0")
            keyed = pc.binary_join_element_wise(pa.scalar("m-"), digits, pa.scalar(""))
            write_events(storage, name,
                         table.set_column(table.schema.get_field_index("merchant_id"), "merchant_id", keyed))
    return files


def resend(events: Path, names: tuple[str, ...] | list[str], share: float, into: Path | None = None,
           tail: bool = False) -> None:
    """File i keeps its first records and, in place of its last ``share``, re-sends the
    first ``share`` of the records file i-1 sent of its own (its last, with ``tail``):
    an at-least-once producer's retries. Written ``into`` another folder or over
    ``events``; one file and its predecessor in memory at a time."""
    into = into or events
    into.mkdir(parents=True, exist_ok=True)
    storage = storage_for(into)  # written as the demo writes a log: its row groups, so Spark scans them alike
    previous: pa.Table | None = None  # file i-1's own records, without its re-sent ones
    for name in names:
        table = pq.read_table(events / name)
        if previous is None:
            own = table
            if into != events:
                write_events(storage, name, table)
        else:
            n = int(table.num_rows * share)
            own = table.slice(0, table.num_rows - n)
            copies = previous.slice(previous.num_rows - n if tail else 0, n)
            write_events(storage, name, pa.concat_tables([own, copies]))
        previous = own


def resend_log(events: Path, source: Path, files: tuple[str, ...], tail: bool = False) -> tuple[str, ...]:
    """Ad: the log of ``source`` with ``RESEND_SHARE`` of each file re-sent by the next:
    its first records (the default, as ``bench/dedup.py``), or its last (``tail``).
    Which a deduplication drops as duplicates and which as late depends on the file's
    span of event time: the demo writes 1,000 events a second, so the first records
    of a file of more than 600,000 are over 10 minutes behind its end, late for both
    engines; the last ones are within 10 minutes at any size."""
    if not events.exists():
        resend(source, files, RESEND_SHARE, into=events, tail=tail)
    return files


def scaling_log(events: Path, state_keys: int, touched: int, epochs: int, seed: int = 11) -> tuple[str, ...]:
    """C: file 0 holds one active event for each of ``state_keys`` keys; each later file
    touches ``touched`` distinct keys drawn from them."""
    if events.exists():
        return tuple(sorted(p.name for p in events.glob("*.parquet")))
    storage = storage_for(events)
    rng = np.random.default_rng(seed)
    names, first_id = [], 0
    for i in range(epochs + 1):
        keys = np.arange(state_keys, dtype=np.int64) if i == 0 else np.sort(
            rng.choice(state_keys, touched, replace=False)).astype(np.int64)
        n = len(keys)
        ids = first_id + np.arange(n, dtype=np.int64)
        first_id += n
        table = pa.table([
            pa.array(ids), pa.array(keys), pa.array(np.round(rng.uniform(1, 500, n), 2)),
            pa.array(np.full(n, "active")),
            pa.array(START_US + i * 1_000_000 + np.arange(n, dtype=np.int64), pa.int64()).cast(
                pa.timestamp("us", tz="UTC")),
        ], schema=EVENT_SCHEMA)
        name = f"events-{i:06d}.parquet"
        write_events(storage, name, table)
        names.append(name)
    return tuple(names)


def _read(events: Path, files: tuple[str, ...], active_only: bool, first_occurrence: bool = False) -> pa.Table:
    """The log's records in log order; ``first_occurrence``: each event_id's first only
    (what a deduplication keeps when no first copy is late, as none is here: the
    generator's disorder is 30 s, far inside the 10 minutes)."""
    table = pa.concat_tables(pq.read_table(events / f, columns=["event_id", "merchant_id", "amount", "status",
                                                                "event_time"]) for f in files)
    if first_occurrence:
        _, first = np.unique(table.column("event_id").to_numpy(), return_index=True)
        table = table.take(np.sort(first))
    return table.filter(pc.equal(table.column("status"), "active")) if active_only else table


def reference_totals(events: Path, files: tuple[str, ...], first_occurrence: bool = False) -> pa.Table:
    """A, At, C (and Ad over each event_id's first record): (merchant_id, total, events)
    over every active event."""
    grouped = _read(events, files, active_only=True, first_occurrence=first_occurrence).group_by(
        "merchant_id").aggregate([("amount", "sum"), ("amount", "count")])
    return grouped.rename_columns(["merchant_id", "total", "events"]).sort_by("merchant_id")


def final_watermark(latest_us: int, millis: bool) -> int:
    """The watermark after the last file, µs: the latest event time - 30 s. ``millis``:
    Spark's, which keeps the latest event time in whole milliseconds (rounded down);
    it decides which sessions, whose ends fall anywhere, close by the end."""
    latest = latest_us // 1000 * 1000 if millis else latest_us
    return latest - WATERMARK_DELAY_US


def reference_windows(events: Path, files: tuple[str, ...], spec: WindowSpec, millis: bool = False) -> pa.Table:
    """B, Bsl, Bse: every window that ends at or before the final watermark
    (``final_watermark``), from all its records: (merchant_id, window_start µs,
    events, total, largest). The generator's disorder equals the watermark delay, so
    no record is late."""
    records = _read(events, files, active_only=False)
    t = records.column("event_time").cast(pa.int64()).to_numpy()
    merchants, amounts = records.column("merchant_id").to_numpy(), records.column("amount").to_numpy()
    if spec.kind == "session":
        starts, ends = _sessions(merchants, t, spec.size_s * 1_000_000)
    else:  # each record in every window [s, s + size) with s a multiple of the slide, s <= t < s + size
        size, slide = spec.size_s * 1_000_000, (spec.slide_s or spec.size_s) * 1_000_000
        per_record = size // slide
        rows = np.repeat(np.arange(len(t)), per_record)
        starts = (t - t % slide)[rows] - np.tile(np.arange(per_record, dtype=np.int64) * slide, len(t))
        ends, merchants, amounts = starts + size, merchants[rows], amounts[rows]
    table = pa.table({"merchant_id": merchants, "window_start": starts, "window_end": ends, "amount": amounts})
    grouped = table.group_by(["merchant_id", "window_start", "window_end"]).aggregate(
        [("amount", "count"), ("amount", "sum"), ("amount", "max")])
    grouped = grouped.filter(pc.less_equal(grouped.column("window_end"), final_watermark(int(t.max()), millis)))
    return grouped.drop_columns(["window_end"]).rename_columns(
        ["merchant_id", "window_start", "events", "total", "largest"]).sort_by(
        [("merchant_id", "ascending"), ("window_start", "ascending")])


def _sessions(merchants: np.ndarray, t: np.ndarray, gap_us: int) -> tuple[np.ndarray, np.ndarray]:
    """Each record's session ``[first, last + gap)`` among its merchant's records: in
    time order, a record more than ``gap`` after the one before it starts a new one
    (one exactly ``gap`` after touches the session and joins it, as in our engine;
    microsecond event times make such a tie rare enough not to test Spark on it)."""
    order = np.lexsort((t, merchants))
    m, ts = merchants[order], t[order]
    new = np.ones(len(ts), dtype=bool)
    new[1:] = (m[1:] != m[:-1]) | (ts[1:] > ts[:-1] + gap_us)
    session_of = np.cumsum(new) - 1
    heads = np.flatnonzero(new)
    first, last = ts[heads], np.maximum.reduceat(ts, heads)
    starts, ends = np.empty(len(t), dtype=np.int64), np.empty(len(t), dtype=np.int64)
    starts[order], ends[order] = first[session_of], last[session_of] + gap_us
    return starts, ends


def check_table(workload: str, got: pa.Table, expected: pa.Table) -> str:
    """``"ok"`` or what differs. ``got`` is an engine's Delta table."""
    if workload in WINDOWS:
        got = got.select(["merchant_id", "window_start", "events", "total", "largest"])
        got = got.set_column(1, "window_start", got.column("window_start").cast(pa.int64()))
        keys = ["merchant_id", "window_start"]
    elif workload == "C":  # an append changelog: a key's latest row has its highest count
        got = got.select(["merchant_id", "total", "events"])
        got = got.take(_latest_per_key(got.column("merchant_id").to_numpy(), got.column("events").to_numpy()))
        keys = ["merchant_id"]
    else:
        got, keys = got.select(["merchant_id", "total", "events"]), ["merchant_id"]
        if workload == "As":
            got = got.set_column(0, "merchant_id", pc.cast(pc.utf8_slice_codeunits(got.column(0), 2), pa.int64()))
    got = got.sort_by([(k, "ascending") for k in keys])
    if got.num_rows != expected.num_rows:
        return f"{got.num_rows:,} rows, expected {expected.num_rows:,}"
    for name in expected.column_names:
        a = got.column(name).to_numpy().astype(np.float64)
        b = expected.column(name).to_numpy().astype(np.float64)
        bad = ~np.isclose(a, b, rtol=1e-9, atol=1e-6)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return f"{int(bad.sum()):,} rows differ in {name!r}, e.g. row {i}: {a[i]} != {b[i]}"
    return "ok"


def _latest_per_key(keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row indices of each key's row with the highest count (counts only grow)."""
    order = np.lexsort((counts, keys))
    last = np.ones(len(keys), dtype=bool)
    last[:-1] = keys[order][1:] != keys[order][:-1]
    return order[last]
