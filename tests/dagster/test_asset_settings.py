"""A team's conventions on our assets: every key under its prefix, its owners, tags and
code version on every asset, and the events the sensor reports keyed the same way.
The freshness bound follows the deployment's cadence when none is set. No Spark."""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import replace

import pytest
from dagster import AssetCheckEvaluation, AssetKey, AssetObservation, DagsterInvalidDefinitionError

from tests.dagster.conftest import build_location, payments_cutting_at_3000
from tests.dagster.test_location import tick
from volley_dagster import ConfigError
from volley_dagster.dagster import CheckpointResource, TablesResource
from volley_dagster.dagster.cadence import cron_period_s, freshness_bound_s
from volley_dagster.dagster.epochs import make_runner
from volley_dagster.demo.events import generate
from volley_dagster.deploy import RUN_ALLOWANCE_S, AssetSettings

TEAM = AssetSettings(key_prefix=("finance", "streams"), owners=("team:payments", "ana@example.com"),
                     tags={"domain": "payments", "tier": "gold"}, code_version="2026.11")
PREFIXED = ["finance", "streams", "payments"]


def test_keys_owners_tags_and_code_version_come_from_the_deployment(tmp_path):
    deployment = replace(payments_cutting_at_3000(tmp_path), assets=TEAM, min_records=1)
    with ExitStack() as stack:
        defs, instance, base = build_location(deployment, tmp_path, stack)
        graph = defs.resolve_asset_graph()
        ours = {key for key in graph.get_all_asset_keys() if key.path[:3] == PREFIXED}
        assert ours == {AssetKey([*PREFIXED, part]) for part in
                        ("source", "state", "delta_balances", "iceberg_changes", "state_export")}
        assert not [key for key in graph.get_all_asset_keys() if key.path[0] == "payments"]  # nothing left unprefixed
        for key in ours:
            node = graph.get(key)
            assert set(node.owners) == set(TEAM.owners), key
            assert {k: v for k, v in node.tags.items() if not k.startswith("dagster/")} == TEAM.tags, key
            if key.path[-1] != "source":  # an external asset has no code of ours
                assert node.code_version == "2026.11", key
        checks = {(c.asset_key, c.name) for c in graph.asset_check_keys}
        assert (AssetKey([*PREFIXED, "state"]), "freshness") in checks
        assert (AssetKey([*PREFIXED, "delta_balances"]), "recorded_epoch") in checks
        assert not graph.get(AssetKey([*PREFIXED, "source"])).is_materializable  # an AssetSpec, observed

        generate(base / "events", 1, 500, 50)
        events = tick(defs, instance).asset_events
        (observed,) = [e for e in events if isinstance(e, AssetObservation)]
        assert observed.asset_key == AssetKey([*PREFIXED, "source"])
        assert observed.metadata["records_waiting"].value == 0 and observed.metadata["files"].value == 1
        assert observed.tags["dagster/data_version"]  # which file is newest: changes when data lands
        evaluations = {(e.asset_key, e.check_name) for e in events if isinstance(e, AssetCheckEvaluation)}
        assert (AssetKey([*PREFIXED, "delta_balances"]), "freshness") in evaluations


def test_a_deployment_whose_pipeline_has_another_name_is_refused(tmp_path):
    deployment = replace(payments_cutting_at_3000(tmp_path), name="payouts")
    with ExitStack() as stack, pytest.raises(ConfigError, match="'payouts' builds a pipeline named 'payments'"):
        build_location(deployment, tmp_path, stack)


def test_a_key_prefix_dagster_refuses_is_named_by_dagster(tmp_path):
    deployment = replace(payments_cutting_at_3000(tmp_path), assets=AssetSettings(key_prefix=("has space",)))
    with ExitStack() as stack, pytest.raises(DagsterInvalidDefinitionError, match="has space"):
        build_location(deployment, tmp_path, stack)


def test_the_freshness_bound_follows_the_cadence_unless_set(tmp_path):
    base = payments_cutting_at_3000(tmp_path)  # the demo's: the sensor every second, the */5 schedule off
    sensor_only = replace(base, sensor_interval_s=30, max_wait_s=60.0)
    assert freshness_bound_s(sensor_only) == 3 * (30 + 60) + RUN_ALLOWANCE_S
    scheduled = replace(sensor_only, sensor_running=False, schedule_running=True, cron="0 * * * *")
    assert freshness_bound_s(scheduled) == 3 * 3_600 + RUN_ALLOWANCE_S
    both = replace(scheduled, sensor_running=True)  # the faster of the two cuts first
    assert freshness_bound_s(both) == 3 * (30 + 60) + RUN_ALLOWANCE_S
    assert freshness_bound_s(replace(scheduled, freshness_bound_s=45.0)) == 45.0  # set: taken as it is
    # a weekday cron's longest wait is the weekend, from Friday 09:00 to Monday 09:00
    assert cron_period_s("0 9 * * 1-5", now=1_795_000_000.0) == 3 * 86_400


def test_a_cluster_sets_how_many_shards_compact_together(tmp_path):
    """The shards that compact their RocksDB in one epoch: a cluster's task slots, set on
    the resource; by default this machine's cores. A group of none is refused by name."""
    deployment = payments_cutting_at_3000(tmp_path)
    tables = TablesResource(warehouse=str(tmp_path / "tables"))
    root = str(tmp_path / "state")
    runner = make_runner(deployment, CheckpointResource(root=root, compact_together=8), tables)
    assert runner.settings.rocksdb.compact_together == 8
    assert [s for s in range(20) if runner.settings.rocksdb.compaction_turn(11, s)] == [8, 9, 10, 11, 12, 13, 14, 15]
    assert make_runner(deployment, CheckpointResource(root=root), tables).settings.rocksdb.compact_together == os.cpu_count()
    assert make_runner(deployment, CheckpointResource(root=root), tables).settings.rocksdb.compact_in_background
    inline = make_runner(deployment, CheckpointResource(root=root, compact_together=8, compact_in_background=False), tables)
    assert not inline.settings.rocksdb.compact_in_background and inline.settings.rocksdb.compact_together == 8
    with pytest.raises(ConfigError, match="compact_together must be at least 1, got 0"):
        make_runner(deployment, CheckpointResource(root=root, compact_together=0), tables)
