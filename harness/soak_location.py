"""The soak's code location (``harness/soak.py``): the demo's three pipelines (the
running aggregate, the 1-minute windows and the interval join) over a soak's folder
(``VOLLEY_SOAK_BASE``), as ``./dev dagster`` serves them: sensors running, runs on the
warm Spark, the shipped recovery. Snapshots are kept on S3 too, and the tables live on
S3 (``VOLLEY_SOAK_S3_ENDPOINT`` with ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
bucket ``VOLLEY_SOAK_BUCKET``), with the Iceberg catalog in a local SQLite file: an S3
outage makes both the snapshot store and the table storage unwritable."""

import os
from pathlib import Path

from dagster import in_process_executor

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, S3Resource, SparkResource, TablesResource
from volley_dagster.demo.payments import merchant_minutes_deployment, payments_deployment
from volley_dagster.demo.refunds import refunds_deployment

BASE = Path(os.environ["VOLLEY_SOAK_BASE"])
BUCKET = os.environ["VOLLEY_SOAK_BUCKET"]
S3 = S3Resource(endpoint_url=os.environ["VOLLEY_SOAK_S3_ENDPOINT"], access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"])

defs = build_definitions(
    [payments_deployment(BASE / "events"), merchant_minutes_deployment(BASE / "events"),
     refunds_deployment(BASE / "streams")],
    checkpoints=CheckpointResource(root=str(BASE / "state"), max_records_per_epoch=5_000,
                                   snapshot_store_uri=f"s3://{BUCKET}/snapshots", s3=S3),
    tables=TablesResource(warehouse=f"s3://{BUCKET}/tables", s3=S3, iceberg_catalog_properties={
        "type": "sql", "uri": f"sqlite:///{BASE / 'iceberg-catalog.db'}", "warehouse": f"s3://{BUCKET}/tables/iceberg"}),
    spark=SparkResource(),
    executor=in_process_executor,  # as definitions.py
)
