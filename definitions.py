"""The Dagster code location: ``dagster dev -w workspace.yaml`` (or ``./dev dagster``).

Declares the demo pipelines (running payments totals, and per-minute windows):
their source, epoch state and Delta and Iceberg tables, partitioned by epoch,
with running sensors that cut an epoch whenever the demo generator
(``volley generate``) appends events.
Settings come from the environment; secrets only through ``EnvVar``.
"""

import os
from pathlib import Path
from typing import Optional

from dagster import EnvVar, in_process_executor

from assets.location import build_definitions
from resources import CheckpointResource, S3Resource, SparkResource, TablesResource
from volley_dagster.demo.payments import merchant_minutes_deployment, payments_deployment

DEMO = Path(os.environ.get("VOLLEY_DEMO_DIR", "demo")).absolute()


def _s3() -> Optional[S3Resource]:
    if not os.environ.get("VOLLEY_S3_ENDPOINT"):
        return None
    return S3Resource(
        endpoint_url=EnvVar("VOLLEY_S3_ENDPOINT"),
        access_key_id=EnvVar("AWS_ACCESS_KEY_ID"),
        secret_access_key=EnvVar("AWS_SECRET_ACCESS_KEY"),
    )


defs = build_definitions(
    [payments_deployment(DEMO / "events"), merchant_minutes_deployment(DEMO / "events")],
    checkpoints=CheckpointResource(
        root=os.environ.get("VOLLEY_CHECKPOINTS", str(DEMO / "state")),
        snapshot_store_uri=os.environ.get("VOLLEY_SNAPSHOT_STORE") or None,  # s3://bucket/prefix
        s3=_s3(),
    ),
    tables=TablesResource(
        warehouse=os.environ.get("VOLLEY_WAREHOUSE", str(DEMO / "tables")),
        # may hold a PostgreSQL password: Dagster keeps the variable's name, never its value
        iceberg_catalog_uri=EnvVar("VOLLEY_ICEBERG_CATALOG_URI") if os.environ.get("VOLLEY_ICEBERG_CATALOG_URI") else None,
        s3=_s3(),
    ),
    # neither set: the warm Spark (a supervised local Spark Connect server), unless VOLLEY_SPARK_WARM=0
    spark=SparkResource(master=os.environ.get("VOLLEY_SPARK_MASTER"), remote=os.environ.get("VOLLEY_SPARK_REMOTE"),
                        warm=os.environ.get("VOLLEY_SPARK_WARM", "1") != "0"),
    executor=in_process_executor,  # this location's own default too: one step per run, Spark in the run's process
)
