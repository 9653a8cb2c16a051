"""A team's own processor (``Pipeline.process``) under Dagster: epochs as partitions,
the processor's figures (rows in and out, timers fired, state rows, timers pending)
on the state asset, its alerts on the Delta table's materializations."""

from __future__ import annotations

from dataclasses import replace

from dagster import AssetKey
from deltalake import DeltaTable

from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables
from volley_dagster.demo.velocity import velocity_deployment, velocity_pipeline
from volley_dagster.settings import RunSettings

STATE = AssetKey(["velocity", "state"])
ALERTS = AssetKey(["velocity", "delta_alerts"])


def test_processor_epochs_as_partitions_show_its_figures(location_for, tmp_path):
    defs, instance, base = location_for(replace(velocity_deployment(tmp_path / "events"), max_wait_s=None))
    generate(base / "events", 2, 2_000, 200, events_per_second=20, disorder_s=5)
    runner = EpochRunner(velocity_pipeline(base / "events", local_tables(base / "tables")),
                         base / "state" / "velocity", RunSettings(max_records_per_epoch=2_000))
    epochs = [runner.cut_next().epoch for _ in range(2)]  # type: ignore[union-attr]
    instance.add_dynamic_partitions("velocity_epochs", [epoch_key(e) for e in epochs])
    tags = {"dagster/asset_partition_range_start": epoch_key(epochs[0]),
            "dagster/asset_partition_range_end": epoch_key(epochs[-1])}
    assert defs.resolve_job_def("velocity_epochs_job").execute_in_process(instance=instance, tags=tags).success

    state = {r.asset_materialization.partition: r.asset_materialization.metadata
             for r in instance.fetch_materializations(STATE, limit=10).records}
    alerts = {r.asset_materialization.partition: r.asset_materialization.metadata
              for r in instance.fetch_materializations(ALERTS, limit=10).records}
    for epoch in epochs:
        shown, result = state[epoch_key(epoch)], runner.result(epoch)
        for figure in ("process_rows_in", "process_rows_out", "process_timers_fired", "process_state_rows",
                       "process_timers_pending"):
            assert shown[figure].value == result.figures[figure], figure
        assert shown["process_rows_in"].value == 2_000 - result.late_records
        assert alerts[epoch_key(epoch)]["dagster/partition_row_count"].value == result.records_out
    assert sum(runner.result(e).figures["process_timers_fired"] for e in epochs) > 0
    table = DeltaTable(str(base / "tables" / "delta" / "velocity_alerts")).to_pyarrow_table()
    assert table.num_rows == sum(runner.result(e).records_out for e in epochs) > 0
