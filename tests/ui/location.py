"""The demo code location over a test's directory (``VOLLEY_TEST_BASE``). Its sensor
is stopped, so that only the test launches runs, unless ``VOLLEY_TEST_SENSOR`` is
set: then it runs as in production, ticking every few seconds and cutting an epoch
as soon as any record waits. Runs use a local Spark each, unless ``VOLLEY_TEST_WARM``
is set: then the warm Spark, as ``./dev dagster`` does by default."""

import os
from dataclasses import replace
from pathlib import Path

from assets.location import build_definitions
from resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.payments import payments_deployment

BASE = Path(os.environ["VOLLEY_TEST_BASE"])
SENSOR = bool(os.environ.get("VOLLEY_TEST_SENSOR"))
WARM = bool(os.environ.get("VOLLEY_TEST_WARM"))

deployment = replace(payments_deployment(BASE / "events"), sensor_running=SENSOR)
if SENSOR:
    deployment = replace(deployment, min_records=1, max_wait_s=None, sensor_interval_s=2)

defs = build_definitions(
    [deployment],
    checkpoints=CheckpointResource(root=str(BASE / "state"), max_records_per_epoch=1_500),
    tables=TablesResource(warehouse=str(BASE / "tables")),
    spark=SparkResource() if WARM else SparkResource(master="local[2]"),
)
