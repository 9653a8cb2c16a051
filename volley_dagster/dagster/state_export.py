"""``<pipeline>/state_export``: the state at an epoch as a Delta table, for audits and
reconciliations, with lineage from the state asset. One partition per epoch, in
its own job (``<pipeline>_state_export_job``), never in the epochs runs: reading
state takes no lease, as snapshots are immutable once committed.

The table for epoch N is ``<warehouse>/state_exports/<pipeline>/epoch-<N>``, written
once (``spark/delta_export.py``); materializing the partition again finds it and
reports it, as an epoch re-run does.
"""

from typing import Any

import pyarrow as pa
from dagster import (
    AssetExecutionContext,
    AssetsDefinition,
    MaterializeResult,
    MetadataValue,
    asset,
    define_asset_job,
)
from deltalake import DeltaTable

from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.epochs import EPOCH_EXECUTOR, epochs_partitions, make_runner, parse_epoch
from volley_dagster.dagster.keys import PipelineKeys
from volley_dagster.dagster.metadata import column_schema
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.deploy import Deployment, TableSettings
from volley_dagster.errors import ConfigError
from volley_dagster.spark.delta_export import export_to_delta


def export_uri(warehouse: str, pipeline: str, epoch: int) -> str:
    return f"{warehouse.rstrip('/')}/state_exports/{pipeline}/epoch-{epoch_key(epoch)}"


def state_export_asset(deployment: Deployment, spec_settings: TableSettings) -> tuple[AssetsDefinition, Any]:
    pipeline = deployment.build(spec_settings)  # its name and the state asset's key

    @asset(
        key=PipelineKeys.of(deployment).export,
        deps=[PipelineKeys.of(deployment).state],
        partitions_def=epochs_partitions(deployment),
        kinds={"spark", "delta"},
        group_name=pipeline.name,
        owners=list(deployment.assets.owners),
        tags=dict(deployment.assets.tags),
        code_version=deployment.assets.code_version,
        description=f"The keyed state of {pipeline.name!r} at an epoch, exported to a Delta table.",
    )
    def state_export(context: AssetExecutionContext, volley_spark: SparkResource, volley_checkpoints: CheckpointResource,
                     volley_tables: TablesResource) -> MaterializeResult:
        """Reads the state at the partition's epoch in Spark tasks (one per shard) and
        writes it as a new Delta table; the epoch must be committed and retained."""
        epoch = parse_epoch(context.partition_key)
        runner = make_runner(deployment, volley_checkpoints, volley_tables, volley_spark, log=context.log.info)
        uri = export_uri(volley_tables.warehouse, pipeline.name, epoch)
        description = f"state of {pipeline.name!r} at epoch {epoch} (lineage {runner.log.lineage().id})"
        exported = not DeltaTable.is_deltatable(uri)
        if exported:
            export_to_delta(runner.state_tables().at(epoch), uri, description)
        table = DeltaTable(uri)  # opened once: what was just written, or what an earlier run wrote
        if table.metadata().description != description:
            raise ConfigError(f"{uri} holds a Delta table that is not this pipeline's export of epoch {epoch} "
                              f"({table.metadata().description!r}); move it away and materialize again")
        if not exported:
            context.log.info(f"epoch {epoch}'s state was already exported to {uri}")
        rows, version, again = table.to_pyarrow_dataset().count_rows(), table.version(), not exported
        schema = pa.schema(table.schema().to_arrow())
        return MaterializeResult(metadata={
            "epoch": MetadataValue.int(epoch),
            "dagster/uri": MetadataValue.path(uri),
            "dagster/row_count": MetadataValue.int(rows),
            "delta_table_version": MetadataValue.int(version),
            "noop_already_exported": MetadataValue.bool(again),
            "dagster/column_schema": column_schema(schema),
        })

    job = define_asset_job(f"{pipeline.name}_state_export_job", selection=[PipelineKeys.of(deployment).export],
                           executor_def=EPOCH_EXECUTOR,
                           description=f"Export the state of {pipeline.name!r} at an epoch to a Delta table.")
    return state_export, job
