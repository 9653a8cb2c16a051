"""Sensors that cut a new epoch when the source has new records."""


from typing import Callable

from dagster import RunRequest, SensorEvaluationContext, SensorResult, SkipReason, sensor

from assets.epochs import epochs_partitions, make_runner
from resources import CheckpointResource
from volley_dagster import Pipeline
from volley_dagster.checkpoint.epoch_log import epoch_key


def epoch_cutting_sensor(pipeline_factory: Callable[[], Pipeline], job_name: str) -> object:
    pipeline = pipeline_factory()
    partitions = epochs_partitions(pipeline)

    @sensor(name=f"{pipeline.name}_new_data", job_name=job_name, minimum_interval_seconds=30)
    def _sensor(context: SensorEvaluationContext, checkpoints: CheckpointResource) -> SensorResult | SkipReason:
        runner = make_runner(pipeline_factory(), None, checkpoints)
        rng = runner.cut_next()
        if rng is None:
            return SkipReason("no new records in the source")
        key = epoch_key(rng.epoch)
        return SensorResult(
            run_requests=[RunRequest(partition_key=key, run_key=key)],
            dynamic_partitions_requests=[partitions.build_add_request([key])],
        )

    return _sensor
