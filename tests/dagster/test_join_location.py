"""The demo's join deployment under Dagster: both logs are assets feeding the epochs'
state, which feeds both tables (the demo's own code location shows it); a range run
commits epochs whose pairs and unrefunded payments land in the Delta table once, with
the join's figures and each side's watermark on the state asset."""

from __future__ import annotations

import importlib
from dataclasses import replace

from dagster import AssetKey
from deltalake import DeltaTable

from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.payments import local_tables
from volley_dagster.demo.refunds import refunds_deployment, refunds_pipeline, write_refund_logs
from volley_dagster.settings import RunSettings

STATE = AssetKey(["refunds", "state"])
SOURCES = {AssetKey(["refunds", "source_payments"]), AssetKey(["refunds", "source_refunds"])}
JOINED = AssetKey(["refunds", "delta_refunds"])


def test_the_demo_location_shows_the_join_from_both_logs_to_its_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("VOLLEY_DEMO_DIR", str(tmp_path))
    monkeypatch.setenv("VOLLEY_DEMO_SENSORS", "stopped")
    import assets
    import definitions

    importlib.reload(assets)
    graph = importlib.reload(definitions).defs.resolve_asset_graph()
    assert set(graph.get(STATE).parent_keys) == SOURCES
    assert {JOINED, AssetKey(["refunds", "iceberg_refund_changes"])} <= set(graph.get(STATE).child_keys)


def test_join_epochs_as_partitions(location_for, tmp_path):
    defs, instance, base = location_for(replace(refunds_deployment(tmp_path / "streams"), max_wait_s=None))
    write_refund_logs(base / "streams", 3, 800)
    runner = EpochRunner(refunds_pipeline(base / "streams", local_tables(base / "tables")),
                         base / "state" / "refunds", RunSettings(max_records_per_epoch=2_000))
    epochs = [runner.cut_next().epoch for _ in range(2)]  # type: ignore[union-attr]
    instance.add_dynamic_partitions("refunds_epochs", [epoch_key(e) for e in epochs])
    tags = {"dagster/asset_partition_range_start": epoch_key(epochs[0]),
            "dagster/asset_partition_range_end": epoch_key(epochs[-1])}
    assert defs.resolve_job_def("refunds_epochs_job").execute_in_process(instance=instance, tags=tags).success

    state = {r.asset_materialization.partition: r.asset_materialization.metadata
             for r in instance.fetch_materializations(STATE, limit=10).records}
    joined = {r.asset_materialization.partition: r.asset_materialization.metadata
              for r in instance.fetch_materializations(JOINED, limit=10).records}
    for epoch in epochs:
        shown, result = state[epoch_key(epoch)], runner.result(epoch)
        assert shown["join_pairs"].value == result.figures["join_pairs"] > 0
        assert shown["join_left_rows"].value == result.figures["join_left_rows"]
        sides = [shown[f"watermark_{side}"].value for side in ("payments", "refunds")]
        assert shown["watermark"].value == min(sides)  # each side's watermark, the join's the lesser
        assert joined[epoch_key(epoch)]["dagster/partition_row_count"].value == result.records_out
    table = DeltaTable(str(base / "tables" / "delta" / "payment_refunds")).to_pyarrow_table()
    assert table.num_rows == sum(runner.result(e).records_out for e in epochs)
