"""A pipeline's runs in Dagster: its concurrency pool, and what the runs in it say
about progress. Shared by the sensor and schedule (when to request) and the asset checks."""

import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Optional

from dagster import (
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    DefaultRunLauncher,
    QueuedRunCoordinator,
    RunRecord,
    RunsFilter,
)

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
# A canceled run (from the UI, or by a ``dagster/max_runtime`` limit) did not commit its
# epochs either: it counts as a failed one, and its epochs are requested again.
UNFINISHED = [DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED]
ENDED = [DagsterRunStatus.SUCCESS, *UNFINISHED]
RETRY_GRACE_S = 60  # a failed run whose automatic retry has not been created yet counts as in flight


def pipeline_pool(name: str) -> str:
    """The Dagster concurrency pool of a pipeline's runs: every run that runs epochs or
    rescales it, whoever launched it, is in it; dagster.yaml limits each pool to one."""
    return f"volley_{name}"


def pool_runs(instance: DagsterInstance, pipeline: str, statuses: list[DagsterRunStatus],
              limit: Optional[int] = None, created_after: Optional[float] = None,
              created_before: Optional[float] = None, oldest_first: bool = False,
              updated_after: Optional[float] = None) -> list[RunRecord]:
    """Runs of the pipeline, newest first (or ``oldest_first``), whoever launched them:
    Dagster tags each run it creates in a pool with it; runs of the pipeline's jobs
    (sensor, schedule, rescale, in-process ones too) carry the pipeline's run tag."""
    after, before, updated = (datetime.fromtimestamp(t, timezone.utc) if t is not None else None
                              for t in (created_after, created_before, updated_after))
    found: dict[str, RunRecord] = {}
    for tags in ({f".dagster/pool/{pipeline_pool(pipeline)}": "true"}, {PIPELINE_TAG: pipeline}):
        runs = RunsFilter(tags=tags, statuses=statuses, created_after=after, created_before=before,
                          updated_after=updated)
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


@dataclass(frozen=True)
class UnfinishedRuns:
    """The runs that covered an epoch and ended without committing it, newest first."""

    failed: list[FailedRun]  # every one, canceled ones included, as ``recovery.decide`` takes them
    canceled: list[str]  # the ids of the canceled ones

    def describe(self) -> str:
        """What a person reads in the progress check: how many, and which was canceled."""
        canceled = f", {len(self.canceled)} canceled (the newest {self.canceled[0]})" if self.canceled else ""
        return f"{len(self.failed)} run(s) ended without committing it{canceled}"


def unfinished_runs_since(instance: DagsterInstance, pipeline: str, since: Optional[float],
                          first_epoch: int) -> UnfinishedRuns:
    """The pipeline's epoch runs that covered ``first_epoch`` (the earliest uncommitted
    one) and ended, failed or canceled, after ``since`` (the commit of the epoch before
    it), newest first: a range run that committed the epochs before it and then failed
    or was canceled counts, though it was created before that commit; a run of a later
    epoch launched by hand, refused for its order, or a failed rescale says nothing
    about it. The newest failure says whether it failed permanently (its step's
    ``Failure`` metadata, set by the epochs op from ``errors.is_retryable``); a run
    killed, canceled, or failed before its step ran, is transient. Reads a bounded
    number of runs and one run's failure events: O(1) in the pipeline's age."""
    records = pool_runs(instance, pipeline, UNFINISHED, limit=FAILED_RUNS_READ, updated_after=since)
    covering = [r for r in records if _covers(r, first_epoch) and (since is None or _ended_at(r) > since)]
    runs = [FailedRun(r.dagster_run.run_id, _ended_at(r)) for r in covering]
    if covering and covering[0].dagster_run.status == DagsterRunStatus.FAILURE:
        runs[0] = replace(runs[0], permanent=permanent_failure(instance, runs[0].run_id))
    canceled = [r.dagster_run.run_id for r in covering if r.dagster_run.status == DagsterRunStatus.CANCELED]
    return UnfinishedRuns(runs, canceled)


def _ended_at(record: RunRecord) -> float:
    return record.end_time or record.update_timestamp.timestamp()


def _covers(record: RunRecord, epoch: int) -> bool:
    """Whether an epochs run's partitions include ``epoch``."""
    first, last = _first_epoch_of(record), _last_epoch_of(record)
    return first is not None and last is not None and first <= epoch <= last


def _first_epoch_of(record: RunRecord) -> Optional[int]:
    """The first epoch an epochs run covers (its partition, or its range's start)."""
    tags = record.dagster_run.tags
    return _epoch(tags.get("dagster/partition") or tags.get("dagster/asset_partition_range_start"))


def _last_epoch_of(record: RunRecord) -> Optional[int]:
    """The last epoch an epochs run covers (its partition, or its range's end)."""
    tags = record.dagster_run.tags
    return _epoch(tags.get("dagster/partition") or tags.get("dagster/asset_partition_range_end"))


def _epoch(key: Optional[str]) -> Optional[int]:
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


def committed_at(runner: EpochRunner, epoch: int) -> Optional[float]:
    """When ``epoch`` committed (Unix time), None for epoch 0 or a manifest without the time."""
    stamp = runner.result(epoch).committed_at if epoch >= 1 else None
    return datetime.fromisoformat(stamp).timestamp() if stamp else None


def unfinished_runs(instance: DagsterInstance, runner: EpochRunner, pipeline: str, epoch: int) -> UnfinishedRuns:
    """The runs that covered ``epoch`` and ended without committing it, since the epoch
    before it committed: what happened while it waited."""
    return unfinished_runs_since(instance, pipeline, committed_at(runner, epoch - 1), epoch)


def recovery_decision(instance: DagsterInstance, runner: EpochRunner, deployment: Deployment,
                      now: Optional[float] = None, ended: Optional[UnfinishedRuns] = None) -> RecoveryDecision:
    """Whether to request the uncommitted epochs now (``volley_dagster/recovery.py``),
    from the runs that failed or were canceled since the last commit (``ended``, when
    the caller read them already)."""
    first = runner.committed_epoch() + 1
    ended = ended or unfinished_runs(instance, runner, deployment.name, first)
    decision = decide(ended.failed, time.time() if now is None else now, deployment.backoff, first,
                      runner.log.last_cut(), salt=deployment.name)
    if not ended.canceled:
        return decision
    return replace(decision, reason=f"{decision.reason} ({len(ended.canceled)} of those runs canceled, the newest "
                                    f"{ended.canceled[0]}: a canceled run's epochs are requested again as a failed "
                                    "run's are; stop the sensor to stop the pipeline)")


def newest_ended_run(instance: DagsterInstance, pipeline: str) -> Optional[str]:
    """The id of the pipeline's newest run that ended (succeeded, failed or was canceled)."""
    ended = pool_runs(instance, pipeline, ENDED, limit=1)
    return ended[0].dagster_run.run_id if ended else None


PRUNED_PER_TICK = 200  # partitions, and runs, removed by one tick at most: a first tick on an old instance stays short


def prune_history(instance: DagsterInstance, runner: EpochRunner, deployment: Deployment,
                  partitions_name: str) -> tuple[int, int]:
    """Remove the dynamic partitions of committed epochs older than the last
    ``deployment.partitions_kept``, and the pipeline's ended runs that touched only
    those: created before the newest removed epoch committed, and whose last partition
    is older than the oldest kept (a range run that went on to commit kept epochs keeps
    their materializations). At most ``PRUNED_PER_TICK`` of each per call.
    (partitions removed, runs removed)."""
    committed = runner.committed_epoch()
    oldest_kept = committed - deployment.partitions_kept + 1
    if oldest_kept <= 1 or not instance.has_dynamic_partition(partitions_name, epoch_key(oldest_kept - 1)):
        return 0, 0  # the newest epoch to remove is gone already: so are the older ones (one lookup per idle tick)
    keys = instance.get_dynamic_partitions(partitions_name)  # bounded by the retention itself
    doomed = [k for k in keys if k.isdigit() and int(k) < oldest_kept][:PRUNED_PER_TICK]
    for key in doomed:
        instance.delete_dynamic_partition(partitions_name, key)
    kept_since = committed_at(runner, oldest_kept - 1)  # runs created later may have touched kept epochs
    old = pool_runs(instance, deployment.name, ENDED, limit=PRUNED_PER_TICK, created_before=kept_since, oldest_first=True)
    doomed_runs = [r.dagster_run.run_id for r in old if _touched_only_before(r, oldest_kept)]
    for run_id in doomed_runs:
        instance.delete_run(run_id)
    return len(doomed), len(doomed_runs)


def _touched_only_before(record: RunRecord, epoch: int) -> bool:
    """Whether a run materialized no partition from ``epoch`` on: its last partition is
    older (a run of no partition, as a rescale, materialized none)."""
    last = _last_epoch_of(record)
    return last is None or last < epoch


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


MERGE_COMMAND = "volley dagster-instance --merge $DAGSTER_HOME/dagster.yaml"  # volley_dagster/dagster/instance.py


def instance_problems(instance: DagsterInstance, pipeline: str) -> list[str]:
    """What the instance lacks of the settings the pipeline's guarantees rest on
    (``volley_dagster/dagster/instance.instance_settings``), each naming its fix, read
    only: the pool's limit (``pool_limit_problem``), a queued run coordinator (which
    holds a run until its pool admits it), run retries (a run whose process died is run
    again) and run monitoring (such a run is marked failed, and its slot freed). Empty:
    nothing is missing. The run launcher is the instance's choice."""
    problems = [problem] if (problem := pool_limit_problem(instance, pipeline)) is not None else []
    if not isinstance(instance.run_coordinator, QueuedRunCoordinator):
        problems.append(f"the run coordinator is {type(instance.run_coordinator).__name__}, which launches every run "
                        "at once: pools hold runs only in the QueuedRunCoordinator's queue (run_coordinator in "
                        f"dagster.yaml, or `{MERGE_COMMAND}`)")
    if not instance.run_retries_enabled:
        problems.append("run retries are off: a run whose process died (kill -9, OOM, a lost node) is not run again, "
                        "and its epochs wait for the sensor's next request (run_retries.enabled: true in dagster.yaml, "
                        f"or `{MERGE_COMMAND}`)")
    if not instance.run_monitoring_enabled:
        problems.append("run monitoring is off: a run whose process died stays STARTED, holding the pipeline's pool, "
                        "until something marks it failed (the sensor does only for runs on its own machine; "
                        f"run_monitoring.enabled: true in dagster.yaml, or `{MERGE_COMMAND}`)")
    return problems


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
