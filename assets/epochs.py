"""A pipeline as Dagster assets: source -> state -> one asset per sink table, all
partitioned by epoch. A thin layer: every decision is the engine's."""

from pathlib import Path
from typing import Optional

from dagster import (
    AssetCheckResult,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetSpec,
    BackfillPolicy,
    DataVersion,
    DynamicPartitionsDefinition,
    MaterializeResult,
    MetadataValue,
    ObserveResult,
    multi_asset,
    multi_asset_check,
    observable_source_asset,
)

from assets.metadata import epoch_metadata, sink_key, sink_kind, sink_location, source_key, state_key
from resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster import ConfigError, EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.deploy import Deployment, TableSettings
from volley_dagster.verify import check_latest_snapshot, check_sink

PIPELINE_TAG = "volley/pipeline"


def epochs_partitions(deployment: Deployment) -> DynamicPartitionsDefinition:
    return DynamicPartitionsDefinition(name=f"{deployment.name}_epochs")


def make_runner(
    deployment: Deployment,
    checkpoints: CheckpointResource,
    tables: TablesResource,
    spark: Optional[SparkResource] = None,
) -> EpochRunner:
    """The engine's runner for this deployment; Spark only starts if ``spark`` is given
    and an epoch is actually processed."""
    pipeline = deployment.build(tables.settings())
    return EpochRunner(
        pipeline,
        Path(checkpoints.root) / pipeline.name,
        spark=spark.session() if spark is not None else None,
        keep_epochs=checkpoints.keep_epochs,
        max_records_per_epoch=checkpoints.max_records_per_epoch,
        snapshot_store=checkpoints.snapshot_store(pipeline.name),
        resident_state=checkpoints.resident_state() or False,
    )


def parse_epoch(key: str) -> int:
    if not key.isdigit():
        raise ConfigError(f"partition key {key!r} is not an epoch number (keys look like {epoch_key(7)})")
    return int(key)


def epoch_assets(deployment: Deployment, spec_settings: TableSettings) -> list:
    """The source, the epochs multi-asset and its checks. ``spec_settings`` only names
    table locations for the asset specs; runs use the resources' settings."""
    pipeline = deployment.build(spec_settings)
    partitions = epochs_partitions(deployment)
    state = state_key(pipeline)

    @observable_source_asset(
        key=source_key(pipeline),
        description=f"The log {pipeline.source_log.uri} that {pipeline.name!r} reads.",
        metadata={"dagster/uri": pipeline.source_log.uri, "format": pipeline.source_log.format},
    )
    def source(checkpoints: CheckpointResource, tables: TablesResource) -> ObserveResult:
        runner = make_runner(deployment, checkpoints, tables)
        last = runner.log.last_cut()
        after = runner.log.offsets(last).end if last else {}
        waiting = runner.pipeline.source_log.available_records(after)
        files = runner.pipeline.source_log.partitions()
        latest = {p or "(root)": infos[-1].path for p, infos in files.items() if infos}
        return ObserveResult(
            data_version=DataVersion(str(sorted(latest.items()))),
            metadata={
                "files": MetadataValue.int(sum(len(v) for v in files.values())),
                "latest_files": MetadataValue.json(latest),
                "records_waiting": MetadataValue.int(waiting),
                "last_cut_epoch": MetadataValue.int(last),
            },
        )

    specs = [
        AssetSpec(
            state,
            deps=[source_key(pipeline)],
            kinds={"spark", "rocksdb"},
            description=f"Keyed state of {pipeline.name!r} after each epoch (RocksDB snapshots).",
            metadata={"initial_shards": pipeline.layout.num_shards, "key_groups": pipeline.layout.num_key_groups,
                      "key": pipeline.key_column},
        )
    ] + [
        AssetSpec(
            sink_key(pipeline, sink),
            deps=[state],
            kinds={sink_kind(sink)},
            description=f"{sink_kind(sink).title()} table written by sink {sink.name!r}, one commit per epoch.",
            metadata=sink_location(sink),
        )
        for sink in pipeline.sinks
    ]

    @multi_asset(
        name=f"{pipeline.name}_epochs",
        specs=specs,
        partitions_def=partitions,
        backfill_policy=BackfillPolicy.single_run(),
        can_subset=False,
        op_tags={PIPELINE_TAG: pipeline.name},
    )
    def epochs(
        context: AssetExecutionContext, spark: SparkResource, checkpoints: CheckpointResource, tables: TablesResource
    ):
        """Runs the partitions' epochs in ascending order on one SparkSession; committed
        epochs come back as no-ops, and an epoch whose predecessor is not committed
        fails naming it."""
        runner = make_runner(deployment, checkpoints, tables, spark)
        for key in sorted(context.partition_keys, key=parse_epoch):
            result = runner.run(parse_epoch(key))
            for asset_key, metadata in epoch_metadata(runner.pipeline, result).items():
                context.add_asset_metadata(metadata, asset_key=asset_key, partition_key=key)
            verb = "was already committed" if result.already_committed else "committed"
            context.log.info(f"epoch {result.epoch} {verb}: {result.records_in} records in, {result.records_out} out")
        # Metadata went per partition above; one result per asset covers the run's partitions.
        return tuple(MaterializeResult(asset_key=spec.key) for spec in specs)

    check_specs = [AssetCheckSpec("snapshot_checksums", asset=state)] + [
        AssetCheckSpec(name, asset=sink_key(pipeline, sink))
        for sink in pipeline.sinks
        for name in ("recorded_epoch", "no_duplicate_epochs", "row_counts")
    ]

    @multi_asset_check(specs=check_specs, name=f"{pipeline.name}_consistency")
    def checks(checkpoints: CheckpointResource, tables: TablesResource):
        runner = make_runner(deployment, checkpoints, tables)
        outcome = check_latest_snapshot(runner)
        yield AssetCheckResult(asset_key=state, check_name=outcome.name, passed=outcome.passed,
                               description=outcome.description, metadata=outcome.metadata)
        for sink in runner.pipeline.sinks:
            for outcome in check_sink(runner, sink):
                yield AssetCheckResult(asset_key=sink_key(runner.pipeline, sink), check_name=outcome.name,
                                       passed=outcome.passed, description=outcome.description,
                                       metadata=outcome.metadata)

    return [source, epochs, checks]
