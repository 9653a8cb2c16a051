"""``payments_state_export_job`` on a real DagsterInstance: it exports the state at a
partition's epoch to a Delta table that equals the reference, with lineage from
the state asset, and a second materialization finds the table and reports it. The
epochs run previews the state's top keys on the state asset."""

from __future__ import annotations

from dataclasses import replace

from dagster import AssetKey
from deltalake import DeltaTable

from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, payments_deployment, payments_pipeline
from volley_dagster.settings import RunSettings

STATE, EXPORT = AssetKey(["payments", "state"]), AssetKey(["payments", "state_export"])
PER_FILE, KEYS = 2_000, 300


def test_the_export_job_writes_the_state_at_an_epoch_to_delta(location_for, tmp_path):
    defs, instance, base = location_for(replace(payments_deployment(tmp_path / "events"), max_wait_s=None,
                                                state_preview_by="total"))
    generate(base / "events", 2, PER_FILE, KEYS)
    runner = EpochRunner(payments_pipeline(base / "events", local_tables(base / "tables")), base / "state" / "payments", RunSettings(max_records_per_epoch=PER_FILE))
    for _ in range(2):
        runner.cut_next()
    instance.add_dynamic_partitions("payments_epochs", [epoch_key(1), epoch_key(2)])
    tags = {"dagster/asset_partition_range_start": epoch_key(1), "dagster/asset_partition_range_end": epoch_key(2)}
    assert defs.resolve_job_def("payments_epochs_job").execute_in_process(instance=instance, tags=tags).success
    top = instance.get_latest_materialization_event(STATE).asset_materialization.metadata["top_keys"].value
    expected = reference_state(log_records(2, PER_FILE, KEYS)).sort_values("total", ascending=False)
    assert top.splitlines()[0].startswith("| merchant_id | key_group | total |")
    assert f"| {expected['merchant_id'].iloc[0]} |" in top.splitlines()[2]  # the largest total first

    job = defs.resolve_job_def("payments_state_export_job")
    assert STATE in defs.get_repository_def().asset_graph.get(EXPORT).parent_keys  # lineage: state -> export
    first = job.execute_in_process(instance=instance, partition_key=epoch_key(1))
    assert first.success
    (materialization,) = first.asset_materializations_for_node("payments__state_export")
    md = materialization.metadata
    uri = md["dagster/uri"].value
    assert uri.endswith("state_exports/payments/epoch-0000000001") and md["noop_already_exported"].value is False
    exported = DeltaTable(uri).to_pyarrow_table()
    assert md["dagster/row_count"].value == exported.num_rows
    columns = ["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]
    epoch_1 = reference_state(log_records(1, PER_FILE, KEYS).slice(0, runner.result(1).records_in))
    assert_state_equal(exported.select(columns), epoch_1[columns])

    again = job.execute_in_process(instance=instance, partition_key=epoch_key(1))
    (materialization,) = again.asset_materializations_for_node("payments__state_export")
    assert materialization.metadata["noop_already_exported"].value is True
    assert DeltaTable(uri).version() == md["delta_table_version"].value  # not written twice
