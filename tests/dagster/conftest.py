"""A code location over temp directories, and a real DagsterInstance in a temp DAGSTER_HOME."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from dagster import DagsterInstance

from assets.location import build_definitions
from resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.payments import payments_deployment

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def location(tmp_path, spark):
    """(Definitions, instance, base dir) for the demo deployment over ``tmp_path``."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    deployment = replace(payments_deployment(tmp_path / "events"), min_records=3_000, max_wait_s=None)
    defs = build_definitions(
        [deployment],
        checkpoints=CheckpointResource(root=str(tmp_path / "state"), max_records_per_epoch=2_000),
        tables=TablesResource(warehouse=str(tmp_path / "tables")),
        spark=SparkResource(),
    )
    with DagsterInstance.from_config(str(home)) as instance:
        yield defs, instance, tmp_path
