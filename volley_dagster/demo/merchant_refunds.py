"""A pipeline fed by another: refunds per merchant per hour, read from the refunds
pipeline's Iceberg changelog (``demo/refunds.py``: each payment joined with its
refunds, each epoch's rows appended). Its source is that table: an epoch reads the
snapshots the refunds pipeline appended since the last, so under Dagster the refunds'
table asset is this pipeline's upstream, and its sensor cuts when the refunds commit."""

from __future__ import annotations

from pathlib import Path

from volley_dagster import IcebergTableSource, Pipeline, count, max_, sum_, tumbling
from volley_dagster.demo.payments import demo_deployment
from volley_dagster.demo.refunds import refunds_join
from volley_dagster.deploy import Deployment, TableSettings
from volley_dagster.sinks import DeltaSink

REFUND_CHANGES = "payments.refund_changes"  # the refunds pipeline's Iceberg sink


def merchant_refunds_pipeline(tables: TableSettings, shards: int = 2) -> Pipeline:
    """Per merchant and hour of refund time: how many refunds, their total and the
    largest, appended to Delta once the watermark closes the hour. A payment never
    refunded (the join's outer row, null refund) is no refund."""
    return (
        Pipeline("merchant_refunds")
        .source(IcebergTableSource(REFUND_CHANGES, catalog=tables.iceberg_catalog))
        .where("refund_amount IS NOT NULL")
        .key_by("merchant_id")
        .window(tumbling("1 hour"), on="refunded_at", max_out_of_orderness="1 minute")
        .aggregate(refunds=count(), refunded=sum_("refund_amount"), largest=max_("refund_amount"))
        .sink(DeltaSink(f"{tables.warehouse}/delta/merchant_refund_hours", name="refund_hours", mode="append",
                        storage_options=tables.delta_storage_options, on_foreign_lineage=tables.on_foreign_lineage))
        .with_shards(shards)
    )


def hourly_refunds_pipeline(root: str | Path, tables: TableSettings, shards: int = 2) -> Pipeline:
    """The same hours in one pipeline of two stateful operators: the refunds join, then
    the hourly window over its pairs (``chain.py``). Each has its own state; the window
    keeps time by the watermark the join hands on, so a pair the join emits is never
    late to it, and an hour fires an epoch after the one whose records close it."""
    return (
        refunds_join(root, name="hourly_refunds")
        .with_shards(shards)
        .where("refund_amount IS NOT NULL")
        .key_by("merchant_id")
        .window(tumbling("1 hour"), on="refunded_at")
        .aggregate(refunds=count(), refunded=sum_("refund_amount"), largest=max_("refund_amount"))
        .sink(DeltaSink(f"{tables.warehouse}/delta/hourly_refunds", name="hourly_refunds", mode="append",
                        storage_options=tables.delta_storage_options, on_foreign_lineage=tables.on_foreign_lineage))
        .with_shards(shards)
    )


def merchant_refunds_deployment() -> Deployment:
    return demo_deployment("merchant_refunds", merchant_refunds_pipeline)
