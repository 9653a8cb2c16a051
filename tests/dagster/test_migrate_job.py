"""``payments_migrate_job`` on a real DagsterInstance: after a deploy adds an
accumulator, the epochs run refuses and names the job; the job rewrites the state for
the pipeline the location builds now, and the next epoch run goes on with it."""

from __future__ import annotations

from dataclasses import replace

from dagster import AssetKey

from volley_dagster import EpochRunner, sum_
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, payments_deployment, payments_pipeline
from volley_dagster.settings import RunSettings

STATE = AssetKey(["payments", "state"])


def run_epochs(defs, instance, start: int, end: int):
    tags = {"dagster/asset_partition_range_start": epoch_key(start), "dagster/asset_partition_range_end": epoch_key(end)}
    return defs.resolve_job_def("payments_epochs_job").execute_in_process(instance=instance, tags=tags,
                                                                          raise_on_error=False)


def test_a_deploy_that_adds_an_accumulator_is_migrated_by_the_job(location_for, tmp_path):
    deployment = replace(payments_deployment(tmp_path / "events"), max_wait_s=None)
    defs, instance, base = location_for(deployment)
    generate(base / "events", 3, 1_000, 200)
    runner = EpochRunner(payments_pipeline(base / "events", local_tables(base / "tables")), base / "state" / "payments", RunSettings(max_records_per_epoch=1_000))
    for _ in range(3):
        runner.cut_next()
    instance.add_dynamic_partitions("payments_epochs", [epoch_key(1), epoch_key(2), epoch_key(3)])
    assert run_epochs(defs, instance, 1, 2).success

    # the deploy: the same pipeline with a refunds-to-date sum added
    changed = replace(deployment, build=lambda tables: payments_pipeline(base / "events", tables).aggregate(
        total=sum_("amount"), spent_since=sum_("amount")))
    new_defs = build_definitions([changed], checkpoints=CheckpointResource(root=str(base / "state"),
                                                                           max_records_per_epoch=1_000),
                                 tables=TablesResource(warehouse=str(base / "tables")), spark=SparkResource())
    refused = run_epochs(new_defs, instance, 3, 3)
    assert not refused.success
    message = str(refused.get_step_failure_events()[0].event_specific_data.error)
    assert "payments_migrate_job" in message

    migrated = new_defs.resolve_job_def("payments_migrate_job").execute_in_process(
        instance=instance, run_config={"ops": {"payments_migrate": {"config": {"initial": {"spent_since": 0}}}}})
    assert migrated.success
    (observation,) = migrated.asset_observations_for_node("payments_migrate")
    md = observation.metadata
    assert observation.asset_key == STATE and md["migrated_epoch"].value == 2 and md["from_epoch"].value == 3
    assert set(md["changes"].value) >= {"'spent_since' added (existing keys start from 0)", "'events' removed"}

    assert run_epochs(new_defs, instance, 3, 3).success
    state = EpochRunner(changed.build(local_tables(base / "tables")), base / "state" / "payments").read_state()
    assert state.column_names == ["merchant_id", "total", "spent_since"] and state.num_rows > 0
