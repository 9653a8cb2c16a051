"""A dead letter's ``raw`` is its record's columns as exact JSON: a timestamp to the
microsecond, in UTC whatever the session's time zone, and a null as a null."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster import EpochRunner, FileLog, MemorySink, Pipeline, count


def test_a_dead_letters_raw_keeps_a_timestamps_microseconds(spark, tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    at = datetime(2026, 1, 1, 0, 0, 0, 123456, tzinfo=timezone.utc)
    pq.write_table(pa.table({"user": ["a", None, "b"], "amount": [1.0, 5.0, 2.0],
                             "ts": pa.array([at, at, at], pa.timestamp("us", tz="UTC"))}), log / "f-1.parquet")
    pipeline = (Pipeline("raw").source(FileLog(log)).key_by("user").aggregate(n=count())
                .sink(MemorySink()).on_bad_records("dead_letter").with_shards(1))
    zone = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        result = EpochRunner(pipeline, tmp_path / "state", spark=spark).run_next()
    finally:
        spark.conf.set("spark.sql.session.timeZone", zone)
    assert result is not None and result.dead_letters == 1
    (dead,) = pq.read_table(tmp_path / "state" / result.dead_letter_path).to_pylist()
    assert (dead["offset"], dead["reason"]) == (1, "null key: 'user' is null")
    assert json.loads(dead["raw"]) == {"user": None, "amount": 5.0, "ts": "2026-01-01T00:00:00.123456Z"}
