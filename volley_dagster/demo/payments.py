"""The demo pipeline: the running payments total per merchant, over active events."""

from __future__ import annotations

from pathlib import Path

from volley_dagster import FileLog, ParquetSink, Pipeline, count, last, max_, mean, sum_


def payments_pipeline(events: str | Path, output: str | Path, shards: int = 4) -> Pipeline:
    return (
        Pipeline("payments")
        .source(FileLog(events, format="parquet"))
        .where("status = 'active'")
        .key_by("merchant_id")
        .aggregate(
            total=sum_("amount"),
            events=count(),
            avg_amount=mean("amount"),
            largest=max_("amount"),
            last_seen=last("event_time"),
        )
        .sink(ParquetSink(output))
        .with_shards(shards)
    )
