"""Epochs as partitions: one Dagster partition per checkpoint epoch of a pipeline."""


from typing import Callable

from dagster import (
    AssetExecutionContext,
    AssetKey,
    DynamicPartitionsDefinition,
    MaterializeResult,
    MetadataValue,
    asset,
)

from resources import CheckpointResource, SparkResource
from volley_dagster import EpochRunner, Pipeline
from volley_dagster.checkpoint.epoch_log import epoch_key


def epochs_partitions(pipeline: Pipeline) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=f"{pipeline.name}_epochs")


def make_runner(pipeline: Pipeline, spark: SparkResource | None, checkpoints: CheckpointResource) -> EpochRunner:
    return EpochRunner(
        pipeline,
        checkpoints.root,
        spark=spark.session() if spark is not None else None,
        keep_epochs=checkpoints.keep_epochs,
        max_records_per_epoch=checkpoints.max_records_per_epoch,
    )


def epoch_state_asset(pipeline_factory: Callable[[], Pipeline]) -> object:
    pipeline = pipeline_factory()

    @asset(
        key=AssetKey([pipeline.name, "state"]),
        partitions_def=epochs_partitions(pipeline),
        kinds={"spark", "rocksdb"},
        description=f"Keyed state of pipeline {pipeline.name!r} after each checkpoint epoch.",
    )
    def _state(context: AssetExecutionContext, spark: SparkResource, checkpoints: CheckpointResource) -> MaterializeResult:
        runner = make_runner(pipeline_factory(), spark, checkpoints)
        result = runner.run(int(context.partition_key))
        return MaterializeResult(
            metadata={
                "epoch": result.epoch,
                "already_committed": result.already_committed,
                "records_in": result.records_in,
                "records_out": result.records_out,
                "dead_letters": result.dead_letters,
                "keys_touched": result.keys_touched,
                "state_bytes": MetadataValue.int(result.state_bytes),
                "range": MetadataValue.json(result.range),
                "seconds": MetadataValue.float(result.durations.get("total", 0.0)),
            }
        )

    return _state


__all__ = ["epoch_key", "epoch_state_asset", "epochs_partitions", "make_runner"]
