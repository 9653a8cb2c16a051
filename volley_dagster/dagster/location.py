"""Assemble Dagster definitions from pipeline deployments and resources: what this
repository's code location serves, and what a team's own project merges in
(``Definitions.merge``). Resource keys carry the ``volley_`` prefix, and each job
names its own executor, so neither meets the project's own ``spark`` resource or
executor."""

from typing import TYPE_CHECKING, Optional

from dagster import (
    AssetChecksDefinition,
    AssetsDefinition,
    AssetSelection,
    AssetSpec,
    Definitions,
    ExecutorDefinition,
    JobDefinition,
    ScheduleDefinition,
    SensorDefinition,
    define_asset_job,
)

from volley_dagster.dagster.cut import cut_job, cut_job_name
from volley_dagster.dagster.epochs import (
    EPOCH_EXECUTOR,
    PIPELINE_TAG,
    RUN_RETRY_TAGS,
    built_pipeline,
    epoch_assets,
    epochs_job_name,
    instance_check,
)
from volley_dagster.dagster.keys import PipelineKeys, upstream_sources
from volley_dagster.dagster.migrate import migrate_job
from volley_dagster.dagster.rescale import rescale_job
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.dagster.sensors import epoch_schedule, epoch_sensor
from volley_dagster.dagster.state_export import state_export_asset
from volley_dagster.deploy import Deployment
from volley_dagster.errors import ConfigError

if TYPE_CHECKING:  # what define_asset_job returns; Dagster does not export the name
    from dagster._core.definitions.unresolved_asset_job_definition import UnresolvedAssetJobDefinition


def build_definitions(
    deployments: list[Deployment], checkpoints: CheckpointResource, tables: TablesResource, spark: SparkResource,
    executor: Optional[ExecutorDefinition] = None,
) -> Definitions:
    """``executor``: the definitions' default, for what runs outside the pipelines' own
    jobs (None: leave it to the project these definitions merge into)."""
    assets: list[AssetsDefinition | AssetSpec] = []
    checks: list[AssetChecksDefinition] = []
    jobs: list[JobDefinition | UnresolvedAssetJobDefinition] = []
    sensors: list[SensorDefinition] = []
    schedules: list[ScheduleDefinition] = []
    for n, deployment in enumerate(deployments):
        if not isinstance(deployment, Deployment):
            raise ConfigError(f"build_definitions: deployments[{n}] is a {type(deployment).__name__}, not a "
                              "volley_dagster.dagster.Deployment" + (" (call the function that returns it)"
                                                                      if callable(deployment) else ""))
    pipelines = {d.name: built_pipeline(d, tables.settings()) for d in deployments}
    written = {table: PipelineKeys.of(d).sink(sink) for d in deployments for sink in pipelines[d.name].sinks
               if (table := sink.location().identity()) is not None}
    for deployment in deployments:
        upstream = upstream_sources(pipelines[deployment.name], written)
        epochs, *specs = epoch_assets(deployment, pipelines[deployment.name], upstream)
        assets.extend([epochs, *specs])
        checks.append(instance_check(deployment))
        job = define_asset_job(
            epochs_job_name(deployment.name),
            # the epochs with their own checks, which run after them in the same step; the
            # instance_settings check stays out of the runs (the sensor reports it)
            selection=AssetSelection.assets(epochs).without_checks() | AssetSelection.checks(*epochs.check_keys),
            tags={PIPELINE_TAG: deployment.name, **RUN_RETRY_TAGS},
            executor_def=EPOCH_EXECUTOR,
            description=epochs_job_description(deployment),
        )
        export, export_job = state_export_asset(deployment, tables.settings())
        assets.append(export)
        jobs.extend([job, cut_job(deployment), rescale_job(deployment, tables.settings()), migrate_job(deployment, tables.settings()),
                     export_job])
        sensors.append(epoch_sensor(deployment, job, frozenset(upstream)))
        if deployment.cron:
            schedules.append(epoch_schedule(deployment, job))
    return Definitions(
        assets=assets,
        asset_checks=checks,
        jobs=jobs,
        sensors=sensors,
        schedules=schedules,
        resources={"volley_spark": spark, "volley_checkpoints": checkpoints, "volley_tables": tables},
        executor=executor,
    )


def epochs_job_description(deployment: Deployment) -> str:
    return (f"Runs epochs of {deployment.name!r} in order, one partition per epoch (a range in one run), then the "
            "pipeline's checks. The sensor and schedule launch it; by hand, launch it or any of the pipeline's assets "
            f"over cut epochs (`dg launch --job {epochs_job_name(deployment.name)} --partition <epoch>`; "
            f"`{cut_job_name(deployment.name)}` cuts and registers them): selecting some assets runs the whole "
            "epoch, as the state and every table commit together. Committed epochs are no-ops; an epoch whose "
            "predecessor is not committed fails naming it.")
