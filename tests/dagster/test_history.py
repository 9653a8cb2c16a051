"""The instance's history stays bounded at any age of a pipeline, on a real
DagsterInstance: a tick removes the partitions of committed epochs older than the
last ``partitions_kept`` and the runs that materialized them; the epochs after them
stay materialized, and the epoch log keeps everything."""

from __future__ import annotations

from dataclasses import replace

from dagster import AssetKey, DagsterRunStatus, DynamicPartitionsDefinition

from tests.dagster.test_location import range_of, run_range, tick
from volley_dagster.checkpoint.epoch_log import EpochLog, epoch_key
from volley_dagster.dagster.runs import pool_runs
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import payments_deployment

STATE = AssetKey(["payments", "state"])


def test_old_partitions_and_their_runs_are_removed_and_the_rest_stays(location_for, tmp_path):
    deployment = replace(payments_deployment(tmp_path / "events"), min_records=1, max_wait_s=None, partitions_kept=2)
    defs, instance, base = location_for(deployment)
    cursor = None
    for i in range(4):  # four epochs, one run each
        generate(base / "events", 1, 1_000, 200, first_file=i)
        result = tick(defs, instance, cursor)
        cursor = result.cursor
        assert [range_of(r) for r in result.run_requests] == [(epoch_key(i + 1), epoch_key(i + 1))]
        assert run_range(defs, instance, i + 1).success
    tick(defs, instance, cursor)  # each tick prunes what fell out of the window since the last
    assert instance.get_dynamic_partitions("payments_epochs") == [epoch_key(3), epoch_key(4)]
    runs = pool_runs(instance, "payments", list(DagsterRunStatus))
    assert sorted(r.dagster_run.tags["dagster/asset_partition_range_start"] for r in runs) == [epoch_key(3), epoch_key(4)]
    status = instance.get_status_by_partition(STATE, [epoch_key(3), epoch_key(4)], DynamicPartitionsDefinition(name="payments_epochs"))
    assert {k: v.value for k, v in status.items()} == {epoch_key(3): "MATERIALIZED", epoch_key(4): "MATERIALIZED"}
    log = EpochLog(base / "state" / "payments")
    assert log.epochs_cut() == [1, 2, 3, 4] and all(log.is_committed(e) for e in (1, 2, 3, 4))  # the history stays
