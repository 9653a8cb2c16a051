"""Pruning the instance's history removes the runs that touched only removed
partitions: a range run created before the oldest kept epoch's predecessor committed,
which went on to commit kept epochs, stays, and so do those epochs' materializations.
A real SQLite DagsterInstance, the epoch log written directly; no Spark."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from datetime import datetime, timedelta, timezone

from dagster import AssetKey, AssetMaterialization, DagsterEvent, DagsterEventType, DagsterRun, DagsterRunStatus
from dagster._core.events import StepMaterializationData

from tests.dagster.conftest import build_location
from tests.dagster.synthetic import write_history
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.epochs import epochs_job_name, epochs_partitions, make_runner, partitions_name
from volley_dagster.dagster.runs import PIPELINE_TAG, prune_history
from volley_dagster.demo.payments import payments_deployment

STATE = AssetKey(["payments", "state"])
JOB = epochs_job_name("payments")


def a_run(instance, status: DagsterRunStatus, tags: dict[str, str]) -> DagsterRun:
    return instance.add_run(DagsterRun(job_name=JOB, status=status, tags={PIPELINE_TAG: "payments", **tags}))


def a_range(first: int, last: int) -> dict[str, str]:
    return {"dagster/asset_partition_range_start": epoch_key(first), "dagster/asset_partition_range_end": epoch_key(last)}


def materialized(instance, run: DagsterRun, epochs: range) -> None:
    """What the run's epochs op reports as each epoch commits."""
    for epoch in epochs:
        event = DagsterEvent(DagsterEventType.ASSET_MATERIALIZATION.value, job_name=JOB,
                             event_specific_data=StepMaterializationData(
                                 AssetMaterialization(asset_key=STATE, partition=epoch_key(epoch))))
        instance.report_dagster_event(event, run_id=run.run_id)


def test_a_range_run_that_committed_kept_epochs_stays_with_their_materializations(tmp_path):
    deployment = replace(payments_deployment(tmp_path / "events"), partitions_kept=3)
    (tmp_path / "events").mkdir()
    # every epoch committed after the runs below were created: the runs all predate epoch 7's commit
    write_history(tmp_path / "state" / "payments", "payments", 10, 10,
                  committed_at=datetime.now(timezone.utc) + timedelta(hours=1))
    with ExitStack() as stack:
        defs, instance, _ = build_location(deployment, tmp_path, stack)
        instance.add_dynamic_partitions(partitions_name(deployment), [epoch_key(e) for e in range(1, 11)])
        old = a_run(instance, DagsterRunStatus.SUCCESS, a_range(1, 3))
        straddling = a_run(instance, DagsterRunStatus.SUCCESS, a_range(5, 9))  # committed 5..9; 8 and 9 are kept
        materialized(instance, straddling, range(5, 10))
        failed = a_run(instance, DagsterRunStatus.FAILURE, {"dagster/partition": epoch_key(7)})
        rescale = a_run(instance, DagsterRunStatus.CANCELED, {})  # no partition: it materialized none
        kept = a_run(instance, DagsterRunStatus.SUCCESS, {"dagster/partition": epoch_key(10)})
        resources = defs.resources
        runner = make_runner(deployment, resources["volley_checkpoints"], resources["volley_tables"])

        removed = prune_history(instance, runner, deployment, partitions_name(deployment))

        assert removed == (7, 3)
        assert instance.get_dynamic_partitions(partitions_name(deployment)) == [epoch_key(e) for e in (8, 9, 10)]
        left = {r.run_id for r in instance.get_runs()}
        assert left == {straddling.run_id, kept.run_id}
        assert not {old.run_id, failed.run_id, rescale.run_id} & left
        status = instance.get_status_by_partition(STATE, [epoch_key(8), epoch_key(9)], epochs_partitions(deployment))
        assert {k: v.value for k, v in status.items()} == {epoch_key(8): "MATERIALIZED", epoch_key(9): "MATERIALIZED"}
