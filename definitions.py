"""The Dagster code location: the demo payments pipeline, epochs as partitions."""

from __future__ import annotations

import os
from pathlib import Path

from dagster import AssetSelection, Definitions, define_asset_job

from assets.epochs import epoch_state_asset
from resources import CheckpointResource, SparkResource
from sensors import epoch_cutting_sensor
from volley_dagster.demo.payments import payments_pipeline

DEMO = Path(os.environ.get("VOLLEY_DEMO_DIR", "demo")).absolute()


def demo_pipeline():
    return payments_pipeline(DEMO / "events", DEMO / "output")


state = epoch_state_asset(demo_pipeline)
epochs_job = define_asset_job("payments_epochs_job", selection=AssetSelection.assets(state))

defs = Definitions(
    assets=[state],
    jobs=[epochs_job],
    sensors=[epoch_cutting_sensor(demo_pipeline, epochs_job.name)],
    resources={
        "spark": SparkResource(),
        "checkpoints": CheckpointResource(root=str(DEMO / "state")),
    },
)
