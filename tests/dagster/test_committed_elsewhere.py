"""Epochs committed outside Dagster (the CLI, the API, ``./dev demo``) show as
materialized once the sensor registers them as partitions: a first-time user who ran
the demo sees its epochs in the UI, not "never materialized"."""

from __future__ import annotations

from dagster import AssetKey, AssetMaterialization

from tests.dagster.conftest import payments_cutting_at_3000
from tests.dagster.test_location import tick
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.dagster.epochs import make_runner
from volley_dagster.demo.events import generate

STATE = AssetKey(["payments", "state"])
DELTA = AssetKey(["payments", "delta_balances"])


def test_epochs_committed_outside_dagster_show_as_materialized(location):
    defs, instance, base = location
    resources = defs.resources
    generate(base / "events", 3, 1_000, 200)
    runner = make_runner(payments_cutting_at_3000(base), resources["volley_checkpoints"], resources["volley_tables"],
                         resources["volley_spark"])
    committed = runner.run_available()  # as the CLI does: no Dagster run
    assert [r.epoch for r in committed] == [1, 2]  # 3,000 records, at most 2,000 an epoch

    reported = [e for e in tick(defs, instance).asset_events if isinstance(e, AssetMaterialization)]
    for event in reported:  # as the sensor daemon stores what a tick returns
        instance.report_runless_asset_event(event)
    for asset in (STATE, DELTA):
        records = instance.fetch_materializations(asset, limit=10, ascending=True).records
        shown = {r.asset_materialization.partition: r.asset_materialization.metadata for r in records}
        assert sorted(shown) == [epoch_key(1), epoch_key(2)], asset
        assert all(md["committed_outside_dagster"].value is True for md in shown.values())
    states = {r.asset_materialization.partition: r.asset_materialization.metadata
              for r in instance.fetch_materializations(STATE, limit=10).records}
    assert [states[epoch_key(e)]["records_in"].value for e in (1, 2)] == [r.records_in for r in committed]

    again = tick(defs, instance)  # the partitions exist now: nothing is reported twice
    assert not [e for e in again.asset_events if isinstance(e, AssetMaterialization)]
