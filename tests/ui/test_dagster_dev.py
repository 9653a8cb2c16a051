"""The product as users meet it: a real ``dagster dev`` on 127.0.0.1, a partition
backfill launched through its GraphQL API (the call the Backfill dialog makes),
then the lineage view, the Partitions tab and a backfill from the UI's own dialog
in headless Chromium. Screenshots land in tests/artifacts/."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.browser import dagster_ui
from harness.dagster_dev import dagster_dev
from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, payments_pipeline
from volley_dagster.settings import RunSettings

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KEYS = 300
EPOCH_ASSETS = ["payments/state", "payments/delta_balances", "payments/iceberg_changes"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    base = tmp_path_factory.mktemp("ui")
    generate(base / "events", 3, 2_000, KEYS)
    # cut four epochs of 1,500 records up front (as the sensor would); no Spark needed
    runner = EpochRunner(payments_pipeline(base / "events", local_tables(base / "tables")), base / "state" / "payments", RunSettings(max_records_per_epoch=1_500))
    assert [runner.cut_next().epoch for _ in range(4)] == [1, 2, 3, 4]
    with dagster_dev(
        HERE / "workspace.yaml",
        dagster_yaml=ROOT / "dagster.yaml",
        overrides={"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}},
        home=base / "dagster_home",
        env={"VOLLEY_TEST_BASE": str(base), "VOLLEY_TEST_WARM": "1"},  # runs share the warm Spark, as ./dev dagster
    ) as srv:
        for epoch in (1, 2, 3, 4):
            srv.client.add_dynamic_partition("payments_epochs", epoch_key(epoch))
        yield srv, base


def test_graphql_backfill_then_ui_backfill(server):
    srv, base = server
    client = srv.client

    backfill = client.launch_partition_backfill(EPOCH_ASSETS, [epoch_key(1), epoch_key(2)])
    done = client.wait_backfill(backfill, timeout=300, until="runs")
    assert done.succeeded, (done, srv.logtail())
    state = client.latest_materializations("payments/state")
    assert sorted(state) == [epoch_key(1), epoch_key(2)]
    assert state[epoch_key(2)]["metadata"]["records_in"] == 1_500
    assert state[epoch_key(2)]["metadata"]["noop_already_committed"] is False
    assert isinstance(state[epoch_key(2)]["metadata"]["seconds_total"], float)
    delta = client.latest_materializations("payments/delta_balances")[epoch_key(2)]["metadata"]
    assert delta["delta_table_version"] == 1 and delta["dagster/partition_row_count"] > 0

    with dagster_ui(srv.url, artifacts_prefix="dagster_dev-") as ui:
        ui.open_lineage(group="payments", expect=["source", "state", "delta_balances", "iceberg_changes"])
        ui.screenshot("lineage")
        assert {"source", "state", "delta_balances", "iceberg_changes"} <= set(ui.lineage_labels())

        ui.open_partitions_tab(["payments", "state"])
        assert ui.wait_partition_counts(Materialized=2, Missing=2)["Materialized"] == 2
        detail = ui.select_partition(epoch_key(2))
        assert detail["metadata"]["records_in"].replace(",", "") == "1500"
        ui.screenshot("partitions-before")

        # epochs 1..4 from the UI's dialog: 1 and 2 are no-ops, 3 and 4 commit, in order
        from_ui = ui.launch_backfill(["payments", "state"], [epoch_key(e) for e in (1, 2, 3, 4)])
        finished = client.wait_backfill(from_ui, timeout=300, until="runs")
        assert finished.succeeded, (finished, srv.logtail())
        ui.open_partitions_tab(["payments", "state"])
        assert ui.wait_partition_counts(Materialized=4, Missing=0)["Materialized"] == 4
        ui.screenshot("partitions-after")

    latest = client.asset_materializations("payments/state")
    by_partition = {m["partition"]: m["metadata"] for m in latest[-4:]}
    assert {p: md["noop_already_committed"] for p, md in by_partition.items()} == {
        epoch_key(1): True, epoch_key(2): True, epoch_key(3): False, epoch_key(4): False}
    runner = EpochRunner(payments_pipeline(base / "events", local_tables(base / "tables")),
                         base / "state" / "payments")
    assert runner.committed_epoch() == 4
    expected = reference_state(log_records(3, 2_000, KEYS))[
        ["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]]
    assert_state_equal(runner.pipeline.sinks[0].read().select(list(expected.columns)), expected)
