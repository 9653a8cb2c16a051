"""The demo's resources, from the environment (secrets only through ``EnvVar``):
``VOLLEY_CHECKPOINTS``, ``VOLLEY_SNAPSHOT_STORE``, ``VOLLEY_WAREHOUSE``,
``VOLLEY_ICEBERG_CATALOG_URI``, ``VOLLEY_S3_ENDPOINT`` with ``AWS_ACCESS_KEY_ID`` and
``AWS_SECRET_ACCESS_KEY``, ``VOLLEY_SPARK_MASTER``, ``VOLLEY_SPARK_REMOTE``,
``VOLLEY_SPARK_WARM``."""

import os
from typing import Optional

from dagster import EnvVar

from assets import DEMO
from volley_dagster.dagster import CheckpointResource, S3Resource, SparkResource, TablesResource


def _s3() -> Optional[S3Resource]:
    if not os.environ.get("VOLLEY_S3_ENDPOINT"):
        return None
    return S3Resource(
        endpoint_url=EnvVar("VOLLEY_S3_ENDPOINT"),
        access_key_id=EnvVar("AWS_ACCESS_KEY_ID"),
        secret_access_key=EnvVar("AWS_SECRET_ACCESS_KEY"),
    )


def demo_checkpoints() -> CheckpointResource:
    return CheckpointResource(
        root=os.environ.get("VOLLEY_CHECKPOINTS", str(DEMO / "state")),
        snapshot_store_uri=os.environ.get("VOLLEY_SNAPSHOT_STORE") or None,  # s3://bucket/prefix
        s3=_s3(),
    )


def demo_tables() -> TablesResource:
    return TablesResource(
        warehouse=os.environ.get("VOLLEY_WAREHOUSE", str(DEMO / "tables")),
        # may hold a PostgreSQL password: Dagster keeps the variable's name, never its value
        iceberg_catalog_uri=EnvVar("VOLLEY_ICEBERG_CATALOG_URI") if os.environ.get("VOLLEY_ICEBERG_CATALOG_URI") else None,
        s3=_s3(),
    )


def demo_spark() -> SparkResource:
    """Neither a master nor a remote set: the warm Spark (a supervised local Spark Connect
    server), unless ``VOLLEY_SPARK_WARM=0``."""
    return SparkResource(master=os.environ.get("VOLLEY_SPARK_MASTER"), remote=os.environ.get("VOLLEY_SPARK_REMOTE"),
                         warm=os.environ.get("VOLLEY_SPARK_WARM", "1") != "0")
