"""The demo location for bench/dagster_latency.py: the sensor running every 5 s and
cutting as soon as one record waits, over ``VOLLEY_BENCH_BASE``."""

import os
from dataclasses import replace
from pathlib import Path

from assets.location import build_definitions
from resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.payments import payments_deployment

BASE = Path(os.environ["VOLLEY_BENCH_BASE"])

defs = build_definitions(
    [replace(payments_deployment(BASE / "events"), sensor_running=True, min_records=1, max_wait_s=None,
             sensor_interval_s=5)],
    checkpoints=CheckpointResource(root=str(BASE / "state")),
    tables=TablesResource(warehouse=str(BASE / "tables")),
    spark=SparkResource(master="local[2]", remote=os.environ.get("VOLLEY_SPARK_REMOTE") or None),
)
