"""A sensor as Dagster's sensor daemon runs it, without the daemon's loop and without
Spark: the demo payments deployment in an in-process code location, each tick
evaluated through the code location (the run requests' tags resolved there), its
asset events and partition requests applied to the instance, and each run request
submitted through the daemon's own ``fetch_existing_runs`` and
``_get_or_create_sensor_run``: a run key already used is skipped exactly as the daemon
skips it. The runs it creates stay NOT_STARTED (nothing launches them); a test ends
them as it needs (``instance.report_run_canceled``, ``report_run_failed``).
``tick_sensor`` evaluates any sensor of a ``Definitions`` directly, and applies what
the daemon applies."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

import pytest
from dagster import DagsterInstance, DagsterRun, Definitions, RunRequest, build_sensor_context
from dagster._core.definitions.selector import JobSubsetSelector
from dagster._core.definitions.sensor_definition import SensorExecutionData
from dagster._core.test_utils import in_process_test_workspace
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
from dagster._core.utils import make_new_run_id
from dagster._daemon.sensor import _get_or_create_sensor_run, fetch_existing_runs

from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.payments import payments_deployment
from volley_dagster.deploy import Deployment
from volley_dagster.recovery import Backoff

BASE_ENV = "VOLLEY_TEST_DAEMON_BASE"  # the folder daemon_location.py builds its definitions over
SENSOR = "payments_new_data"
INSTANT = Backoff(first_s=0.001, max_s=0.001, alert_after=3, retries_in_run=0)  # a failed epoch is due again at once


def deployment(base: Path) -> Deployment:
    """The demo payments deployment over ``base``: cuts as soon as a record waits."""
    return replace(payments_deployment(base / "events"), min_records=1, max_wait_s=None, backoff=INSTANT)


def definitions(base: Path) -> Definitions:
    return build_definitions([deployment(base)], checkpoints=CheckpointResource(root=str(base / "state")),
                             tables=TablesResource(warehouse=str(base / "tables")), spark=SparkResource())


class SensorDaemon:
    """The payments sensor of an in-process code location, ticked and submitted as the daemon does."""

    def __init__(self, instance: DagsterInstance, workspace) -> None:
        self.instance = instance
        self.location = workspace.get_code_location(workspace.code_location_names[0])
        self.repository = next(iter(self.location.get_repositories().values()))
        self.sensor = self.repository.get_sensor(SENSOR)
        self.cursor: Optional[str] = None

    def tick(self) -> SensorExecutionData:
        data = self.location.get_sensor_execution_data(self.instance, self.repository.handle, SENSOR, None, None,
                                                       self.cursor, None, None)
        for event in data.asset_events:
            self.instance.report_runless_asset_event(event)
        for request in data.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
        self.cursor = data.cursor
        return data

    def submit(self, request: RunRequest) -> Optional[DagsterRun]:
        """The run the daemon creates for ``request``; None when it skips it (its run key was used)."""
        target = self.sensor.get_target(request.job_name)
        assert target is not None
        job = self.location.get_job(JobSubsetSelector(
            location_name=self.location.name, repository_name=self.repository.name, job_name=target.job_name,
            op_selection=target.op_selection))
        existing = fetch_existing_runs(self.instance, self.sensor, [request])
        run = _get_or_create_sensor_run(logging.getLogger("sensor daemon"), self.instance, self.location, self.sensor,
                                        job, make_new_run_id(), request, target, existing)
        return run if isinstance(run, DagsterRun) else None


def tick_sensor(defs: Definitions, instance: DagsterInstance, name: str, cursor: Optional[str] = None):
    """One evaluation of sensor ``name`` invoked directly, its asset events stored and
    its partitions added, as the daemon does after a tick."""
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources, definitions=defs) as ctx:
        result = defs.resolve_sensor_def(name)(ctx)
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


@contextmanager
def sensor_daemon(instance: DagsterInstance, base: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SensorDaemon]:
    monkeypatch.setenv(BASE_ENV, str(base))
    origin = LoadableTargetOrigin(python_file=str(Path(__file__).with_name("daemon_location.py")), attribute="defs")
    with in_process_test_workspace(instance, origin) as workspace:
        yield SensorDaemon(instance, workspace)
