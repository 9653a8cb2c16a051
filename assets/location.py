"""Assemble a code location from pipeline deployments and resources."""

from typing import TYPE_CHECKING

from dagster import (
    AssetsDefinition,
    AssetSelection,
    AssetSpec,
    Definitions,
    JobDefinition,
    ScheduleDefinition,
    SensorDefinition,
    SourceAsset,
    define_asset_job,
    in_process_executor,
)

from assets.epochs import PIPELINE_TAG, RUN_RETRY_TAGS, epoch_assets, epochs_job_name, epochs_partitions
from assets.migrate import migrate_job
from assets.rescale import rescale_job
from assets.state_export import state_export_asset
from resources import CheckpointResource, SparkResource, TablesResource
from sensors import epoch_schedule, epoch_sensor
from volley_dagster.deploy import Deployment

if TYPE_CHECKING:  # what define_asset_job returns; Dagster does not export the name
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition


def build_definitions(
    deployments: list[Deployment], checkpoints: CheckpointResource, tables: TablesResource, spark: SparkResource
) -> Definitions:
    assets: list[AssetsDefinition | SourceAsset | AssetSpec] = []
    jobs: list[JobDefinition | UnresolvedAssetJobDefinition] = []
    sensors: list[SensorDefinition] = []
    schedules: list[ScheduleDefinition] = []
    for deployment in deployments:
        source, epochs, *dimensions = epoch_assets(deployment, tables.settings())
        assets.extend([source, epochs, *dimensions])
        job = define_asset_job(
            epochs_job_name(deployment.name),
            selection=AssetSelection.assets(epochs),  # with its checks: they run after the epochs
            partitions_def=epochs_partitions(deployment),
            tags={PIPELINE_TAG: deployment.name, **RUN_RETRY_TAGS},
        )
        export, export_job = state_export_asset(deployment, tables.settings())
        assets.append(export)
        jobs.extend([job, rescale_job(deployment, tables.settings()), migrate_job(deployment, tables.settings()),
                     export_job])
        sensors.append(epoch_sensor(deployment, job))
        if deployment.cron:
            schedules.append(epoch_schedule(deployment, job))
    return Definitions(
        assets=assets,
        jobs=jobs,
        sensors=sensors,
        schedules=schedules,
        resources={"spark": spark, "checkpoints": checkpoints, "tables": tables},
        # One step per run, and Spark in the run's own process: a second process buys nothing.
        executor=in_process_executor,
    )
