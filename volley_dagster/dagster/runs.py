"""A pipeline's runs in Dagster: its concurrency pool, and what the runs in it say
about progress. Shared by the sensor and schedule (when to request) and the asset checks."""

import time
from datetime import datetime, timezone
from typing import Optional

from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, DefaultRunLauncher, RunRecord, RunsFilter

from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.launcher.workers import worker_gone
from volley_dagster.deploy import Deployment
from volley_dagster.recovery import FailedRun, RecoveryDecision, decide

PIPELINE_TAG = "volley/pipeline"  # the run tag of a pipeline's jobs
FAILURE_KIND = "volley/failure"  # metadata of a step that failed permanently: "permanent"
FAILED_RUNS_READ = 100  # consecutive failures counted for the backoff: past this the wait is at its cap anyway
IN_PROGRESS = [DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED, DagsterRunStatus.STARTING,
               DagsterRunStatus.STARTED, DagsterRunStatus.CANCELING]
RETRY_GRACE_S = 60  # a failed run whose automatic retry has not been created yet counts as in flight


def pipeline_pool(name: str) -> str:
    """The Dagster concurrency pool of a pipeline's runs: every run that runs epochs or
    rescales it, whoever launched it, is in it; dagster.yaml limits each pool to one."""
    return f"volley_{name}"


def pool_runs(instance: DagsterInstance, pipeline: str, statuses: list[DagsterRunStatus],
              limit: Optional[int] = None, created_after: Optional[float] = None,
              created_before: Optional[float] = None, oldest_first: bool = False) -> list[RunRecord]:
    """Runs of the pipeline, newest first (or ``oldest_first``), whoever launched them:
    Dagster tags each run it creates in a pool with it; runs of the pipeline's jobs
    (sensor, schedule, rescale, in-process ones too) carry the pipeline's run tag."""
    after, before = (datetime.fromtimestamp(t, timezone.utc) if t is not None else None
                     for t in (created_after, created_before))
    found: dict[str, RunRecord] = {}
    for tags in ({f".dagster/pool/{pipeline_pool(pipeline)}": "true"}, {PIPELINE_TAG: pipeline}):
        runs = RunsFilter(tags=tags, statuses=statuses, created_after=after, created_before=before)
        for record in instance.get_run_records(runs, limit=limit, ascending=oldest_first):
            found[record.dagster_run.run_id] = record
    ordered = sorted(found.values(), key=lambda r: r.create_timestamp, reverse=not oldest_first)
    return ordered[:limit] if limit is not None else ordered


def run_in_flight(instance: DagsterInstance, pipeline: str) -> Optional[str]:
    """Why not to request a run now (one is queued, running or about to be retried), or None."""
    active = pool_runs(instance, pipeline, IN_PROGRESS, limit=1)
    if active:
        return f"run {active[0].dagster_run.run_id[:8]} is {active[0].dagster_run.status.value.lower()}"
    failed = pool_runs(instance, pipeline, [DagsterRunStatus.FAILURE], limit=1)
    if failed and failed[0].dagster_run.tags.get("dagster/will_retry") == "true":
        run_id = failed[0].dagster_run.run_id
        retried = instance.get_run_records(RunsFilter(tags={"dagster/parent_run_id": run_id}), limit=1)
        ended = failed[0].end_time or failed[0].update_timestamp.timestamp()
        if not retried and time.time() - ended < RETRY_GRACE_S:
            return f"run {run_id[:8]} failed and Dagster is about to retry it"
    return None


def failed_runs_since(instance: DagsterInstance, pipeline: str, since: Optional[float], first_epoch: int) -> list[FailedRun]:
    """The pipeline's failed epoch runs created after ``since`` (its last commit) that
    covered ``first_epoch`` (the earliest uncommitted one), newest first: a run of a
    later epoch launched by hand, refused for its order, or a failed rescale says
    nothing about it. The newest says whether it failed permanently (its step's
    ``Failure`` metadata, set by the epochs op from ``errors.is_retryable``); a run
    killed, or failed before its step ran, is transient. Reads a bounded number of runs
    and one run's failure events: O(1) in the pipeline's age."""
    records = pool_runs(instance, pipeline, [DagsterRunStatus.FAILURE], limit=FAILED_RUNS_READ, created_after=since)
    runs = [FailedRun(r.dagster_run.run_id, (r.end_time or r.update_timestamp.timestamp())) for r in records
            if (start := _first_epoch_of(r)) is not None and start <= first_epoch]
    if runs:
        runs[0] = FailedRun(runs[0].run_id, runs[0].ended_at, permanent_failure(instance, runs[0].run_id))
    return runs


def _first_epoch_of(record: RunRecord) -> Optional[int]:
    """The first epoch an epochs run covers (its partition, or its range's start)."""
    tags = record.dagster_run.tags
    key = tags.get("dagster/partition") or tags.get("dagster/asset_partition_range_start")
    return int(key) if key is not None and key.isdigit() else None


def permanent_failure(instance: DagsterInstance, run_id: str) -> Optional[str]:
    """The named error of a run whose step failed permanently, else None."""
    for entry in instance.all_logs(run_id, of_type=DagsterEventType.STEP_FAILURE):
        event = entry.dagster_event
        data = event.step_failure_data if event is not None else None
        failure = data.user_failure_data if data is not None else None
        if failure is not None and getattr(failure.metadata.get(FAILURE_KIND), "value", None) == "permanent":
            return failure.description or "a permanent error"
    return None


def recovery_decision(instance: DagsterInstance, runner: EpochRunner, deployment: Deployment,
                      now: Optional[float] = None) -> RecoveryDecision:
    """Whether to request the uncommitted epochs now (``volley_dagster/recovery.py``),
    from the runs that failed since the last commit."""
    committed = runner.committed_epoch()
    since = runner.result(committed).committed_at if committed else None
    after = datetime.fromisoformat(since).timestamp() if since else None
    return decide(failed_runs_since(instance, deployment.name, after, committed + 1), time.time() if now is None else now,
                  deployment.backoff, committed + 1, runner.log.last_cut(), salt=deployment.name)


PRUNED_PER_TICK = 200  # partitions, and runs, removed by one tick at most: a first tick on an old instance stays short


def prune_history(instance: DagsterInstance, runner: EpochRunner, deployment: Deployment,
                  partitions_name: str) -> tuple[int, int]:
    """Remove the dynamic partitions of committed epochs older than the last
    ``deployment.partitions_kept``, and the pipeline's ended runs created before the
    newest removed epoch committed (their materializations belong to removed partitions);
    at most ``PRUNED_PER_TICK`` of each per call. (partitions removed, runs removed)."""
    committed = runner.committed_epoch()
    oldest_kept = committed - deployment.partitions_kept + 1
    if oldest_kept <= 1 or not instance.has_dynamic_partition(partitions_name, epoch_key(oldest_kept - 1)):
        return 0, 0  # the newest epoch to remove is gone already: so are the older ones (one lookup per idle tick)
    keys = instance.get_dynamic_partitions(partitions_name)  # bounded by the retention itself
    doomed = [k for k in keys if k.isdigit() and int(k) < oldest_kept][:PRUNED_PER_TICK]
    for key in doomed:
        instance.delete_dynamic_partition(partitions_name, key)
    kept_since = datetime.fromisoformat(runner.result(oldest_kept - 1).committed_at)  # later runs touched kept epochs
    ended = [DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]
    doomed_runs = [r.dagster_run.run_id for r in pool_runs(instance, deployment.name, ended, limit=PRUNED_PER_TICK,
                                                           created_before=kept_since.timestamp(), oldest_first=True)]
    for run_id in doomed_runs:
        instance.delete_run(run_id)
    return len(doomed), len(doomed_runs)


def pool_limit_problem(instance: DagsterInstance, pipeline: str) -> Optional[str]:
    """What is wrong with the pipeline's pool limit, read only (None: one run at a time).
    The limit is the instance's to set, as Dagster documents it: ``dagster instance
    concurrency set volley_<pipeline> 1`` (``./dev dagster`` does, for the demo), or a
    ``concurrency.pools.default_limit`` of 1. Without it, the engine's lease still keeps
    two runs from both writing, but the second one waits for the lease, or fails."""
    pool = pipeline_pool(pipeline)
    storage = instance.event_log_storage
    if pool in storage.get_concurrency_keys():
        limit: Optional[int] = storage.get_concurrency_info(pool).slot_count
    else:
        limit = instance.global_op_concurrency_default_limit
    if limit == 1:
        return None
    return (f"pool {pool} admits {'any number of' if limit is None else limit} runs at a time: set it to one with "
            f"`dagster instance concurrency set {pool} 1` (the pipeline's lease keeps a second run from writing "
            "meanwhile, as it waits)")


def fail_orphaned_runs(instance: DagsterInstance, pipeline: str) -> list[str]:
    """Mark failed the pipeline's runs that show as started but whose process is gone, so
    that run retries re-run them and the pool admits the next run. The launcher does this
    for a run worker killed while it lives; when the whole of ``dagster dev`` was killed,
    or the machine rebooted, nothing else does. Only for the default run launcher (and
    the warm one built on it), whose runs are processes on this machine."""
    if not isinstance(instance.run_launcher, DefaultRunLauncher):
        return []
    failed = []
    for record in pool_runs(instance, pipeline, [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]):
        why = worker_gone(instance, record)  # None too before it said its pid: run monitoring's start timeout
        if why is None:
            continue
        instance.report_run_failed(record.dagster_run, f"{why}: marked failed so that it is retried")
        failed.append(record.dagster_run.run_id)
    return failed
