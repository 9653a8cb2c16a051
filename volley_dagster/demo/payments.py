"""The demo pipelines over the payment events: the running total per merchant, over
active events, kept as a Delta table (upsert: one row per merchant) and an Iceberg
changelog (append: each epoch's changed merchants); and per merchant and minute of
event time, a tumbling window appended to Delta once the watermark closes it."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from volley_dagster import FileLog, Pipeline, Source, count, last, max_, mean, sum_, tumbling
from volley_dagster.deploy import Deployment, TableSettings
from volley_dagster.sinks import DeltaSink, IcebergSink, sqlite_catalog
from volley_dagster.sinks.lineage import ForeignLineage


def local_tables(warehouse: str | Path, on_foreign_lineage: ForeignLineage = "fail") -> TableSettings:
    """Tables on the local disk, with the embedded SQLite Iceberg catalog."""
    return TableSettings(str(warehouse), iceberg_catalog=sqlite_catalog(Path(warehouse) / "iceberg"),
                         on_foreign_lineage=on_foreign_lineage)


def payments_pipeline(events: str | Path | Source, tables: TableSettings, shards: int = 4) -> Pipeline:
    """``events``: the folder of the Parquet event log, or another source of the same
    events (a ``KafkaSource``)."""
    return (
        Pipeline("payments")
        .source(events if isinstance(events, Source) else FileLog(events, format="parquet"))
        .where("status = 'active'")
        .key_by("merchant_id")
        .aggregate(
            total=sum_("amount"),
            events=count(),
            avg_amount=mean("amount"),
            largest=max_("amount"),
            last_seen=last("event_time"),
        )
        .sink(DeltaSink(f"{tables.warehouse}/delta/merchant_balances", name="balances", mode="upsert",
                        storage_options=tables.delta_storage_options, on_foreign_lineage=tables.on_foreign_lineage))
        .sink(IcebergSink("payments.merchant_changes", catalog=tables.iceberg_catalog, name="changes", mode="append",
                          on_foreign_lineage=tables.on_foreign_lineage))
        .with_shards(shards)
    )


def payments_deployment(events: str | Path | Source) -> Deployment:
    return demo_deployment("payments", lambda tables: payments_pipeline(events, tables))


def demo_deployment(name: str, build: Callable[[TableSettings], Pipeline]) -> Deployment:
    """Under Dagster: the sensor runs from the start, on every loop of the Dagster
    daemon (every 5 s; an interval of exactly 5 s would alias to every other loop, 10 s),
    and cuts an epoch as soon as any event waits, for fresh tables; a
    backlog is one run over every waiting epoch. The 5-minute schedule is off."""
    return Deployment(name=name, build=build, min_records=1, max_wait_s=None, cron="*/5 * * * *",
                      sensor_running=True, sensor_interval_s=1)


def merchant_minutes_pipeline(events: str | Path, tables: TableSettings, shards: int = 4) -> Pipeline:
    return (
        Pipeline("merchant_minutes")
        .source(FileLog(events, format="parquet"))
        .where("status = 'active'")
        .key_by("merchant_id")
        .window(tumbling("1 minute"), on="event_time", max_out_of_orderness="30 seconds")
        .aggregate(events=count(), total=sum_("amount"), largest=max_("amount"))
        .sink(DeltaSink(f"{tables.warehouse}/delta/merchant_minutes", name="minutes", mode="append",
                        storage_options=tables.delta_storage_options, on_foreign_lineage=tables.on_foreign_lineage))
        .with_shards(shards)
    )


def merchant_minutes_deployment(events: str | Path) -> Deployment:
    return demo_deployment("merchant_minutes", lambda tables: merchant_minutes_pipeline(events, tables))
