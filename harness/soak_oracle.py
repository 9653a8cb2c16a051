"""The soak's oracle: what every table of the demo's three pipelines must hold, from the
landed files and the epochs' recorded ranges alone. It shares no code with the engine:
the sources are read with pyarrow, the tables with deltalake and pyiceberg, and each
operator's rule is applied record by record in plain Python (the join's through
``tests/join_reference.py``, which shares none either). The recorded ranges are an
input: the windows' late records and the join's pairs depend on where epochs were cut,
and each range was recorded before its first attempt, so any retry read the same."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from tests.join_reference import JoinReference, Row

MINUTE_US = 60_000_000
WINDOW_DELAY_US = 30_000_000  # merchant_minutes: max_out_of_orderness="30 seconds"
JOIN_UPPER_US = 30 * MINUTE_US  # refunds: between=("0 seconds", "+30 minutes")
JOIN_DELAY_US = MINUTE_US  # max_out_of_orderness="1 minute"
POS_SEGMENT_SHIFT = 40  # a row id's position: segment id << 40 | offset in the segment


@dataclass(frozen=True)
class RecordedSegment:
    """One segment of an epoch's recorded range, as ``offsets.json`` holds it."""

    id: int
    source: str  # "" for a pipeline of one source, else the source's name
    file: str
    start: int
    end: int


@dataclass
class Verdict:
    pipeline: str
    checks: list[str] = field(default_factory=list)  # what matched, with counts
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return a == b


def _same_rows(name: str, got: list[tuple], expected: list[tuple], verdict: Verdict) -> None:
    """Multisets of rows equal, floats within rounding (rows sorted by their exact fields)."""
    exact = lambda row: tuple(v for v in row if not isinstance(v, float))  # noqa: E731
    got_sorted, exp_sorted = sorted(got, key=lambda r: repr(exact(r))), sorted(expected, key=lambda r: repr(exact(r)))
    if len(got) != len(expected):
        verdict.problems.append(f"{name}: {len(got):,} rows, the oracle expects {len(expected):,}")
        return
    for g, e in zip(got_sorted, exp_sorted, strict=True):
        if len(g) != len(e) or not all(_close(a, b) for a, b in zip(g, e, strict=True)):
            verdict.problems.append(f"{name}: row {g} where the oracle expects {e}")
            return
    verdict.checks.append(f"{name}: {len(got):,} rows exact")


def _records(log: Path, segments: list[RecordedSegment]) -> pa.Table:
    """An epoch's records of one log, in recorded order, with each one's segment and offset."""
    parts = []
    for seg in segments:
        table = pq.read_table(log / seg.file).slice(seg.start, seg.end - seg.start)
        parts.append(table.append_column("_seg", pa.array([seg.id] * table.num_rows, pa.int64()))
                     .append_column("_offset", pa.array(range(table.num_rows), pa.int64())))
    return pa.concat_tables(parts) if parts else pa.table({})


def check_payments(events: Path, epochs: list[list[RecordedSegment]], balances: pa.Table,
                   changes: pa.Table) -> Verdict:
    """The running aggregate over active events: the upserted Delta table is each
    merchant's total, count, mean, largest and latest event time (log order); the
    Iceberg changelog holds, per epoch, each merchant the epoch touched as it then stood."""
    verdict = Verdict("payments")
    state: dict[int, dict[str, Any]] = {}
    changelog: list[tuple] = []
    for segments in epochs:
        touched = set()
        table = _records(events, segments)
        if table.num_rows:
            for row in table.filter(pc.equal(table.column("status"), "active")).to_pylist():
                s = state.setdefault(row["merchant_id"], {"total": 0.0, "events": 0, "largest": None, "last_seen": None})
                s["total"] += row["amount"]
                s["events"] += 1
                s["largest"] = row["amount"] if s["largest"] is None else max(s["largest"], row["amount"])
                s["last_seen"] = row["event_time"]
                touched.add(row["merchant_id"])
        changelog += [_payment_row(m, state[m]) for m in touched]
    columns = ["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]
    _same_rows("delta merchant_balances", _rows(balances, columns), [_payment_row(m, s) for m, s in state.items()],
               verdict)
    _same_rows("iceberg merchant_changes", _rows(changes, columns), changelog, verdict)
    return verdict


def _payment_row(merchant: int, s: dict[str, Any]) -> tuple:
    return (merchant, s["total"], s["events"], s["total"] / s["events"], s["largest"], s["last_seen"])


def _rows(table: pa.Table, columns: list[str]) -> list[tuple]:
    data = table.select(columns).to_pylist()
    return [tuple(row[c] for c in columns) for row in data]


def check_minutes(events: Path, epochs: list[list[RecordedSegment]], minutes: pa.Table) -> Verdict:
    """1-minute tumbling windows per merchant over active events; the watermark trails
    the latest event time by 30 s; a window fires once its end is at or before the
    watermark, and a record whose window had fired when its epoch began is late."""
    verdict = Verdict("merchant_minutes")
    open_: dict[tuple[int, int], list[Any]] = {}
    fired: list[tuple] = []
    watermark = None
    late = 0
    for segments in epochs:
        table = _records(events, segments)
        latest = None
        if table.num_rows:
            active = table.filter(pc.equal(table.column("status"), "active"))
            times = active.column("event_time").cast(pa.int64()).to_pylist()
            for row, t in zip(active.to_pylist(), times, strict=True):
                start = t - t % MINUTE_US
                latest = t if latest is None else max(latest, t)
                if watermark is not None and start + MINUTE_US <= watermark:
                    late += 1
                    continue
                acc = open_.setdefault((row["merchant_id"], start), [0, 0.0, None])
                acc[0] += 1
                acc[1] += row["amount"]
                acc[2] = row["amount"] if acc[2] is None else max(acc[2], row["amount"])
        if latest is not None:
            watermark = latest - WINDOW_DELAY_US if watermark is None else max(watermark, latest - WINDOW_DELAY_US)
        for key in [k for k in open_ if watermark is not None and k[1] + MINUTE_US <= watermark]:
            count, total, largest = open_.pop(key)
            fired.append((key[0], key[1], key[1] + MINUTE_US, count, total, largest))
    got = minutes.select(["merchant_id", "window_start", "window_end", "events", "total", "largest"])
    got = got.set_column(1, "window_start", got.column("window_start").cast(pa.int64()))
    got = got.set_column(2, "window_end", got.column("window_end").cast(pa.int64()))
    _same_rows("delta merchant_minutes", _rows(got, got.column_names), fired, verdict)
    verdict.checks.append(f"{late:,} late records, {len(open_):,} windows still open")
    return verdict


def check_refunds(streams: Path, epochs: list[tuple[int, list[RecordedSegment]]], joined: pa.Table,
                  changes: pa.Table) -> Verdict:
    """Payments left-joined with their refunds within 30 minutes (``tests/join_reference``):
    the Delta table upserted by payment and both row ids holds every pair and outer
    row once; the Iceberg changelog appends each once too."""
    verdict = Verdict("refunds")
    reference = JoinReference(0, JOIN_UPPER_US, "left", JOIN_DELAY_US)
    expected: list[tuple] = []
    for epoch, segments in epochs:
        rows: list[Row] = []
        for side, (source, time_column) in enumerate((("payments", "paid_at"), ("refunds", "refunded_at"))):
            table = _records(streams / source, [s for s in segments if s.source == source])
            if not table.num_rows:
                continue
            times = table.column(time_column).cast(pa.int64()).to_pylist()
            for record, t in zip(table.to_pylist(), times, strict=True):
                rid = f"{epoch}:{(record['_seg'] << POS_SEGMENT_SHIFT) + record['_offset']}"
                rows.append((side, record["payment_id"], t, rid))
        pairs, outer, _ = reference.run(rows)
        expected += sorted(pairs | outer, key=repr)
    ids = ["payment_id", "payments_row", "refunds_row"]
    _same_rows("delta payment_refunds", _rows(joined, ids), expected, verdict)
    _same_rows("iceberg refund_changes", _rows(changes, ids), expected, verdict)
    left, right = reference.held()
    verdict.checks.append(f"{left:,} payments and {right:,} refunds still waiting")
    return verdict


def delta_table(uri: str, storage_options: dict[str, str] | None) -> pa.Table:
    return DeltaTable(uri, storage_options=storage_options).to_pyarrow_table()


def iceberg_table(catalog_properties: dict[str, str], identifier: str) -> pa.Table:
    from pyiceberg.catalog import load_catalog

    return load_catalog("volley", **catalog_properties).load_table(identifier).scan().to_arrow()

