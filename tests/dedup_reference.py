"""Deduplication pipelines over a log written for them, and their reference: the rule
of ``volley_dagster.operators.dedup`` applied record by record in plain Python, in
log order, then a running aggregate of the kept records.

The log: file ``i`` covers the next 10 minutes of event time with fresh events, plus
events sent again (same ``event_id`` and event time, another amount, so the totals
tell which copy was kept):
- a copy later in the same file (a duplicate);
- a copy of one of the previous file's events (a duplicate: remembered for 15 minutes);
- two copies of an event three files back (late: its event time plus 15 minutes is
  at or before the watermark the epoch starts from, so both are dropped as late,
  never counted again however often an old batch is replayed);
- an old id reused with a new event time (kept, and remembered: its copy in the next
  file is a duplicate);
- from file 2 on, events of their own that arrive a file late, dated in the second
  half of file ``i - 2`` (not late for the deduplication: kept; a 10-minute window
  over them has closed).

``DedupReference.run`` decides an epoch against the watermark it starts from (the
latest event time so far): late first, then duplicates among the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from tests.helpers import with_tables
from tests.ttl_reference import fold
from volley_dagster import FileLog, ParquetSink, Pipeline, count, sum_
from volley_dagster.demo.events import EVENT_SCHEMA, START_US, write_events
from volley_dagster.sources.storage import storage_for

KEY, ID = "merchant_id", "event_id"
WITHIN_US = 15 * 60 * 1_000_000
FILE_SPAN_US = 600 * 1_000_000
ROWS, MERCHANTS = 400, 50  # every file the same size: one file an epoch
STRAGGLERS = 5  # events of their own a file late, from file 2 on


def _fresh(index: int) -> pd.DataFrame:
    copies = (20 + (20 if index >= 1 else 0) + (STRAGGLERS if index >= 2 else 0) + (25 if index >= 3 else 0)
              + (5 if index >= 4 else 0))
    n = ROWS - copies
    rng = np.random.default_rng([29, index])
    return pd.DataFrame({
        ID: index * 10_000 + np.arange(n, dtype=np.int64),
        KEY: rng.integers(0, MERCHANTS, n).astype(np.int64),
        "amount": np.round(rng.uniform(1, 100, n), 2),
        "status": "active",
        "t": START_US + index * FILE_SPAN_US + np.sort(rng.integers(0, FILE_SPAN_US, n)),
    })


def dedup_file(index: int) -> pa.Table:
    """Records of file ``index`` (epoch ``index + 1``)."""
    rng = np.random.default_rng([31, index])
    fresh = _fresh(index)
    parts = [fresh, fresh.sample(20, random_state=index)]  # copies later in this file
    if index >= 1:
        parts.append(_fresh(index - 1).tail(40).sample(20, random_state=index))  # within the bound
    if index >= 2:  # their own ids, dated 400-404 s into file index - 2: on time here, their window closed
        parts.append(pd.DataFrame({
            ID: index * 10_000 + 9_000 + np.arange(STRAGGLERS, dtype=np.int64),
            KEY: rng.integers(0, MERCHANTS, STRAGGLERS).astype(np.int64), "amount": 0.0, "status": "active",
            "t": START_US + (index - 2) * FILE_SPAN_US + 400_000_000 + np.arange(STRAGGLERS) * 1_000_000}))
    if index >= 3:
        past = _fresh(index - 3).head(10)  # 30+ minutes back: late, both copies dropped
        parts += [past, past]
        reused = _fresh(index - 3).iloc[100:105].copy()  # an old id with a new event time: kept ...
        reused["t"] = START_US + index * FILE_SPAN_US + FILE_SPAN_US // 2
        parts.append(reused)
    if index >= 4:
        again = _fresh(index - 4).iloc[100:105].copy()  # ... and its copy in the next file dropped
        again["t"] = START_US + (index - 1) * FILE_SPAN_US + FILE_SPAN_US // 2
        parts.append(again)
    df = pd.concat(parts[:1] + [p.assign(amount=np.round(rng.uniform(1, 100, len(p)), 2)) for p in parts[1:]],
                   ignore_index=True)
    return pa.table([pa.array(df[ID].to_numpy()), pa.array(df[KEY].to_numpy()), pa.array(df["amount"].to_numpy()),
                     pa.array(df["status"].tolist()),
                     pa.array(df["t"].to_numpy(), pa.int64()).cast(pa.timestamp("us", tz="UTC"))], schema=EVENT_SCHEMA)


def write_dedup_log(events: Path, files: int, first_file: int = 0) -> list[pa.Table]:
    storage = storage_for(events)
    tables = [dedup_file(i) for i in range(first_file, first_file + files)]
    for i, table in enumerate(tables, start=first_file):
        write_events(storage, f"events-{i:06d}.parquet", table)
    return tables


def dedup_pipeline(events: Path, output: Path | None, *, shards: int = 2, tables: Path | None = None,
                   name: str = "dedup", string_ids: bool = False, write_duplicates: bool = True,
                   on: tuple[str, ...] = (ID,), within: str = "15 minutes", skew: str | None = None) -> Pipeline:
    """Deduplicate on ``on`` (``event_id`` as ``e-<id>`` strings with ``string_ids``),
    then a running aggregate; ``output=None``: no Parquet sink."""
    pipeline = Pipeline(name).source(FileLog(events, format="parquet"))
    if string_ids:
        pipeline = pipeline.with_column(ID, f"concat('e-', {ID})")
    pipeline = (
        pipeline.deduplicate(on=list(on) if len(on) > 1 else on[0], within=within, event_time="event_time",
                             write_duplicates=write_duplicates, max_event_time_skew=skew)
        .key_by(KEY)
        .aggregate(events=count(), total=sum_("amount"))
        .with_shards(shards)
    )
    if output is not None:
        pipeline = pipeline.sink(ParquetSink(output))
    return with_tables(pipeline, tables, delta_mode="upsert", iceberg_table=f"volley.{name}", iceberg_mode="upsert")


def unique_pipeline(events: Path, output: Path, *, shards: int = 2, tables: Path | None = None,
                    name: str = "unique") -> Pipeline:
    """Only a deduplication: the sinks get the kept records (Delta upserts them by
    ``event_id``, Iceberg and Parquet append them)."""
    pipeline = (
        Pipeline(name).source(FileLog(events, format="parquet"))
        .deduplicate(on=ID, within="15 minutes", event_time="event_time", write_duplicates=True)
        .sink(ParquetSink(output))
        .with_shards(shards)
    )
    return with_tables(pipeline, tables, delta_mode="upsert", iceberg_table=f"volley.{name}", iceberg_mode="append")


@dataclass
class DedupReference:
    """Remembered keys (the ``on`` values) and their event time; the watermark is the
    latest event time so far; the kept records feed the running aggregate's reference
    (``tests.ttl_reference.fold``). ``run`` returns an epoch's aggregate rows, the row
    numbers it dropped and, of those, the ones dropped as late."""

    remembered: dict[object, int] = field(default_factory=dict)
    watermark: int | None = None
    totals: dict[object, dict[str, object]] = field(default_factory=dict)  # per merchant: its aggregates
    kept: list[pd.DataFrame] = field(default_factory=list)  # per epoch: the records kept, ``t`` their event time
    watermarks: list[int | None] = field(default_factory=list)  # per epoch: the watermark it started from
    remembered_total: int = 0  # kept ids remembered past their epoch, over all epochs
    on: tuple[str, ...] = (ID,)
    within_us: int = WITHIN_US
    dead_letters: list[list[int]] = field(default_factory=list)  # per epoch: the rows that were bad records

    def run(self, records: pa.Table, bound: int | None = None) -> tuple[pd.DataFrame, list[int], list[int]]:
        """One epoch: the aggregate's output rows (by key), the row numbers dropped
        (duplicates and late, in log order) and those of them dropped as late."""
        touched, dropped, late = self.run_rows(records, bound)
        return self._frame(set(touched)), dropped, late

    def run_rows(self, records: pa.Table, bound: int | None = None
                 ) -> tuple[dict[object, dict[str, object]], list[int], list[int]]:
        """``run``, the rows as ``TtlReference.run_rows`` gives them. A bad record (a null
        merchant, a null single ``on`` column, a null event time or one later than
        ``bound``) is neither kept nor dropped: ``dead_letters``."""
        df = records.to_pandas()
        times = records.column("event_time").cast(pa.int64()).to_pylist()
        keys = list(zip(*(records.column(c).to_pylist() for c in self.on), strict=True))
        kept_now: dict[object, int] = {}
        dropped, late, dead, kept_rows, touched, latest = [], [], [], [], set(), None
        for row, (on, key, amount, t) in enumerate(zip(keys, records.column(KEY).to_pylist(),
                                                       records.column("amount").to_pylist(), times, strict=True)):
            event = on[0] if len(on) == 1 else on
            if key is None or event is None or t is None or (bound is not None and t > bound):
                dead.append(row)
                continue
            latest = t if latest is None else max(latest, t)
            if self.watermark is not None and t + self.within_us <= self.watermark:  # late: set aside first
                dropped.append(row)
                late.append(row)
                continue
            if event in self.remembered or event in kept_now:
                dropped.append(row)
                continue
            kept_now[event] = int(t)
            kept_rows.append(row)
            self.totals[key] = fold(self.totals.get(key), amount)
            touched.add(key)
        self.kept.append(df.iloc[kept_rows].assign(t=[times[r] for r in kept_rows]))
        self.watermarks.append(self.watermark)
        self.dead_letters.append(dead)
        if latest is not None:  # the epoch's latest believable event time
            self.watermark = latest if self.watermark is None else max(self.watermark, latest)
        if self.watermark is None:
            return {}, dropped, late
        self.remembered_total += sum(1 for t in kept_now.values() if t + self.within_us > self.watermark)
        self.remembered.update(kept_now)
        self.remembered = {e: t for e, t in self.remembered.items() if t + self.within_us > self.watermark}
        return {k: dict(self.totals[k]) for k in touched}, dropped, late

    def current(self) -> pd.DataFrame:
        return self._frame(set(self.totals))

    def _frame(self, keys: set[Any]) -> pd.DataFrame:
        rows = [{KEY: k, "events": self.totals[k]["events"], "total": self.totals[k]["total"]} for k in sorted(keys)]
        return pd.DataFrame(rows, columns=[KEY, "events", "total"])
