"""A pipeline of two stateful operators (the refunds join, then the hourly window over
its pairs: ``demo/merchant_refunds.hourly_refunds_pipeline``) in a code location, on a
real DagsterInstance: one asset group, source -> state -> table, as any pipeline; each
run of the sensor's runs every stage of its epochs; the state asset's metadata shows
each stage's figures (``stage1_*``) beside the last one's and the Spark jobs of the
chain; the hours equal the references composed; a re-run of the committed epochs over
a range commits nothing new."""

from __future__ import annotations

import shutil
from dataclasses import replace

from dagster import AssetKey, DagsterInstance
from deltalake import DeltaTable

from tests.dagster.conftest import ROOT
from tests.dagster.daemon import tick_sensor
from tests.engine.test_chain import _ComposedReference, _hours
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.location import build_definitions
from volley_dagster.dagster.resources import CheckpointResource, SparkResource, TablesResource
from volley_dagster.demo.merchant_refunds import hourly_refunds_pipeline
from volley_dagster.demo.payments import demo_deployment
from volley_dagster.demo.refunds import write_refund_logs

STATE = AssetKey(["hourly_refunds", "state"])
HOURS = AssetKey(["hourly_refunds", "delta_hourly_refunds"])


def test_a_chain_runs_as_one_asset_group_whose_metadata_shows_every_stage(spark, tmp_path):
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    streams = tmp_path / "streams"
    deployment = replace(demo_deployment("hourly_refunds", lambda t: hourly_refunds_pipeline(streams, t)),
                         max_wait_s=None)
    tables = TablesResource(warehouse=str(tmp_path / "tables"))
    defs = build_definitions([deployment], tables=tables, spark=SparkResource(),
                             checkpoints=CheckpointResource(root=str(tmp_path / "state"), max_records_per_epoch=1_500))
    graph = defs.resolve_asset_graph()
    assert set(graph.get(STATE).parent_keys) == {AssetKey(["hourly_refunds", f"source_{side}"]) for side in ("payments", "refunds")}
    assert STATE in graph.get(HOURS).parent_keys

    with DagsterInstance.from_config(str(home)) as instance:
        write_refund_logs(streams, 6, 300)
        for round_ in range(2):
            tick = tick_sensor(defs, instance, "hourly_refunds_new_data")
            assert tick.run_requests, tick.skip_reason
            for request in tick.run_requests:
                assert defs.resolve_job_def(request.job_name).execute_in_process(
                    instance=instance, partition_key=request.partition_key, tags=request.tags).success
            if round_ == 0:
                write_refund_logs(streams, 6, 300, first_file=6)  # past the first hours
        runner = EpochRunner(hourly_refunds_pipeline(streams, tables.settings()), tmp_path / "state" / "hourly_refunds")
        committed = runner.committed_epoch()
        assert committed >= 3 and runner.stage_runners()[0].committed_epoch() == committed
        materialized = {r.asset_materialization.partition: r.asset_materialization.metadata
                        for r in instance.fetch_materializations(STATE, limit=50).records}
        assert sorted(materialized) == [epoch_key(n) for n in range(1, committed + 1)]
        for metadata in materialized.values():  # the join's figures beside the window's, and the chain's jobs
            assert metadata["stage1_records_in"].value == metadata["records_in"].value > 0
            assert metadata["chain_spark_jobs"].value > metadata["spark_jobs"].value >= 1
            assert "stage1_join_pairs" in metadata and "windows_fired" in metadata

        reference = _ComposedReference()
        for epoch in range(1, committed + 1):
            reference.epoch(runner, streams, epoch)
        expected = {row[:6] for rows in reference.hours(end_of_stream=False).fired.values() for row in rows}
        table = DeltaTable(str(tmp_path / "tables" / "delta" / "hourly_refunds"))
        assert _hours(table.to_pyarrow_table()) == expected and table.to_pyarrow_table().num_rows == len(expected) > 0

        version = table.version()  # a range re-run of the committed epochs: every stage holds them, nothing moves
        job = defs.resolve_job_def("hourly_refunds_epochs_job")
        assert job.execute_in_process(instance=instance, tags={
            "dagster/asset_partition_range_start": epoch_key(1),
            "dagster/asset_partition_range_end": epoch_key(committed)}).success
        assert DeltaTable(str(tmp_path / "tables" / "delta" / "hourly_refunds")).version() == version
