"""A code location over temp directories, and a real DagsterInstance in a temp DAGSTER_HOME."""

from __future__ import annotations

import shutil
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import pytest
from dagster import DagsterInstance, Definitions

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.payments import payments_deployment
from volley_dagster.deploy import Deployment

ROOT = Path(__file__).resolve().parents[2]
Location = tuple[Definitions, DagsterInstance, Path]


def build_location(deployment: Deployment, base: Path, stack: ExitStack) -> Location:
    """(Definitions, instance, base dir) for one deployment over ``base``."""
    home = base / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    defs = build_definitions(
        [deployment],
        checkpoints=CheckpointResource(root=str(base / "state"), max_records_per_epoch=2_000),
        tables=TablesResource(warehouse=str(base / "tables")),
        spark=SparkResource(),
    )
    return defs, stack.enter_context(DagsterInstance.from_config(str(home))), base


def payments_cutting_at_3000(base: Path) -> Deployment:
    """The demo payments deployment, cutting at 3,000 waiting records."""
    return replace(payments_deployment(base / "events"), min_records=3_000, max_wait_s=None)


@pytest.fixture
def location_for(tmp_path, spark) -> Iterator[Callable[[Deployment], Location]]:
    """Builds (Definitions, instance, base dir) for one deployment over ``tmp_path``."""
    with ExitStack() as stack:
        yield lambda deployment: build_location(deployment, tmp_path, stack)


@pytest.fixture
def location(location_for, tmp_path) -> Location:
    return location_for(payments_cutting_at_3000(tmp_path))
