"""Cutting epochs: a sensor when data arrives, a schedule on a clock.

The epoch log is the source of truth. A tick first marks failed the pipeline's runs
shown as started whose process is gone (``assets/runs.fail_orphaned_runs``), so that
Dagster retries them; it cuts new epochs when records wait, then
requests one run of every epoch cut but not committed, from the earliest, but only
while no run of the pipeline is queued, running or about to be retried: so a run
never starts on an epoch whose predecessor is not committed, and an epoch whose run
crashed or failed is requested again by the next tick (a new run key each time), up
to ``MAX_RECOVERY_REQUESTS`` times; then the tick says that recovery is exhausted and
reports the pipeline's ``epochs_progress`` check failed. Every tick also observes the
source (records and files waiting, the oldest file's age) and reports the ``freshness``
check when its verdict changes; runs report both after their epochs. The cursor holds
since when records have waited, how often the earliest uncommitted epoch was
requested and the last freshness verdict, so a restarted daemon neither skips nor
repeats an epoch.
"""

import json
import time
from typing import Optional

from dagster import (
    AssetCheckEvaluation,
    AssetObservation,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    schedule,
    sensor,
)

from assets.epochs import (
    PIPELINE_TAG,
    check_fields,
    check_progress,
    epochs_job_name,
    epochs_partitions,
    make_runner,
    partitions_name,
)
from assets.metadata import source_key, source_observation, state_key
from assets.runs import MAX_RECOVERY_REQUESTS, fail_orphaned_runs, pool_limits_ensured, run_in_flight
from resources import CheckpointResource, TablesResource
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.deploy import Deployment
from volley_dagster.verify import CheckOutcome, check_freshness

MAX_CUTS_PER_TICK = 10


def range_request(deployment: Deployment, first: int, last: int, run_key: Optional[str] = None) -> RunRequest:
    """One run over epochs ``first..last`` (one partition range, run in order)."""
    tags, job = {PIPELINE_TAG: deployment.name}, epochs_job_name(deployment.name)
    if first == last:
        return RunRequest(partition_key=epoch_key(first), run_key=run_key, tags=tags, job_name=job)
    return RunRequest(run_key=run_key, job_name=job, tags={**tags, "dagster/asset_partition_range_start": epoch_key(first),
                                                           "dagster/asset_partition_range_end": epoch_key(last)})


def _should_cut(runner: EpochRunner, deployment: Deployment, waiting_since: Optional[float], now: float):
    """(cut now?, waiting_since to remember)."""
    waiting = runner.records_waiting()
    if waiting == 0:
        return False, None
    if waiting >= deployment.min_records:
        return True, None
    since = waiting_since if waiting_since is not None else now
    return deployment.max_wait_s is not None and now - since >= deployment.max_wait_s, since


def check_evaluation(runner: EpochRunner, outcome: CheckOutcome) -> AssetCheckEvaluation:
    """A state check's result reported by the sensor, between the runs that also report it."""
    return AssetCheckEvaluation(asset_key=state_key(runner.pipeline), **check_fields(outcome))


def epoch_sensor(deployment: Deployment, job):
    partitions = epochs_partitions(deployment)

    @sensor(
        name=f"{deployment.name}_new_data",
        jobs=[job],
        minimum_interval_seconds=deployment.sensor_interval_s,
        default_status=DefaultSensorStatus.RUNNING if deployment.sensor_running else DefaultSensorStatus.STOPPED,
        description=f"Cuts an epoch of {deployment.name!r} when {deployment.min_records}+ records wait"
        + (f" or records waited {deployment.max_wait_s:.0f}s" if deployment.max_wait_s else "")
        + "; runs uncommitted epochs in order, one run at a time, and requests a failed epoch again",
    )
    def new_data(context: SensorEvaluationContext, checkpoints: CheckpointResource, tables: TablesResource):
        cursor = {"waiting_since": None, "recovering": 0, "requests": 0, "fresh": None,
                  **(json.loads(context.cursor or "{}"))}
        pool_limits_ensured(context.instance, [deployment.name])
        for run_id in fail_orphaned_runs(context.instance, deployment.name):
            context.log.warning(f"run {run_id} showed as started but its process is gone: marked failed, to be retried")
        runner = make_runner(deployment, checkpoints, tables)
        waiting_since = cursor["waiting_since"]
        for _ in range(MAX_CUTS_PER_TICK):
            cut, waiting_since = _should_cut(runner, deployment, waiting_since, time.time())
            if not cut:
                break
            runner.cut_next()
        now, backlog = time.time(), runner.backlog()  # listed once for the observation and the freshness check
        events: list = [AssetObservation(asset_key=source_key(runner.pipeline),
                                         metadata=source_observation(runner, backlog, now))]
        known = set(context.instance.get_dynamic_partitions(partitions_name(deployment)))
        new_keys = [epoch_key(e) for e in runner.log.epochs_cut() if epoch_key(e) not in known]
        add = [partitions.build_add_request(new_keys)] if new_keys else []

        first, last = runner.committed_epoch() + 1, runner.log.last_cut()
        requests, skip = [], None
        recovering, count = first, cursor["requests"] if cursor["recovering"] == first else 0
        if first > last:
            skip = "no epoch to run: every cut epoch is committed"
        elif (busy := run_in_flight(context.instance, deployment.name)) is not None:
            skip = f"epochs {first}..{last} wait: {busy}"
        elif count > MAX_RECOVERY_REQUESTS:
            skip = (f"recovery exhausted: epoch {first} failed in {count} runs; fix the cause named in the last "
                    f"failed run, then launch a backfill of epochs {first}..{last}")
            if count == MAX_RECOVERY_REQUESTS + 1:  # once: the epochs_progress check says so too
                events.append(check_evaluation(runner, check_progress(context.instance, runner)))
                count += 1
        else:
            count += 1
            requests.append(range_request(deployment, first, last, run_key=f"{deployment.name}-{first}-{last}-{count}"))
            if count > 1:
                context.log.info(f"epoch {first} is not committed after a failed run: requesting it again ({count - 1}"
                                 f" of {MAX_RECOVERY_REQUESTS})")
        freshness = check_freshness(runner, deployment.freshness_bound_s, now, backlog)
        if freshness.passed != cursor["fresh"]:
            events.append(check_evaluation(runner, freshness))
        new_cursor = json.dumps({"waiting_since": waiting_since, "recovering": recovering, "requests": count,
                                 "fresh": freshness.passed})
        if not requests and not add:
            return SensorResult(skip_reason=SkipReason(skip), cursor=new_cursor, asset_events=events)
        return SensorResult(run_requests=requests, dynamic_partitions_requests=add, cursor=new_cursor,
                            asset_events=events)

    return new_data


def epoch_schedule(deployment: Deployment, job):
    if deployment.cron is None:
        raise ValueError(f"deployment {deployment.name!r} has no cron, so no schedule")

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
        context.instance.add_dynamic_partitions(partitions_name(deployment), [epoch_key(rng.epoch)])
        return range_request(deployment, rng.epoch, rng.epoch, run_key=f"{deployment.name}-{epoch_key(rng.epoch)}")

    return clock
