"""The code location bench/history.py measures, in process and under ``dagster dev`` (for
the UI's GraphQL query): the demo payments deployment over ``VOLLEY_BENCH_BASE``, local
tables, with its sensor stopped (the bench ticks it by hand, so no daemon tick races it)."""

import os
from dataclasses import replace
from pathlib import Path

from dagster import in_process_executor

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.payments import payments_deployment
from volley_dagster.deploy import Deployment


def deployment(base: Path) -> Deployment:
    return replace(payments_deployment(base / "events"), sensor_running=False)


def resources(base: Path) -> tuple[CheckpointResource, TablesResource]:
    return CheckpointResource(root=str(base / "state")), TablesResource(warehouse=str(base / "tables"))


def definitions(base: Path):
    checkpoints, tables = resources(base)
    return build_definitions([deployment(base)], checkpoints=checkpoints, tables=tables,
                             spark=SparkResource(warm=False),  # in process: the bench's own local Spark
                             executor=in_process_executor)


if "VOLLEY_BENCH_BASE" in os.environ:
    defs = definitions(Path(os.environ["VOLLEY_BENCH_BASE"]))
