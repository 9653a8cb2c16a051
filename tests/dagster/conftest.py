"""A code location over temp directories, and a real DagsterInstance in a temp DAGSTER_HOME."""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest
from dagster import DagsterInstance, Definitions

from assets.location import build_definitions
from resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.deploy import Deployment
from volley_dagster.demo.payments import payments_deployment

ROOT = Path(__file__).resolve().parents[2]
Location = tuple[Definitions, DagsterInstance, Path]


@pytest.fixture
def location_for(tmp_path, spark) -> Callable[[Deployment], Location]:
    """Builds (Definitions, instance, base dir) for one deployment over ``tmp_path``."""
    with ExitStack() as stack:

        def build(deployment: Deployment) -> Location:
            home = tmp_path / "dagster_home"
            home.mkdir()
            shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
            defs = build_definitions(
                [deployment],
                checkpoints=CheckpointResource(root=str(tmp_path / "state"), max_records_per_epoch=2_000),
                tables=TablesResource(warehouse=str(tmp_path / "tables")),
                spark=SparkResource(),
            )
            return defs, stack.enter_context(DagsterInstance.from_config(str(home))), tmp_path

        yield build


@pytest.fixture
def location(location_for, tmp_path) -> Location:
    """The demo payments deployment, cutting at 3,000 waiting records."""
    return location_for(replace(payments_deployment(tmp_path / "events"), min_records=3_000, max_wait_s=None))
