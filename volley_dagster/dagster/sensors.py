"""Cutting epochs: a sensor when data arrives, a schedule on a clock.

The epoch log is the source of truth. A tick first marks failed the pipeline's runs
shown as started whose process is gone (``volley_dagster/dagster/runs.fail_orphaned_runs``), so that
Dagster retries them; it cuts new epochs (the sensor when records wait, the schedule
on each tick), then requests one run of every epoch cut but not committed, from the
earliest, but only while no run of the pipeline is queued, running or about to be
retried: so a run never starts on an epoch whose predecessor is not committed. An
epoch whose run failed or was canceled is requested again by a later tick, after an
exponential backoff with jitter (``volley_dagster/recovery.py``: the deployment's
``backoff``), under a run key Dagster never saw (``run_key``: it names the newest
ended run); that goes on until it commits, which resets the budget. A run that
failed permanently (configuration, lineage, a corrupt snapshot) stops the requests:
the tick names the error and the ``epochs_progress`` check fails, saying what to do;
so does a blocking check's failure, recorded in the checkpoint root until the checks
pass again (``volley_dagster/dagster/blocking.py``).
The sensor and the schedule share this (``request_uncommitted``), so a schedule-only
deployment heals as a sensor one does. A tick also observes each source where data
landed since the last tick (records and files waiting, the oldest file's age, its data
version), and reports the ``freshness`` check when its verdict changes and
``epochs_progress`` when what it says changes (its verdict, the runs that failed or
were canceled, a stop). The cursor holds since when records have waited, what waited,
and the last verdicts, so a restarted daemon neither skips nor repeats an epoch; the
backoff is read from the instance's runs, not the cursor.
Each tick also keeps the instance's history bounded (``volley_dagster/dagster/runs.prune_history``):
partitions of old committed epochs and the runs that touched only those are removed,
and only the kept window of epochs is ever registered as partitions.
A source or checkpoint root that cannot be read (a missing folder, a hand-broken
``pipeline.json``) skips the tick naming it, instead of crashing the sensor.
What the Dagster instance lacks of the settings the guarantees rest on (a pool limit of
one, the queued run coordinator, run retries, run monitoring: ``runs.instance_problems``)
fails the ``instance_settings`` check, reported by the first tick that finds it and
whenever it changes, and is logged on every tick.
"""

import json
import time
from typing import Optional

from dagster import (
    AssetCheckEvaluation,
    AssetMaterialization,
    AssetObservation,
    DagsterInstance,
    DefaultScheduleStatus,
    DefaultSensorStatus,
    MetadataValue,
    RunRequest,
    ScheduleEvaluationContext,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    schedule,
    sensor,
)

from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.blocking import blocking_failure
from volley_dagster.dagster.cadence import freshness_bound_s
from volley_dagster.dagster.epochs import (
    PIPELINE_TAG,
    check_fields,
    check_progress,
    epochs_job_name,
    epochs_partitions,
    instance_outcome,
    make_runner,
    parse_epoch,
    partitions_name,
)
from volley_dagster.dagster.keys import PipelineKeys
from volley_dagster.dagster.metadata import (
    DagsterMetadata,
    epoch_metadata,
    source_backlogs,
    source_observation,
)
from volley_dagster.dagster.resources import CheckpointResource, TablesResource
from volley_dagster.dagster.runs import (
    fail_orphaned_runs,
    newest_ended_run,
    prune_history,
    recovery_decision,
    run_in_flight,
)
from volley_dagster.deploy import Deployment
from volley_dagster.errors import VolleyError
from volley_dagster.recovery import RecoveryDecision
from volley_dagster.sources.offsets import Backlog
from volley_dagster.verify import CheckOutcome, check_freshness

DATA_VERSION_TAG = "dagster/data_version"  # the tag an observation's data version travels in

MAX_CUTS_PER_TICK = 10


def range_request(deployment: Deployment, first: int, last: int, run_key: Optional[str] = None) -> RunRequest:
    """One run over epochs ``first..last`` (one partition range, run in order)."""
    tags, job = {PIPELINE_TAG: deployment.name}, epochs_job_name(deployment.name)
    if first == last:
        return RunRequest(partition_key=epoch_key(first), run_key=run_key, tags=tags, job_name=job)
    return RunRequest(run_key=run_key, job_name=job, tags={**tags, "dagster/asset_partition_range_start": epoch_key(first),
                                                           "dagster/asset_partition_range_end": epoch_key(last)})


def _should_cut(waiting: int, deployment: Deployment, waiting_since: Optional[float], now: float):
    """(cut now?, waiting_since to remember), with ``waiting`` records in the source."""
    if waiting == 0:
        return False, None
    if waiting >= deployment.min_records:
        return True, None
    since = waiting_since if waiting_since is not None else now
    return deployment.max_wait_s is not None and now - since >= deployment.max_wait_s, since


def check_evaluation(keys: PipelineKeys, outcome: CheckOutcome) -> AssetCheckEvaluation:
    """A state check's result reported by the sensor, between the runs that also report it."""
    return AssetCheckEvaluation(asset_key=keys.state, **check_fields(outcome))


def freshness_evaluations(keys: PipelineKeys, runner: EpochRunner, outcome: CheckOutcome) -> list[AssetCheckEvaluation]:
    """The freshness check of the state and of each table: a table is as fresh as the state."""
    pipeline = runner.pipeline
    tables = [AssetCheckEvaluation(asset_key=keys.sink(sink), **check_fields(outcome)) for sink in pipeline.sinks]
    return [check_evaluation(keys, outcome), *tables]


def source_changed(runner: EpochRunner, keys: PipelineKeys, part: Optional[str],
                   observed: DagsterMetadata) -> AssetObservation:
    """A source asset's observation (``part``: one of several sources, or None): what
    waits, what it holds, and its data version (which changes when data lands), as an
    observable source asset would report it."""
    now = runner.pipeline.source_log.parts()[part].snapshot()
    return AssetObservation(asset_key=keys.source_part(part), metadata={**now.metadata, **observed},
                            tags={DATA_VERSION_TAG: now.version})


def _heal_orphans(context, deployment: Deployment) -> CheckOutcome:
    """Says what the instance lacks (the pool admits more than one run, run retries or
    monitoring are off: ``runs.instance_problems``), and returns it as the
    ``instance_settings`` check's outcome; marks failed the runs shown as started whose
    process is gone."""
    outcome = instance_outcome(context.instance, deployment.name)
    if not outcome.passed:
        context.log.warning(f"{deployment.name}: {outcome.description}")
    for run_id in fail_orphaned_runs(context.instance, deployment.name):
        context.log.warning(f"run {run_id} showed as started but its process is gone: marked failed, to be retried")
    return outcome


def instance_event(keys: PipelineKeys, outcome: CheckOutcome, reported: Optional[str]):
    """(what the instance_settings check says now, its evaluation when that changed since
    ``reported``): reported when something is missing, then whenever what is missing
    changes, and once more when nothing is (an instance that always had everything
    reports nothing)."""
    said = None if outcome.passed else outcome.description
    return said, ([check_evaluation(keys, outcome)] if said != reported else [])


def _cannot_cut(context, deployment: Deployment, exc: VolleyError) -> SkipReason:
    """A source or checkpoint root that cannot be read: the tick names it and skips."""
    context.log.error(f"{deployment.name}: {type(exc).__name__}: {exc}")
    return SkipReason(f"cannot cut epochs of {deployment.name!r}: {type(exc).__name__}: {exc}")


def _prune(context, runner: EpochRunner, deployment: Deployment) -> None:
    partitions, runs = prune_history(context.instance, runner, deployment, partitions_name(deployment))
    if partitions or runs:
        context.log.info(f"{deployment.name}: removed {partitions} partition(s) of epochs older than the last "
                         f"{deployment.partitions_kept} committed, and {runs} run(s) of them (the epoch log and the "
                         "tables keep their history)")


def waiting_by_source(last_cut: int, backlog: Backlog) -> dict:
    """What waits in each source after the last cut epoch (records, files), for the cursor."""
    return {"cut": last_cut, "waiting": {part or "": [b.records, b.files] for part, b in source_backlogs(backlog).items()}}


def sources_landed(before: Optional[dict], now: dict) -> set[str]:
    """The sources where data landed (their data version changed) between the last tick,
    as it left them (``before``, after its cuts), and this one, before its cuts: what
    waits after the same cut epoch grew. Another cutter (the CLI, the schedule) moved
    the last cut: every source counts as landed, once. Read from the backlog the tick
    lists anyway, not from a listing of the whole log."""
    if before is None or before.get("cut") != now["cut"]:
        return set(now["waiting"])
    return {part for part, waiting in now["waiting"].items() if before["waiting"].get(part) != waiting}


def unregistered_partitions(instance, deployment: Deployment, committed: int, last_cut: int) -> list[str]:
    """Keys of the cut epochs to make dynamic partitions: the last ``partitions_kept``
    committed ones and every uncommitted one, less those registered already (older ones
    would only be pruned). An idle tick costs one lookup (the last cut is registered);
    otherwise the registered keys are read once, so a new instance over an old root
    costs what the kept window holds, not one query per epoch ever cut."""
    name = partitions_name(deployment)
    if last_cut == 0 or instance.has_dynamic_partition(name, epoch_key(last_cut)):
        return []
    registered = set(instance.get_dynamic_partitions(name))
    first = max(1, committed - deployment.partitions_kept + 1)
    return [key for key in map(epoch_key, range(first, last_cut + 1)) if key not in registered]


def committed_elsewhere(runner: EpochRunner, deployment: Deployment, new_keys: list[str]) -> list[AssetMaterialization]:
    """Epochs already committed when they become partitions (by the CLI, the API or
    ``./dev demo``): their materializations, from their manifests, so the UI shows them
    materialized. Only the last ``partitions_kept``: the older ones are pruned anyway."""
    committed = runner.committed_epoch()
    epochs = [e for e in map(parse_epoch, new_keys) if e <= committed][-deployment.partitions_kept:]
    events = []
    for epoch in epochs:
        result = runner.result(epoch)
        for asset_key, metadata in epoch_metadata(PipelineKeys.of(deployment), runner.pipeline, result).items():
            events.append(AssetMaterialization(asset_key=asset_key, partition=epoch_key(epoch), metadata={
                **metadata, "committed_outside_dagster": MetadataValue.bool(True)},
                description="committed before this instance knew the epoch (the CLI, the API or ./dev demo)"))
    return events


def register_epochs(instance: DagsterInstance, runner: EpochRunner, deployment: Deployment) -> list[str]:
    """Add the cut epochs that are not partitions yet (``unregistered_partitions``) to
    the instance now, for a cutter that cannot return partition requests (the schedule,
    the cut job); returns their keys."""
    new_keys = unregistered_partitions(instance, deployment, runner.committed_epoch(), runner.log.last_cut())
    if new_keys:
        instance.add_dynamic_partitions(partitions_name(deployment), new_keys)
    return new_keys


def run_key(deployment: Deployment, first: int, last: int, after: Optional[str]) -> str:
    """The run key of a request of epochs ``first..last`` made after the pool's run
    ``after`` ended (None: no run ended yet). Dagster's sensor daemon launches a key
    once, in whatever state its run ended, so a key must never come back: a request is
    made only while no run of the pool is in flight, so the newest ended run is the
    last request's own run (or a later one), and the key differs after a failure, a
    cancel, any number of them, or a run that committed part of the range. A tick
    repeated before its run was created (a daemon restart) repeats the key: deduped."""
    return f"{deployment.name}-{first}-{last}" + (f"-after-{after}" if after else "")


def request_uncommitted(instance, runner: EpochRunner, deployment: Deployment, now: float):
    """(run requests, skip reason, the recovery decision or None): one run over every
    epoch cut but not committed, unless a blocking check's failure is recorded, one is
    in flight, the last failure was permanent, or the backoff after a transient one (or
    a cancel) has not passed."""
    if (held := blocking_failure(runner.log.root)) is not None:
        return [], held.describe(runner.log.root), None
    first, last = runner.committed_epoch() + 1, runner.log.last_cut()
    if first > last:
        return [], "no epoch to run: every cut epoch is committed", None
    if (busy := run_in_flight(instance, deployment.name)) is not None:
        return [], f"epochs {first}..{last} wait: {busy}", None
    decision = recovery_decision(instance, runner, deployment, now)
    if not decision.request:
        return [], decision.reason, decision
    key = run_key(deployment, first, last, newest_ended_run(instance, deployment.name))
    return [range_request(deployment, first, last, run_key=key)], None, decision


def _progress_event(instance, runner: EpochRunner, deployment: Deployment, reported: Optional[str],
                    decision: Optional[RecoveryDecision]):
    """(what the epochs_progress check says now, its evaluation when that changed since
    ``reported``): its verdict, the runs that failed or were canceled, a stop, so the
    check's history tells what happened while an epoch waited (``decision``: the tick's
    recovery decision, when it made one)."""
    progress = check_progress(instance, runner, deployment, decision)
    md = progress.metadata
    said = f"{progress.passed}:{md.get('failed_runs', 0)}:{md.get('canceled_runs', 0)}:{md.get('stopped', False)}"
    return said, ([check_evaluation(PipelineKeys.of(deployment), progress)] if said != reported else [])


def epoch_sensor(deployment: Deployment, job, upstream: frozenset[Optional[str]] = frozenset()):
    """``upstream``: sources read from another pipeline's table, whose asset that
    pipeline's runs report: they are not observed here."""
    partitions = epochs_partitions(deployment)

    @sensor(
        name=f"{deployment.name}_new_data",
        jobs=[job],
        minimum_interval_seconds=deployment.sensor_interval_s,
        default_status=DefaultSensorStatus.RUNNING if deployment.sensor_running else DefaultSensorStatus.STOPPED,
        description=f"Cuts an epoch of {deployment.name!r} when {deployment.min_records}+ records wait"
        + (f" or records waited {deployment.max_wait_s:.0f}s" if deployment.max_wait_s else "")
        + "; runs uncommitted epochs in order, one run at a time, and requests a failed epoch again with backoff",
    )
    def new_data(context: SensorEvaluationContext, volley_checkpoints: CheckpointResource, volley_tables: TablesResource):
        cursor = {"waiting_since": None, "fresh": None, "progress": None, **(json.loads(context.cursor or "{}"))}
        keys = PipelineKeys.of(deployment)
        instance, instance_reported = instance_event(keys, _heal_orphans(context, deployment), cursor.get("instance"))
        try:
            runner = make_runner(deployment, volley_checkpoints, volley_tables)
            waiting_since, backlog = cursor["waiting_since"], runner.backlog()  # an idle tick lists the source once
            landed = sources_landed(cursor.get("landed"), waiting_by_source(runner.log.last_cut(), backlog))
            for _ in range(MAX_CUTS_PER_TICK):
                cut, waiting_since = _should_cut(backlog.records, deployment, waiting_since, time.time())
                if not cut:
                    break
                runner.cut_next()
                backlog = runner.backlog()  # for the next cut, the observation and the freshness check
            now = time.time()
        except VolleyError as exc:
            kept = json.dumps({**cursor, "instance": instance}) if instance_reported else context.cursor
            return SensorResult(skip_reason=_cannot_cut(context, deployment, exc), cursor=kept,
                                asset_events=instance_reported)
        events: list = [source_changed(runner, keys, part, source_observation(runner, waiting, now, part))
                        for part, waiting in source_backlogs(backlog).items()
                        if (part or "") in landed and part not in upstream]
        events += instance_reported
        new_keys = unregistered_partitions(context.instance, deployment, runner.committed_epoch(), runner.log.last_cut())
        add = [partitions.build_add_request(new_keys)] if new_keys else []
        events += committed_elsewhere(runner, deployment, new_keys)

        requests, skip, decision = request_uncommitted(context.instance, runner, deployment, now)
        if decision is not None and decision.failures and requests:
            context.log.info(decision.reason)
        _prune(context, runner, deployment)
        progress, reported = _progress_event(context.instance, runner, deployment, cursor["progress"], decision)
        events += reported
        freshness = check_freshness(runner, freshness_bound_s(deployment), now, backlog)
        if freshness.passed != cursor["fresh"]:
            events += freshness_evaluations(keys, runner, freshness)
        new_cursor = json.dumps({"waiting_since": waiting_since, "fresh": freshness.passed, "progress": progress,
                                 "landed": waiting_by_source(runner.log.last_cut(), backlog), "instance": instance})
        if not requests:  # the reason shows on the tick even when it registered partitions
            return SensorResult(skip_reason=SkipReason(skip), dynamic_partitions_requests=add, cursor=new_cursor,
                                asset_events=events)
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
        description=f"Cuts an epoch of {deployment.name!r} on a clock; runs uncommitted epochs in order, and "
                    "requests a failed epoch again with backoff, as the sensor does",
    )
    def clock(context: ScheduleEvaluationContext, volley_checkpoints: CheckpointResource, volley_tables: TablesResource):
        instance = context.instance
        _heal_orphans(context, deployment)
        try:
            runner = make_runner(deployment, volley_checkpoints, volley_tables)
            runner.cut_next()
        except VolleyError as exc:
            return _cannot_cut(context, deployment, exc)
        register_epochs(instance, runner, deployment)  # a schedule cannot return partition requests
        requests, skip, _ = request_uncommitted(instance, runner, deployment, time.time())
        _prune(context, runner, deployment)
        return requests or SkipReason(skip)

    return clock
