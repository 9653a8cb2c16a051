"""The sensor observes a source when data landed in it (its data version changed),
not when an epoch is cut or committed: sensor observations are runless events, which
no pruning of runs removes, so they must grow with the data, not with the ticks.
Dagster 1.13 offers no way to delete some runless events of an asset (``wipe_asset``
only hides them, ``wipe_asset_partitions`` is not implemented for SQL storage, and
``delete_events("")`` would remove every runless event of the instance). A real
SQLite DagsterInstance; the commits are written directly, without Spark."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from datetime import datetime, timezone

from dagster import AssetKey, AssetObservation

from tests.dagster.conftest import build_location
from tests.dagster.daemon import tick_sensor
from tests.helpers import channels
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import payments_deployment
from volley_dagster.deploy import Deployment
from volley_dagster.result import EpochResult

SOURCE = AssetKey(["payments", "source"])


def observed(result) -> list[AssetObservation]:
    return [e for e in result.asset_events if isinstance(e, AssetObservation)]


def commit_cut_epochs(log: EpochLog, pipeline: str) -> None:
    """What the runs would leave: every cut epoch committed."""
    for epoch in range(log.last_committed() + 1, log.last_cut() + 1):
        log.write_manifest(EpochResult(pipeline, epoch, {}, 0, 0, 0, 0, 0, 0, 0, 0, {}, {}, {"total": 0.0},
                                       committed_at=datetime.now(timezone.utc).isoformat()))


def test_the_source_is_observed_when_data_lands_not_when_epochs_commit(tmp_path):
    deployment = replace(payments_deployment(tmp_path / "events"), min_records=1, max_wait_s=None)
    log = EpochLog(tmp_path / "state" / "payments")
    with ExitStack() as stack:
        defs, instance, _ = build_location(deployment, tmp_path, stack)
        generate(tmp_path / "events", 1, 500, 50)
        landed = tick(defs, instance)
        (first,) = observed(landed)
        assert first.metadata["records_uncommitted"].value == 500 and first.metadata["epochs_waiting"].value == 1
        cursor, versions = landed.cursor, [first.tags["dagster/data_version"]]
        for _ in range(3):  # each epoch commits, nothing lands: nothing to observe
            commit_cut_epochs(log, "payments")
            result = tick(defs, instance, cursor)
            cursor = result.cursor
            assert not observed(result)
        for i in range(1, 3):  # a file lands: observed once, on the tick that sees it, with its new version
            generate(tmp_path / "events", 1, 500, 50, first_file=i)
            result = tick(defs, instance, cursor)
            (again,) = observed(result)
            versions.append(again.tags["dagster/data_version"])
            commit_cut_epochs(log, "payments")
            cursor = tick(defs, instance, result.cursor).cursor
        assert len(set(versions)) == 3
        assert len(instance.fetch_observations(SOURCE, limit=100).records) == 3  # one per landing, in the instance


def test_of_several_sources_only_the_one_where_data_landed_is_observed(tmp_path):
    deployment = Deployment(name="channels", build=lambda tables: channels(tmp_path), min_records=10_000)
    generate(tmp_path / "web", 1, 500, 50)
    generate(tmp_path / "store", 1, 300, 50, seed=8)
    with ExitStack() as stack:
        defs, instance, _ = build_location(deployment, tmp_path, stack)

        def tick_channels(cursor: str | None = None):
            return tick_sensor(defs, instance, "channels_new_data", cursor)

        first = tick_channels()
        assert {e.asset_key for e in observed(first)} == {AssetKey(["channels", "source_web"]),
                                                          AssetKey(["channels", "source_store"])}
        assert not observed(quiet := tick_channels(first.cursor))
        generate(tmp_path / "store", 1, 300, 50, seed=9, first_file=1)
        (store,) = observed(tick_channels(quiet.cursor))
        assert store.asset_key == AssetKey(["channels", "source_store"]) and store.metadata["records_waiting"].value == 600


def tick(defs, instance, cursor: str | None = None):
    return tick_sensor(defs, instance, "payments_new_data", cursor)
