"""An enriched pipeline in the code location, on a real DagsterInstance: the dimension
table is an upstream asset of the state (lineage source + dimension -> state ->
tables), and each epoch's state materialization reports the version it read and the
records without a match, as the engine recorded them."""

from __future__ import annotations

from dagster import AssetKey
from deltalake import write_deltalake

from tests.helpers import enriched_payments, merchants_table
from volley_dagster import EpochRunner
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables
from volley_dagster.deploy import Deployment
from volley_dagster.settings import RunSettings

STATE, DIMENSION = AssetKey(["payments_enriched", "state"]), AssetKey(["payments_enriched", "dimension_merchants"])
PER_FILE, KEYS = 2_000, 300


def test_the_dimension_is_upstream_of_the_state_and_each_epoch_reports_its_version(location_for, tmp_path):
    deployment = Deployment("payments_enriched", lambda tables: enriched_payments(tmp_path / "events", tmp_path / "out"))
    defs, instance, base = location_for(deployment)
    graph = defs.get_repository_def().asset_graph
    assert graph.get(STATE).parent_keys == {AssetKey(["payments_enriched", "source"]), DIMENSION}
    assert graph.get(DIMENSION).is_external

    generate(base / "events", 2, PER_FILE, KEYS)
    write_deltalake(base / "merchants", merchants_table(KEYS, 0))
    runner = EpochRunner(deployment.build(local_tables(base / "tables")), base / "state" / "payments_enriched", RunSettings(max_records_per_epoch=PER_FILE))
    runner.cut_next()
    write_deltalake(base / "merchants", merchants_table(KEYS, 1), mode="overwrite")
    runner.cut_next()
    keys = ["0000000001", "0000000002"]
    instance.add_dynamic_partitions("payments_enriched_epochs", keys)
    tags = {"dagster/asset_partition_range_start": keys[0], "dagster/asset_partition_range_end": keys[1]}
    assert defs.resolve_job_def("payments_enriched_epochs_job").execute_in_process(instance=instance, tags=tags).success

    for epoch, key in enumerate(keys, start=1):
        (event,) = instance.fetch_materializations(STATE, limit=10).records[::-1][epoch - 1:epoch]
        assert event.partition_key == key
        md = event.asset_materialization.metadata
        recorded = runner.result(epoch).enrichments["merchants"]
        assert md["merchants_version"].value == str(epoch - 1) == recorded.version  # pinned at each cut
        assert md["merchants_dropped"].value == recorded.dropped == recorded.unmatched > 0
