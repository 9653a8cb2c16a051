"""The demo code location over a test's directory (``VOLLEY_TEST_BASE``), with its
sensor stopped so that only the test launches runs."""

import os
from dataclasses import replace
from pathlib import Path

from assets.location import build_definitions
from resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.payments import payments_deployment

BASE = Path(os.environ["VOLLEY_TEST_BASE"])

defs = build_definitions(
    [replace(payments_deployment(BASE / "events"), sensor_running=False)],
    checkpoints=CheckpointResource(root=str(BASE / "state"), max_records_per_epoch=1_500),
    tables=TablesResource(warehouse=str(BASE / "tables")),
    spark=SparkResource(master="local[2]"),
)
