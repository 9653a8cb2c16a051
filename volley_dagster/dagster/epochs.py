"""A pipeline as Dagster assets: source -> state -> one asset per sink table, all
partitioned by epoch. A thin layer: every decision is the engine's."""

import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, TypedDict

from dagster import (
    AllPartitionMapping,
    AssetCheckExecutionContext,
    AssetCheckKey,
    AssetCheckResult,
    AssetChecksDefinition,
    AssetCheckSpec,
    AssetDep,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetSpec,
    BackfillPolicy,
    DagsterInstance,
    DynamicPartitionsDefinition,
    Failure,
    MetadataValue,
    RetryRequested,
    asset_check,
    in_process_executor,
    multi_asset,
)

from volley_dagster import ConfigError, EpochRunner, Pipeline
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.blocking import RECORD as BLOCKING_RECORD
from volley_dagster.dagster.blocking import (
    BlockingFailure,
    blocking_failure,
    clear_blocking_failure,
    kept_epochs,
    record_blocking_failure,
)
from volley_dagster.dagster.cadence import freshness_bound_s
from volley_dagster.dagster.keys import PipelineKeys, sink_kind, source_kinds
from volley_dagster.dagster.metadata import (
    DagsterMetadata,
    code_references,
    epoch_metadata,
    sink_location,
    state_preview,
)
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.dagster.runs import (
    FAILURE_KIND,
    PIPELINE_TAG,
    UnfinishedRuns,
    instance_problems,
    pipeline_pool,
    recovery_decision,
    unfinished_runs,
)
from volley_dagster.deploy import Deployment, TableSettings
from volley_dagster.errors import is_retryable
from volley_dagster.recovery import RecoveryDecision
from volley_dagster.settings import RunSettings
from volley_dagster.verify import (
    ROW_COUNT_WINDOW,
    CheckOutcome,
    check_freshness,
    check_latest_snapshot,
    check_sink,
    check_snapshot,
)

# A failed epoch is retried inside its run (a lost executor, S3 unreachable, a lost
# commit race or lease) ``backoff.retries_in_run`` times, after the deployment's backoff;
# then the sensor or schedule requests it again, after the same backoff
# (volley_dagster/recovery.py). A killed run is retried as a new run (dagster.yaml's run_retries).
# The same on the pipeline's own jobs, for an instance whose dagster.yaml sets no defaults
# (run_retries must still be enabled there): a run whose process died is re-run; a failed
# step already had its retries.
RUN_RETRY_TAGS = {"dagster/max_retries": "3", "dagster/retry_on_asset_or_op_failure": "false"}
# Each of the pipelines' jobs: one step per run, and Spark in the run's own process (a
# second process buys nothing); named on the job, so a project merging these
# definitions keeps its own default executor.
EPOCH_EXECUTOR = in_process_executor


def epochs_job_name(pipeline: str) -> str:
    return f"{pipeline}_epochs_job"


def partitions_name(deployment: Deployment) -> str:
    return f"{deployment.name}_epochs"


def epochs_partitions(deployment: Deployment) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=partitions_name(deployment))


def make_runner(
    deployment: Deployment,
    checkpoints: CheckpointResource,
    tables: TablesResource,
    spark: Optional[SparkResource] = None,
    log: Optional[Callable[[str], None]] = None,
) -> EpochRunner:
    """The engine's runner for this deployment; Spark only starts if ``spark`` is given
    and an epoch is actually processed. ``log`` hears which Spark the run uses."""
    pipeline = built_pipeline(deployment, tables.settings())
    root = Path(checkpoints.root) / pipeline.name
    keep = kept_epochs(root, checkpoints.keep_epochs)  # more while a blocking check is red
    settings = RunSettings(keep_epochs=keep, max_records_per_epoch=checkpoints.max_records_per_epoch,
                           lease_wait_s=checkpoints.lease_wait_s, snapshot_store=checkpoints.snapshot_store(pipeline.name),
                           resident_state=checkpoints.resident_state(), rocksdb=checkpoints.rocksdb())
    return EpochRunner(pipeline, root, settings,
                       spark=spark.session(log) if spark is not None else None)


def parse_epoch(key: str) -> int:
    if not key.isdigit():
        raise ConfigError(f"partition key {key!r} is not an epoch number (keys look like {epoch_key(7)})")
    return int(key)


def built_pipeline(deployment: Deployment, settings: TableSettings) -> Pipeline:
    """The deployment's pipeline, refused when it is named apart from the deployment:
    asset keys, partitions, pools and run tags all go by the one name."""
    pipeline = deployment.build(settings).settled()
    if pipeline.name != deployment.name:
        raise ConfigError(f"deployment {deployment.name!r} builds a pipeline named {pipeline.name!r}; "
                          "give both the same name")
    return pipeline


def epoch_assets(deployment: Deployment, pipeline: Pipeline,
                 upstream: Optional[Mapping[Optional[str], AssetKey]] = None) -> list:
    """The epochs multi-asset with its checks, then its sources and dimension tables.
    ``pipeline``: the deployment's, built with the settings that only name table
    locations for the asset specs (runs use the resources' settings). ``upstream``:
    sources that read another pipeline's table (``keys.upstream_sources``), whose asset
    is that table's, not one of their own."""
    upstream = upstream or {}
    partitions = epochs_partitions(deployment)
    keys = PipelineKeys.of(deployment)
    code = code_references(deployment)
    team = deployment.assets
    owners, tags = list(team.owners), dict(team.tags)

    sources = [
        AssetSpec(  # observed by the sensor on each tick that sees data landed in it
            keys.source_part(name),
            kinds=source_kinds(log),
            description=f"The log {log.uri} that {pipeline.name!r} reads" + (f" as source {name!r}." if name else "."),
            metadata={"dagster/uri": log.uri, **log.describe(), **code},
            group_name=pipeline.name, owners=owners, tags=tags,
        )
        for name, log in pipeline.source_log.parts().items() if name not in upstream
    ]
    dimensions = [
        AssetSpec(
            keys.dimension(step.name),
            kinds={step.table.kind},
            description=f"Dimension table {step.table.uri} that {pipeline.name!r} joins on {list(step.on)} ({step.how}); "
                        "each epoch reads the version pinned when it was cut.",
            metadata={"dagster/uri": step.table.uri, **step.table.describe()},
            group_name=pipeline.name, owners=owners, tags=tags,
        )
        for step in pipeline.enrichments
    ]
    specs = [
        AssetSpec(
            keys.state,
            # another pipeline's epoch N is not this one's: each epoch reads the versions it recorded
            deps=[s.key for s in sources] + [AssetDep(k, partition_mapping=AllPartitionMapping())
                                             for k in upstream.values()] + [d.key for d in dimensions],
            kinds={"spark", "rocksdb"},
            description=f"Keyed state of {pipeline.name!r} after each epoch (RocksDB snapshots).",
            skippable=True,  # materialized per committed epoch, by events (see the op)
            metadata={"initial_shards": pipeline.layout.num_shards, "key_groups": pipeline.layout.num_key_groups,
                      "key": pipeline.key_column, **code},
            code_version=team.code_version,
            group_name=pipeline.name, owners=owners, tags=tags,
        )
    ] + [
        AssetSpec(
            keys.sink(sink),
            deps=[keys.state],
            kinds={sink_kind(sink)},
            description=f"{sink_kind(sink).title()} table written by sink {sink.name!r}, one commit per epoch.",
            metadata={**sink_location(sink), **code},
            skippable=True,
            code_version=team.code_version,
            group_name=pipeline.name, owners=owners, tags=tags,
        )
        for sink in pipeline.sinks
    ]

    check_specs = [AssetCheckSpec(name, asset=keys.state, blocking=name in BLOCKING_CHECKS,
                                  description=check_description(name)) for name in STATE_CHECKS] + [
        AssetCheckSpec(name, asset=keys.sink(sink), blocking=name in BLOCKING_CHECKS, description=check_description(name))
        for sink in pipeline.sinks for name in SINK_CHECKS
    ]

    @multi_asset(
        name=f"{pipeline.name}_epochs",
        specs=specs,
        check_specs=check_specs,
        partitions_def=partitions,
        backfill_policy=BackfillPolicy.single_run(),
        # A selection of some of the assets (`dg launch --assets payments/state`) runs the
        # whole epoch: the state and every table commit together, or none does.
        can_subset=True,
        op_tags={PIPELINE_TAG: pipeline.name},
        pool=pipeline_pool(pipeline.name),
    )
    def epochs(
        context: AssetExecutionContext, volley_spark: SparkResource, volley_checkpoints: CheckpointResource,
        volley_tables: TablesResource,
    ):
        """Runs the partitions' epochs in ascending order on one SparkSession, holding
        the pipeline's lease; committed epochs come back as no-ops, and an epoch whose
        predecessor is not committed fails naming it. Each epoch is materialized as it
        commits, so a run that fails at epoch K keeps the epochs before K. Then the
        checks run, still under the lease, on what the run left. A run that selected
        some of the assets commits every table all the same (one epoch is one commit of
        all of them), and reports the selected checks; a failed blocking check fails it
        whether selected or not."""
        for problem in instance_problems(context.instance, pipeline.name):  # the sensor's instance_settings check
            context.log.warning(f"{pipeline.name}: {problem}")
        runner = make_runner(deployment, volley_checkpoints, volley_tables, volley_spark, log=context.log.info)
        attempt = {"run_retry": int(context.run.tags.get("dagster/retry_number", 0)), "step_retry": context.retry_number}
        if any(attempt.values()):
            context.log.info(f"retrying: run retry {attempt['run_retry']}, step retry {attempt['step_retry']}")
        try:
            with runner.lease(owner=f"dagster run {context.run.run_id}", notify=context.log.info) as lease:
                context.log.info(f"holding the lease of {pipeline.name!r} (fencing token {lease.fence.token}, "
                                 f"waited {lease.waited_s:.1f}s)")
                for key in sorted(context.partition_keys, key=parse_epoch):
                    result = runner.run(parse_epoch(key))
                    extra = {"fencing_token": MetadataValue.int(result.fencing_token),  # of the run that committed it
                             "lease_wait_s": MetadataValue.float(lease.waited_s),
                             **{k: MetadataValue.int(v) for k, v in attempt.items()}}
                    row_counts = {sink.name: sink.row_count() for sink in runner.pipeline.sinks}
                    by = deployment.state_preview_by
                    preview = {"top_keys": state_preview(runner, result.epoch, by)} if by and not result.already_committed else {}
                    for asset_key, metadata in epoch_metadata(keys, runner.pipeline, result, row_counts).items():
                        shown = {**metadata, **extra, **(preview if asset_key == keys.state else {})}
                        yield AssetMaterialization(asset_key=asset_key, partition=key, metadata=shown)
                    verb = "was already committed" if result.already_committed else "committed"
                    context.log.info(f"epoch {result.epoch} {verb}: {result.records_in} records in, "
                                     f"{result.records_out} out")
                ran = sorted(parse_epoch(k) for k in context.partition_keys)
                committed = runner.committed_epoch()
                window = range(ran[0], min(ran[-1], committed) + 1) if ran and ran[0] <= committed else None
                checks = check_results(context.instance, runner, deployment, window, run_id=context.run.run_id)
        except Exception as exc:
            if not is_retryable(exc):  # the sensor and schedule read FAILURE_KIND and stop requesting
                raise Failure(description=f"{type(exc).__name__}: {exc}", allow_retries=False,
                              metadata={FAILURE_KIND: "permanent", "error": type(exc).__name__}) from exc
            wait = deployment.backoff.delay_s(context.retry_number + 1, salt=context.run.run_id)
            raise RetryRequested(max_retries=deployment.backoff.retries_in_run, seconds_to_wait=wait) from exc
        selected = context.selected_asset_check_keys
        yield from (c for c in checks if c.asset_key is not None and c.check_name is not None
                    and AssetCheckKey(c.asset_key, c.check_name) in selected)
        if failed := [f"{c.asset_key and c.asset_key.to_user_string()} {c.check_name}" for c in checks
                      if not c.passed and c.check_name in BLOCKING_CHECKS]:
            # after the checks are recorded; permanent, and recorded in the root (blocking.py): the sensor
            # asks a person rather than retry, until the checks pass
            raise Failure(description=f"blocking checks failed: {', '.join(failed)}. The epochs this run committed "
                                      "stay committed; what follows them in this run does not run, and no epoch is "
                                      f"requested until they pass ({runner.log.root / BLOCKING_RECORD}). Each "
                                      "check's description says what is wrong and what to do.",
                          allow_retries=False, metadata={FAILURE_KIND: "permanent", "failed_checks": failed})

    return [epochs, *sources, *dimensions]


STATE_CHECKS = ("snapshot_checksums", "epochs_progress", "freshness")
# The checks that say the data is wrong (a corrupt snapshot, a table missing an epoch or
# holding one twice, rows lost): they stop downstream work. Progress and freshness say
# it is late, which retries and the sensor already handle: they warn.
BLOCKING_CHECKS = frozenset({"snapshot_checksums", "recorded_epoch", "no_duplicate_epochs", "row_counts"})
SINK_CHECKS = ("recorded_epoch", "no_duplicate_epochs", "row_counts", "freshness")  # the state's freshness, per table
# What each check says, as the UI and `dg list defs` show it; a result's own description
# says what it found and what to do.
CHECK_DESCRIPTIONS = {
    "snapshot_checksums": "Blocking. The last committed epoch's state snapshot holds every file its manifest "
                          "lists, of its size, and each file new since the epoch before matches its SHA-256 (a "
                          "file shared with it was hashed when it was new). Fails on a missing or damaged file; "
                          "the sensor then requests no epoch until it passes.",
    "epochs_progress": "Every cut epoch is committed, or the earliest one is being retried. Fails when that epoch "
                       "failed permanently (bad input, configuration), after the backoff's alert_after failed runs "
                       "(the retries go on), or while a blocking check's failure stops the pipeline; says how many "
                       "runs ended without committing it.",
    "freshness": "No record has waited longer than the freshness bound to be committed (the deployment's "
                 "freshness_bound_s, or three cadences and two minutes); a table is as fresh as the state. "
                 "Reported by each run and, when it changes, by the sensor.",
    "recorded_epoch": "Blocking. The table records, as its latest, the pipeline's last committed epoch, of this "
                      "checkpoint lineage.",
    "no_duplicate_epochs": "Blocking. Each epoch the run committed is in the table's history once.",
    "row_counts": "Blocking. The rows each epoch wrote to the table equal the rows its manifest counted.",
}
INSTANCE_CHECK = "instance_settings"


def check_description(name: str) -> str:
    return CHECK_DESCRIPTIONS[name]


def instance_check(deployment: Deployment) -> AssetChecksDefinition:
    """The ``instance_settings`` check on the state: whether the Dagster instance has what
    the pipeline's guarantees rest on (``runs.instance_problems``; the sections come from
    ``volley dagster-instance``). Not blocking, outside the epochs job (a run costs no
    more): the sensor reports it on its first tick that finds something missing, and
    again when that changes; the UI's Execute button evaluates it now."""
    keys = PipelineKeys.of(deployment)

    @asset_check(asset=keys.state, name=INSTANCE_CHECK, blocking=False, description=(
        "The Dagster instance has what the pipeline's guarantees rest on: a pool limit of one run, the queued run "
        "coordinator, run retries and run monitoring (`volley dagster-instance` prints the dagster.yaml sections). "
        "Fails naming what is missing; the sensor reports it when that changes."))
    def instance_settings(context: AssetCheckExecutionContext) -> AssetCheckResult:
        return AssetCheckResult(**check_fields(instance_outcome(context.instance, deployment.name)))

    return instance_settings


def instance_outcome(instance: DagsterInstance, pipeline: str) -> CheckOutcome:
    problems = instance_problems(instance, pipeline)
    if not problems:
        return CheckOutcome(INSTANCE_CHECK, True, "the instance has a pool limit of one run, the queued run "
                                                  "coordinator, run retries and run monitoring", {"missing": 0})
    return CheckOutcome(INSTANCE_CHECK, False, "; ".join(problems), {"missing": len(problems)})


def check_results(instance: DagsterInstance, runner: EpochRunner, deployment: Deployment,
                  epochs: Optional[range] = None, run_id: str = "") -> list[AssetCheckResult]:
    """Every check of the pipeline, as of now: the state's, then each table's. ``epochs``:
    what the run committed, so that the checks cost what it changed (the files new since
    the epoch before them, those epochs' rows in each table); None: the latest epoch's.
    A blocking check that fails is recorded in the checkpoint root (``blocking.py``),
    and while it is, the checks also cover the epochs it flagged, its snapshot hashed in
    full; the record goes once they all pass. ``run_id``: the run, named in the record."""
    keys = PipelineKeys.of(deployment)
    root, committed = runner.log.root, runner.committed_epoch()
    held = blocking_failure(root)
    ran = epochs if epochs is not None else range(max(1, committed - ROW_COUNT_WINDOW + 1), committed + 1)
    window = ran if held is None else range(min(ran.start, held.first), max(ran.stop, held.last + 1))
    snapshot = _snapshot_check(runner, epochs.start - 1 if epochs else None, held)
    tables = {sink.name: check_sink(runner, sink, epochs=window) for sink in runner.pipeline.sinks}
    verdicts = [(keys.state, snapshot), *((keys.sink(sink), o) for sink in runner.pipeline.sinks
                                          for o in tables[sink.name])]
    _settle_blocking(runner, deployment, held, window, verdicts, run_id)
    progress = check_progress(instance, runner, deployment, ran=epochs)
    fresh = check_freshness(runner, freshness_bound_s(deployment), time.time())
    results = [AssetCheckResult(asset_key=keys.state, **check_fields(o)) for o in (snapshot, progress, fresh)]
    for sink in runner.pipeline.sinks:  # a table is as fresh as the state
        results += [AssetCheckResult(asset_key=keys.sink(sink), **check_fields(o)) for o in [*tables[sink.name], fresh]]
    return results


def _snapshot_check(runner: EpochRunner, since: Optional[int], held: Optional[BlockingFailure]) -> CheckOutcome:
    """The latest snapshot's files new since ``since``; while a snapshot is flagged, that
    one first, every file hashed (a damaged file hardlinked into later snapshots counts
    as shared with it there), then the latest's files new since it."""
    if held is None or held.snapshot_epoch is None:
        return check_latest_snapshot(runner, since=since)
    flagged = check_snapshot(runner, held.snapshot_epoch, full=True)
    if not flagged.passed or runner.committed_epoch() == held.snapshot_epoch:
        return replace(flagged, description=f"{flagged.description} (flagged by run {held.run_id}, checked in full "
                                            "until it passes)")
    base = held.snapshot_epoch if since is None else min(since, held.snapshot_epoch)
    return check_latest_snapshot(runner, since=base)


def _settle_blocking(runner: EpochRunner, deployment: Deployment, held: Optional[BlockingFailure], window: range,
                     verdicts: list[tuple[AssetKey, CheckOutcome]], run_id: str) -> None:
    """Record the blocking checks that failed over ``window`` (the sensor stops, retention
    holds), or clear the record once they all pass."""
    failed = [(key, o) for key, o in verdicts if not o.passed and o.name in BLOCKING_CHECKS]
    root = runner.log.root
    if not failed:
        if held is not None:
            clear_blocking_failure(root)
        return
    snapshot_epoch = next((int(o.metadata["epoch"]) for _, o in failed if o.name == "snapshot_checksums"), None)
    last = max(window.start, min(window.stop - 1, runner.committed_epoch()))
    record_blocking_failure(root, BlockingFailure(
        deployment.name, window.start, last, snapshot_epoch, tuple(f"{key.to_user_string()} {o.name}" for key, o in failed),
        tuple(o.description for _, o in failed), run_id, datetime.now(timezone.utc).isoformat(timespec="seconds")))


class CheckFields(TypedDict):
    """An engine check's outcome as Dagster's check results and evaluations take it."""

    check_name: str
    passed: bool
    description: str
    metadata: DagsterMetadata


def check_fields(outcome: CheckOutcome) -> CheckFields:
    return {"check_name": outcome.name, "passed": outcome.passed, "description": outcome.description,
            "metadata": outcome.metadata}


def check_progress(instance: DagsterInstance, runner: EpochRunner, deployment: Deployment,
                   decision: Optional[RecoveryDecision] = None, ran: Optional[range] = None) -> CheckOutcome:
    """Fails while a blocking check's failure is recorded (a person must act), when the
    earliest uncommitted epoch failed permanently (likewise), or transiently in
    ``backoff.alert_after`` runs since the last commit (retries go on). Says how many
    runs ended without committing it (failed or canceled). ``decision``: the recovery
    decision the caller made this moment, if it made one; ``ran``: the epochs the
    caller's run committed, whose earlier failed or canceled runs it also names."""
    committed, cut = runner.committed_epoch(), runner.log.last_cut()
    held = blocking_failure(runner.log.root)
    if held is not None:
        return CheckOutcome("epochs_progress", False, held.describe(runner.log.root),
                            {"committed_epoch": committed, "last_cut_epoch": cut, "stopped": True, "failed_runs": 0,
                             "canceled_runs": 0, "blocking_checks_failed": MetadataValue.json(list(held.checks))})
    if committed == cut:
        meanwhile = unfinished_runs(instance, runner, deployment.name, ran.start) if ran else UnfinishedRuns([], [])
        before = f"; before epoch {ran.start} committed, {meanwhile.describe()}" if ran and meanwhile.failed else ""
        return CheckOutcome("epochs_progress", True, f"every cut epoch is committed (the last is {committed}){before}",
                            {"committed_epoch": committed, "failed_runs": len(meanwhile.failed),
                             "canceled_runs": len(meanwhile.canceled)})
    ended = unfinished_runs(instance, runner, deployment.name, committed + 1)
    decision = decision or recovery_decision(instance, runner, deployment, ended=ended)
    return CheckOutcome(
        "epochs_progress", not decision.alert,
        f"epoch {committed + 1} (of {cut} cut) is not committed; {decision.reason}",
        {"committed_epoch": committed, "last_cut_epoch": cut, "failed_runs": decision.failures,
         "canceled_runs": len(ended.canceled), "stopped": decision.stopped,
         **({"next_request_at": MetadataValue.timestamp(decision.next_at)} if decision.next_at else {})},
    )
