"""Cutting epochs: a sensor when data arrives, a schedule on a clock.

The epoch log is the source of truth: a tick first re-requests any epoch that
was cut but has no run (a daemon killed mid-tick), then cuts new ones. The
cursor remembers the last epoch requested and since when records have waited,
so a restarted daemon neither skips nor repeats an epoch.
"""

import json
import time
from typing import Optional

from dagster import (
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    schedule,
    sensor,
)

from assets.epochs import PIPELINE_TAG, epochs_partitions, make_runner
from resources import CheckpointResource, TablesResource
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.deploy import Deployment

MAX_CUTS_PER_TICK = 10


def _run_request(deployment: Deployment, epoch: int) -> RunRequest:
    key = epoch_key(epoch)
    return RunRequest(partition_key=key, run_key=f"{deployment.name}-{key}", tags={PIPELINE_TAG: deployment.name})


def _has_run(context, deployment: Deployment, epoch: int) -> bool:
    runs = context.instance.get_run_records(
        RunsFilter(tags={PIPELINE_TAG: deployment.name, "dagster/partition": epoch_key(epoch)}), limit=1
    )
    return bool(runs)


def _should_cut(runner: EpochRunner, deployment: Deployment, waiting_since: Optional[float], now: float):
    """(cut now?, waiting_since to remember)."""
    last = runner.log.last_cut()
    after = runner.log.offsets(last).end if last else {}
    waiting = runner.pipeline.source_log.available_records(after)
    if waiting == 0:
        return False, None
    if waiting >= deployment.min_records:
        return True, None
    since = waiting_since if waiting_since is not None else now
    return deployment.max_wait_s is not None and now - since >= deployment.max_wait_s, since


def epoch_sensor(deployment: Deployment, job):
    partitions = epochs_partitions(deployment)

    @sensor(
        name=f"{deployment.name}_new_data",
        job=job,
        minimum_interval_seconds=deployment.sensor_interval_s,
        default_status=DefaultSensorStatus.RUNNING if deployment.sensor_running else DefaultSensorStatus.STOPPED,
        description=f"Cuts an epoch of {deployment.name!r} when {deployment.min_records}+ records wait"
        + (f" or records waited {deployment.max_wait_s:.0f}s" if deployment.max_wait_s else ""),
    )
    def new_data(context: SensorEvaluationContext, checkpoints: CheckpointResource, tables: TablesResource):
        cursor = json.loads(context.cursor) if context.cursor else {"requested": 0, "waiting_since": None}
        runner = make_runner(deployment, checkpoints, tables)
        requests = [
            _run_request(deployment, e)
            for e in range(cursor["requested"] + 1, runner.log.last_cut() + 1)
            if not _has_run(context, deployment, e)
        ]
        waiting_since = cursor["waiting_since"]
        for _ in range(MAX_CUTS_PER_TICK):
            cut, waiting_since = _should_cut(runner, deployment, waiting_since, time.time())
            if not cut:
                break
            requests.append(_run_request(deployment, runner.cut_next().epoch))
        known = set(context.instance.get_dynamic_partitions(partitions.name))
        new_keys = [epoch_key(e) for e in runner.log.epochs_cut() if epoch_key(e) not in known]
        new_cursor = json.dumps({"requested": runner.log.last_cut(), "waiting_since": waiting_since})
        if not requests and not new_keys:
            return SensorResult(skip_reason=SkipReason("no epoch to cut yet"), cursor=new_cursor)
        return SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[partitions.build_add_request(new_keys)] if new_keys else [],
            cursor=new_cursor,
        )

    return new_data


def epoch_schedule(deployment: Deployment, job):
    partitions = epochs_partitions(deployment)

    @schedule(
        name=f"{deployment.name}_clock",
        cron_schedule=deployment.cron,
        job=job,
        default_status=DefaultScheduleStatus.RUNNING if deployment.schedule_running else DefaultScheduleStatus.STOPPED,
    )
    def clock(context: ScheduleEvaluationContext, checkpoints: CheckpointResource, tables: TablesResource):
        runner = make_runner(deployment, checkpoints, tables)
        rng = runner.cut_next()
        if rng is None:
            return SkipReason("no new records in the source")
        # A schedule cannot return partition requests: add the partition directly.
        context.instance.add_dynamic_partitions(partitions.name, [epoch_key(rng.epoch)])
        return _run_request(deployment, rng.epoch)

    return clock
