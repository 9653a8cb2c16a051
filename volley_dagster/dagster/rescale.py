"""``<pipeline>_rescale_job``: change a pipeline's shard count between two epochs.

One op, configured with ``num_shards``, over the engine's ``EpochRunner.rescale``
(no Spark). The op is in the pipeline's concurrency pool, so the instance
(``dagster.yaml``) never runs it next to an epoch run of the same pipeline, and it
holds the pipeline's lease while it rewrites the state.
"""

from dagster import AssetObservation, Config, JobDefinition, MetadataValue, OpExecutionContext, job, op

from volley_dagster.dagster.epochs import EPOCH_EXECUTOR, PIPELINE_TAG, RUN_RETRY_TAGS, make_runner
from volley_dagster.dagster.keys import PipelineKeys
from volley_dagster.dagster.resources import CheckpointResource, TablesResource
from volley_dagster.dagster.runs import pipeline_pool
from volley_dagster.deploy import Deployment, TableSettings


class RescaleConfig(Config):
    num_shards: int


def rescale_job(deployment: Deployment, spec_settings: TableSettings) -> JobDefinition:
    pipeline = deployment.build(spec_settings)  # only its name and the state asset's key
    tags = {PIPELINE_TAG: pipeline.name}

    @op(name=f"{pipeline.name}_rescale", tags=tags, pool=pipeline_pool(pipeline.name))
    def rescale(
        context: OpExecutionContext, config: RescaleConfig, volley_checkpoints: CheckpointResource,
        volley_tables: TablesResource,
    ) -> None:
        """Rewrites the last committed epoch's state into ``num_shards`` shards; the next
        epoch runs with them. Fails while an epoch is cut but not committed."""
        runner = make_runner(deployment, volley_checkpoints, volley_tables)
        with runner.lease(owner=f"dagster run {context.run.run_id}", notify=context.log.info):
            result = runner.rescale(config.num_shards)
        context.log.info(result.describe())
        context.log_event(AssetObservation(
            asset_key=PipelineKeys.of(deployment).state,
            description=result.describe(),
            metadata={
                "shards": MetadataValue.int(result.new_shards),
                "previous_shards": MetadataValue.int(result.old_shards),
                "rescaled_epoch": MetadataValue.int(result.epoch),
                "from_epoch": MetadataValue.int(result.from_epoch),
                "keys": MetadataValue.int(result.keys),
                "keys_moved": MetadataValue.int(result.keys_moved),
                "bytes_written": MetadataValue.int(result.bytes_written),
                "seconds": MetadataValue.float(result.seconds),
                "noop": MetadataValue.bool(result.noop),
                "layout_history": MetadataValue.text(runner.log.describe_layouts()),
            },
        ))

    @job(name=f"{pipeline.name}_rescale_job", tags={**tags, **RUN_RETRY_TAGS}, executor_def=EPOCH_EXECUTOR,
         # a killed rescale left the old layout
         description=f"Change the shard count of {pipeline.name!r} between two epochs (config: num_shards).")
    def rescale_pipeline() -> None:
        rescale()

    return rescale_pipeline
