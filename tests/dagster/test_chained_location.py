"""Two pipelines chained in one code location, on a real DagsterInstance: the refunds
join (its Iceberg changelog) feeding refunds per merchant per hour. The downstream
pipeline's source asset is the upstream's table asset, so the graph runs source ->
state -> table -> state -> table; the downstream sensor cuts once the upstream
commits, its hours equal the window reference fed the rows its epochs recorded (every
row of the join's table, once), and a re-run of its past epochs over a range reads the
versions they recorded and commits nothing new."""

from __future__ import annotations

import shutil
from dataclasses import replace

from dagster import AssetKey, DagsterInstance
from deltalake import DeltaTable

from tests.chain_reference import assert_hourly_refunds_equal_reference
from tests.dagster.conftest import ROOT
from tests.dagster.daemon import tick_sensor
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.merchant_refunds import merchant_refunds_deployment, merchant_refunds_pipeline
from volley_dagster.demo.refunds import refunds_deployment, write_refund_logs

CHANGELOG = AssetKey(["refunds", "iceberg_refund_changes"])
DOWNSTREAM_STATE = AssetKey(["merchant_refunds", "state"])
HOURS = AssetKey(["merchant_refunds", "delta_refund_hours"])


def test_the_downstream_pipeline_reads_the_upstream_table_asset_and_runs_when_it_commits(spark, tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    upstream = replace(refunds_deployment(tmp_path / "streams"), max_wait_s=None)
    downstream = replace(merchant_refunds_deployment(), max_wait_s=None)
    tables = TablesResource(warehouse=str(tmp_path / "tables"))
    defs = build_definitions([upstream, downstream],
                             checkpoints=CheckpointResource(root=str(tmp_path / "state"), max_records_per_epoch=2_000),
                             tables=tables, spark=SparkResource())

    graph = defs.resolve_asset_graph()
    assert set(graph.get(DOWNSTREAM_STATE).parent_keys) == {CHANGELOG}
    mapping = graph.get_partition_mapping(DOWNSTREAM_STATE, CHANGELOG)
    assert type(mapping).__name__ == "AllPartitionMapping"  # epoch N of one pipeline is not epoch N of the other
    assert DOWNSTREAM_STATE in graph.get(CHANGELOG).child_keys
    assert not graph.has(AssetKey(["merchant_refunds", "source"]))  # the table is the source's asset

    with DagsterInstance.from_config(str(home)) as instance:
        quiet = tick_sensor(defs, instance, "merchant_refunds_new_data")  # no table yet: waits, no error
        assert not quiet.run_requests, quiet.skip_reason

        write_refund_logs(tmp_path / "streams", 4, 300)
        for round_ in range(2):
            up = tick_sensor(defs, instance, "refunds_new_data")
            assert up.run_requests
            for request in up.run_requests:
                job = defs.resolve_job_def(request.job_name)
                assert job.execute_in_process(instance=instance, partition_key=request.partition_key,
                                              tags=request.tags).success
            down = tick_sensor(defs, instance, "merchant_refunds_new_data")  # cut once the refunds committed
            assert len(down.run_requests) == 1, down.skip_reason
            request = down.run_requests[0]
            assert defs.resolve_job_def(request.job_name).execute_in_process(
                instance=instance, partition_key=request.partition_key, tags=request.tags).success
            if round_ == 0:
                write_refund_logs(tmp_path / "streams", 4, 300, first_file=4)  # past the first hour

        materialized = {r.asset_materialization.partition: r.asset_materialization.metadata
                        for r in instance.fetch_materializations(DOWNSTREAM_STATE, limit=10).records}
        assert sorted(materialized) == [epoch_key(1), epoch_key(2)]
        assert all(m["records_in"].value > 0 for m in materialized.values())
        hours = DeltaTable(str(tmp_path / "tables" / "delta" / "merchant_refund_hours"))
        version, rows = hours.version(), hours.to_pyarrow_table().num_rows
        # every row of the join's table read once, and the hours equal the window reference fed what each epoch read
        runner = EpochRunner(merchant_refunds_pipeline(tables.settings()), tmp_path / "state" / "merchant_refunds")
        assert assert_hourly_refunds_equal_reference(runner, tables.settings(), end_of_stream=False) == rows > 0

        # a backfill over the past epochs reads what they recorded: nothing new is committed
        tags = {"dagster/asset_partition_range_start": epoch_key(1), "dagster/asset_partition_range_end": epoch_key(2)}
        assert defs.resolve_job_def("merchant_refunds_epochs_job").execute_in_process(
            instance=instance, tags=tags).success
        hours = DeltaTable(str(tmp_path / "tables" / "delta" / "merchant_refund_hours"))
        assert (hours.version(), hours.to_pyarrow_table().num_rows) == (version, rows)
