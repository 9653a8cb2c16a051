"""State-TTL pipelines over a log written for them, and their reference: the rule of
``volley_dagster.operators.ttl`` applied epoch by epoch in plain Python, key by key,
straight from the records.

The log: file ``i`` holds records of a band of merchants that moves on by ``STEP``
keys a file (so keys go idle and expire), plus three keys with a story: ``REFRESHED``
comes back just before it would expire, ``RETURNING`` just after (it starts from
empty), ``STEADY`` is in every file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from tests.helpers import with_tables
from volley_dagster import FileLog, ParquetSink, Pipeline, count, sum_
from volley_dagster.demo.events import EVENT_SCHEMA, START_US, write_events
from volley_dagster.sources.storage import storage_for

KEY = "merchant_id"
BAND, STEP, PER_FILE = 40, 15, 400
REFRESHED, RETURNING, STEADY = 10_001, 10_002, 10_003
FILE_SPAN_US = 600 * 1_000_000  # each file covers the next 10 minutes of event time


def ttl_file(index: int, ttl_epochs: int = 2) -> pa.Table:
    """Records of file ``index`` (epoch ``index + 1``)."""
    rng = np.random.default_rng([11, index])
    band = index * STEP + rng.integers(0, BAND, PER_FILE - 9)
    filler = index * STEP  # a band key in place of a story key's records: every file has PER_FILE
    refreshed = REFRESHED if index in (0, ttl_epochs) else filler  # again in the epoch that would expire it
    returning = RETURNING if index in (0, ttl_epochs + 1) else filler  # back one epoch after it expired
    merchants = np.concatenate([band, np.repeat([STEADY, refreshed, returning], 3)]).astype(np.int64)
    n = len(merchants)
    times = START_US + index * FILE_SPAN_US + np.sort(rng.integers(0, FILE_SPAN_US, n))
    return pa.table([pa.array(index * 10_000 + np.arange(n, dtype=np.int64)), pa.array(merchants),
                     pa.array(np.round(rng.uniform(1, 100, n), 2)), pa.array(["active"] * n),
                     pa.array(times, pa.int64()).cast(pa.timestamp("us", tz="UTC"))], schema=EVENT_SCHEMA)


def write_ttl_log(events: Path, files: int, first_file: int = 0) -> list[pa.Table]:
    storage = storage_for(events)
    tables = [ttl_file(i) for i in range(first_file, first_file + files)]
    for i, table in enumerate(tables, start=first_file):
        write_events(storage, f"events-{i:06d}.parquet", table)
    return tables


def ttl_pipeline(events: Path, output: Path, *, ttl_epochs: int | None = 2, ttl: str | None = None,
                 shards: int = 2, tables: Path | None = None, name: str = "ttl", max_expiry_entries: int | None = 100_000,
                 string_keys: bool = False, iceberg_mode: str = "upsert") -> Pipeline:
    """Epochs TTL (``ttl_epochs``), or with ``ttl`` one on event time; with ``tables``, a
    Delta upsert table and an Iceberg table (``iceberg_mode``) besides the append-only Parquet changelog."""
    pipeline = Pipeline(name).source(FileLog(events, format="parquet"))
    if string_keys:
        pipeline = pipeline.with_column(KEY, f"concat('m-', {KEY})")
    pipeline = (
        pipeline.key_by(KEY)
        .aggregate(events=count(), total=sum_("amount"), ttl_epochs=None if ttl else ttl_epochs, ttl=ttl,
                   event_time="event_time" if ttl else None, max_expiry_entries=max_expiry_entries)
        .sink(ParquetSink(output))
        .with_shards(shards)
    )
    return with_tables(pipeline, tables, delta_mode="upsert", iceberg_table=f"volley.{name}", iceberg_mode=iceberg_mode)


@dataclass
class TtlReference:
    """``ttl_epochs`` or ``ttl_us`` (event time, watermark = latest event time so far)."""

    ttl_epochs: int | None = None
    ttl_us: int | None = None
    state: dict[object, dict[str, object]] = field(default_factory=dict)
    watermark: int | None = None
    epoch: int = 0

    def run(self, records: pa.Table | None) -> pd.DataFrame:
        """One epoch (``None``: an epoch without records); its output rows, by key."""
        self.epoch += 1
        rows: dict[object, dict[str, object]] = {}
        if records is not None and records.num_rows:
            df = records.to_pandas()
            df["t"] = records.column("event_time").cast(pa.int64()).to_numpy()
            for key, group in df.groupby(KEY):
                old = self.state.get(key)
                latest = int(group["t"].max())
                touched = self.epoch if self.ttl_epochs else (max(int(old["touched"]), latest) if old else latest)
                new = {"events": (old["events"] if old else 0) + len(group),
                       "total": (old["total"] if old else 0.0) + float(group["amount"].sum()), "touched": touched}
                self.state[key] = new
                rows[key] = {**new, "expired": False}
            if self.ttl_us is not None:
                self.watermark = max(self.watermark or -(2**62), int(df["t"].max()))
        limit = self.epoch if self.ttl_epochs else self.watermark
        if limit is not None:
            amount = self.ttl_epochs or self.ttl_us
            for key in [k for k, s in self.state.items() if int(s["touched"]) + amount <= limit]:
                rows[key] = {**self.state.pop(key), "expired": True}
        return _frame(rows)

    def current(self) -> pd.DataFrame:
        return _frame({k: {**v, "expired": False} for k, v in self.state.items()}).drop(columns=["expired"])


def _frame(rows: dict[object, dict[str, object]]) -> pd.DataFrame:
    df = pd.DataFrame([{KEY: k, **{c: v[c] for c in ("events", "total", "expired")}} for k, v in rows.items()],
                      columns=[KEY, "events", "total", "expired"])
    return df.sort_values(KEY).reset_index(drop=True)


def same_rows(actual: pd.DataFrame, expected: pd.DataFrame, columns: list[str]) -> None:
    got = actual[columns].sort_values(KEY).reset_index(drop=True)
    want = expected[columns].sort_values(KEY).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, check_exact=False, rtol=1e-9)
