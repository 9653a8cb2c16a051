"""``<pipeline>_migrate_job``: after a deploy changed a pipeline's aggregates (or a
window's allowed lateness), rewrite its state for the pipeline this code location
now builds, between two epochs, instead of starting over.

One op over the engine's ``EpochRunner.migrate``, in the pipeline's concurrency pool
and holding its lease, like the rescale job. Until it runs, the epochs runs of the
changed pipeline fail with ``StateLayoutError``, naming this job.
"""

from typing import Optional

from dagster import AssetObservation, Config, JobDefinition, MetadataValue, OpExecutionContext, job, op

from volley_dagster.dagster.epochs import EPOCH_EXECUTOR, PIPELINE_TAG, RUN_RETRY_TAGS, make_runner
from volley_dagster.dagster.keys import PipelineKeys
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.dagster.runs import pipeline_pool
from volley_dagster.deploy import Deployment, TableSettings
from volley_dagster.pipeline import Pipeline


class MigrateConfig(Config):
    renames: dict[str, str] = {}  # recorded accumulator name -> its name in the new pipeline
    initial: dict[str, float] = {}  # an added sum_ that starts from 0 for existing keys (default: null)
    num_shards: Optional[int] = None  # also rescale


def migrate_job(deployment: Deployment, spec_settings: TableSettings) -> JobDefinition:
    pipeline = deployment.build(spec_settings)  # only its name and the state asset's key
    tags = {PIPELINE_TAG: pipeline.name}

    @op(name=f"{pipeline.name}_migrate", tags=tags, pool=pipeline_pool(pipeline.name))
    def migrate(context: OpExecutionContext, config: MigrateConfig, volley_spark: SparkResource,
                volley_checkpoints: CheckpointResource, volley_tables: TablesResource) -> None:
        """Rewrites the last committed epoch's state for the pipeline as this code
        location builds it now; the next epoch runs it. Refused, naming the options,
        for a change state cannot follow and while an epoch is cut but not committed."""
        runner = make_runner(deployment, volley_checkpoints, volley_tables, volley_spark, log=context.log.info)
        target: Pipeline = runner.pipeline
        with runner.lease(owner=f"dagster run {context.run.run_id}", notify=context.log.info):
            result = runner.migrate(target, renames=config.renames, initial=dict(config.initial),
                                    num_shards=config.num_shards)
        context.log.info(result.describe())
        rewrite = result.rewrite
        context.log_event(AssetObservation(
            asset_key=PipelineKeys.of(deployment).state,
            description=result.describe(),
            metadata={
                "changes": MetadataValue.json(result.changes),
                "migrated_epoch": MetadataValue.int(rewrite.epoch),
                "from_epoch": MetadataValue.int(rewrite.from_epoch),
                "shards": MetadataValue.int(rewrite.new_shards),
                "keys": MetadataValue.int(rewrite.keys),
                "seconds": MetadataValue.float(rewrite.seconds),
                "noop": MetadataValue.bool(result.noop),
            },
        ))

    @job(name=f"{pipeline.name}_migrate_job", tags={**tags, **RUN_RETRY_TAGS}, executor_def=EPOCH_EXECUTOR,
         # a killed migration left the old layout
         description=f"Rewrite the state of {pipeline.name!r} for its changed pipeline between two epochs.")
    def migrate_pipeline() -> None:
        migrate()

    return migrate_pipeline
