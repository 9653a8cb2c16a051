"""The demo location for bench/dagster_latency.py, over ``VOLLEY_BENCH_BASE``: the demo
deployments as ``./dev dagster`` ships them (``VOLLEY_BENCH_PIPELINES``: which ones,
default payments), on the warm Spark unless ``VOLLEY_BENCH_SPARK=local`` (a local
Spark per run, the old default)."""

import os
from pathlib import Path

from dagster import in_process_executor

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.payments import merchant_minutes_deployment, payments_deployment

BASE = Path(os.environ["VOLLEY_BENCH_BASE"])
DEPLOYMENTS = {"payments": payments_deployment, "merchant_minutes": merchant_minutes_deployment}
chosen = os.environ.get("VOLLEY_BENCH_PIPELINES", "payments").split(",")

defs = build_definitions(
    [DEPLOYMENTS[name](BASE / "events") for name in chosen],
    checkpoints=CheckpointResource(root=str(BASE / "state")),
    tables=TablesResource(warehouse=str(BASE / "tables")),
    spark=SparkResource(warm=os.environ.get("VOLLEY_BENCH_SPARK", "warm") == "warm"),
    executor=in_process_executor,  # as definitions.py
)
