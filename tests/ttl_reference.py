"""State-TTL pipelines over a log written for them, and their reference: the rule of
``volley_dagster.operators.ttl`` applied epoch by epoch in plain Python, record by
record in log order, straight from the records. Without a TTL it is the plain
running aggregate (``tests/properties`` checks it over random streams and cuts).

The log: file ``i`` holds records of a band of merchants that moves on by ``STEP``
keys a file (so keys go idle and expire), plus three keys with a story: ``REFRESHED``
comes back just before it would expire, ``RETURNING`` just after (it starts from
empty), ``STEADY`` is in every file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from tests.helpers import same_value, spark_max, spark_min, spark_sum, with_tables
from volley_dagster import FileLog, ParquetSink, Pipeline, count, first, last, max_, min_, sum_
from volley_dagster.demo.events import EVENT_SCHEMA, START_US, write_events
from volley_dagster.operators.accumulators import Accumulator
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


def ttl_pipeline(events: Path, output: Path | None, *, ttl_epochs: int | None = 2, ttl: str | None = None,
                 shards: int = 2, tables: Path | None = None, name: str = "ttl", max_expiry_entries: int | None = 100_000,
                 string_keys: bool = False, iceberg_mode: str = "upsert", every_value: bool = False,
                 delay: str = "0 seconds", skew: str | None = None) -> Pipeline:
    """Epochs TTL (``ttl_epochs``), or with ``ttl`` one on event time (``delay``: its
    ``max_out_of_orderness``, ``skew``: its ``max_event_time_skew``); both None: no TTL.
    With ``tables``, a Delta upsert table and an Iceberg table (``iceberg_mode``) besides
    the append-only Parquet changelog; ``output=None``: no Parquet changelog.
    ``every_value``: also ``VALUES[2:]`` (min, max, first and last of ``amount``)."""
    pipeline = Pipeline(name).source(FileLog(events, format="parquet"))
    if string_keys:
        pipeline = pipeline.with_column(KEY, f"concat('m-', {KEY})")
    accumulators = value_accumulators("amount") if every_value else {"events": count(), "total": sum_("amount")}
    pipeline = (
        pipeline.key_by(KEY)
        .aggregate(**accumulators, ttl_epochs=None if ttl else ttl_epochs, ttl=ttl,
                   event_time="event_time" if ttl else None, max_expiry_entries=max_expiry_entries,
                   max_out_of_orderness=delay, max_event_time_skew=skew)
        .with_shards(shards)
    )
    if output is not None:
        pipeline = pipeline.sink(ParquetSink(output))
    return with_tables(pipeline, tables, delta_mode="upsert", iceberg_table=f"volley.{name}", iceberg_mode=iceberg_mode)


VALUES = ["events", "total", "low", "high", "first_amount", "last_amount"]  # what the reference computes per key


def value_accumulators(column: str) -> dict[str, Accumulator]:
    """The aggregates ``VALUES`` over ``column``, which ``fold`` folds one value at a time."""
    return {"events": count(), "total": sum_(column), "low": min_(column), "high": max_(column),
            "first_amount": first(column), "last_amount": last(column)}


def fold(values: dict[str, Any] | None, amount: float | None) -> dict[str, Any]:
    """A key's aggregates after one more record (``None``: a key without state), as
    Spark folds them: count() counts the record, the others skip a null ``amount``."""
    old = values or {"events": 0, "total": None, "low": None, "high": None, "first_amount": None, "last_amount": None}
    return {"events": old["events"] + 1, "total": spark_sum(old["total"], amount),
            "low": spark_min(old["low"], amount), "high": spark_max(old["high"], amount),
            "first_amount": old["first_amount"] if old["first_amount"] is not None else amount,
            "last_amount": amount if amount is not None else old["last_amount"]}


@dataclass
class TtlReference:
    """``ttl_epochs``, or ``ttl_us`` on event time (the watermark: the latest event time
    so far less ``delay_us``); neither: no TTL, the plain running aggregate."""

    ttl_epochs: int | None = None
    ttl_us: int | None = None
    delay_us: int = 0
    state: dict[object, dict[str, Any]] = field(default_factory=dict)
    watermark: int | None = None
    epoch: int = 0
    dead_letters: list[list[int]] = field(default_factory=list)  # per epoch: the rows that were bad records

    def run(self, records: pa.Table | None, bound: int | None = None) -> pd.DataFrame:
        """One epoch (``None``: an epoch without records); its output rows, by key.
        ``bound``: on event time, the latest event time believed (``max_event_time_skew``)."""
        return _frame(self.run_rows(records, bound))

    def run_rows(self, records: pa.Table | None, bound: int | None = None) -> dict[object, dict[str, object]]:
        """``run``'s rows by key, values as Python objects (a null is None, NaN is NaN).
        A record with a null key is a bad record; on event time also one with a null
        event time, or one later than ``bound``."""
        self.epoch += 1
        on_time = self.ttl_us is not None
        touched: set[object] = set()
        dead: list[int] = []
        latest = None
        if records is not None and records.num_rows:
            times = records.column("event_time").cast(pa.int64()).to_pylist()
            for row, (key, amount, t) in enumerate(zip(records.column(KEY).to_pylist(),
                                                       records.column("amount").to_pylist(), times, strict=True)):
                if key is None or (on_time and (t is None or (bound is not None and t > bound))):
                    dead.append(row)
                    continue
                old = self.state.get(key)
                stamp = self.epoch if not on_time else t if old is None else max(old["touched"], t)
                self.state[key] = {**fold(old, amount), "touched": stamp}
                touched.add(key)
                if on_time:
                    latest = t if latest is None else max(latest, t)
        self.dead_letters.append(dead)
        if on_time and latest is not None:
            candidate = latest - self.delay_us
            self.watermark = candidate if self.watermark is None else max(self.watermark, candidate)
        rows = {key: {**self.state[key], "expired": False} for key in touched}
        limit = self.epoch if self.ttl_epochs else self.watermark if on_time else None
        if limit is not None:
            amount = self.ttl_epochs or self.ttl_us
            for key in [k for k, s in self.state.items() if s["touched"] + amount <= limit]:
                rows[key] = {**self.state.pop(key), "expired": True}
        return rows

    def current(self) -> pd.DataFrame:
        return _frame({k: {**v, "expired": False} for k, v in self.state.items()}).drop(columns=["expired"])


def _frame(rows: dict[object, dict[str, object]]) -> pd.DataFrame:
    df = pd.DataFrame([{KEY: k, **{c: v[c] for c in VALUES + ["expired"]}} for k, v in rows.items()],
                      columns=[KEY] + VALUES + ["expired"])
    return df.sort_values(KEY).reset_index(drop=True)


def same_values(actual: pa.Table, expected: dict[object, dict[str, object]], columns: list[str]) -> None:
    """The engine's rows (``actual``, one per key) hold the reference's values (``run_rows``):
    the same keys, and per key the same ``columns``, a null only where the reference has
    one and NaN only where it has NaN (which ``same_rows``, through pandas, cannot tell)."""
    got = {row[KEY]: row for row in actual.to_pylist()}
    assert sorted(got, key=repr) == sorted(expected, key=repr), (
        f"keys: the engine has {sorted(got, key=repr)}, the reference {sorted(expected, key=repr)}")
    for key, row in got.items():
        for column in columns:
            assert same_value(row[column], expected[key][column]), (
                f"key {key!r}, {column}: the engine has {row[column]!r}, the reference {expected[key][column]!r}")


def same_rows(actual: pd.DataFrame, expected: pd.DataFrame, columns: list[str]) -> None:
    got = actual[columns].sort_values(KEY).reset_index(drop=True)
    want = expected[columns].sort_values(KEY).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False, check_exact=False, rtol=1e-9)
