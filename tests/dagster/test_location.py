"""The code location loads, its sensor cuts epochs, and a partition run commits one."""

from __future__ import annotations

from dagster import DagsterInstance, build_sensor_context, materialize

from assets.epochs import epoch_state_asset
from resources import CheckpointResource, SparkResource
from sensors import epoch_cutting_sensor
from tests.helpers import payments
from volley_dagster.demo.events import generate


def test_sensor_cuts_and_partition_run_commits(spark, tmp_path):
    generate(tmp_path / "events", 2, 1_000, 100)

    def pipeline():
        return payments(tmp_path / "events", tmp_path / "out")

    state = epoch_state_asset(pipeline)
    checkpoints = CheckpointResource(root=str(tmp_path / "state"), max_records_per_epoch=1_500)
    sensor = epoch_cutting_sensor(pipeline, "epochs_job")
    with DagsterInstance.ephemeral() as instance:
        ctx = build_sensor_context(instance=instance, resources={"checkpoints": checkpoints})
        first = sensor(ctx)
        assert [r.partition_key for r in first.run_requests] == ["0000000001"]
        instance.add_dynamic_partitions("payments_epochs", ["0000000001"])
        result = materialize(
            [state], partition_key="0000000001", instance=instance,
            resources={"spark": SparkResource(), "checkpoints": checkpoints},
        )
        assert result.success
        meta = result.asset_materializations_for_node(state.op.name)[0].metadata
        assert meta["records_in"].value == 1_500 and meta["already_committed"].value is False
        second = sensor(build_sensor_context(instance=instance, resources={"checkpoints": checkpoints}))
        assert [r.partition_key for r in second.run_requests] == ["0000000002"]
