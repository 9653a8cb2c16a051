"""The code location on a real DagsterInstance: sensor-cut epochs, ordered
single-run backfills, the ordering guard, hand-made partition keys, asset checks.

One scenario runs once per module (the runs are the slow part); each test checks
one behaviour of it."""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetKey,
    AssetObservation,
    DagsterInstance,
    Definitions,
    build_sensor_context,
)
from deltalake import DeltaTable

from tests.dagster.conftest import build_location, payments_cutting_at_3000
from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster.checkpoint.epoch_log import EpochLog, epoch_key
from volley_dagster.dagster.launcher.workers import run_worker_pid
from volley_dagster.dagster.runs import FAILURE_KIND, permanent_failure
from volley_dagster.demo.events import generate

STATE = AssetKey(["payments", "state"])
DELTA = AssetKey(["payments", "delta_balances"])
ICEBERG = AssetKey(["payments", "iceberg_changes"])
KEYS = 300
COLUMNS = ["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]


def tick(defs, instance: DagsterInstance, cursor: str | None = None):
    with build_sensor_context(instance=instance, cursor=cursor, resources=defs.resources, definitions=defs) as ctx:
        result = defs.resolve_sensor_def("payments_new_data")(ctx)
    for req in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
    return result


def range_of(request) -> tuple[str, str]:
    """The epochs a sensor's run request covers."""
    if request.partition_key is not None:
        return request.partition_key, request.partition_key
    return request.tags["dagster/asset_partition_range_start"], request.tags["dagster/asset_partition_range_end"]


def run_range(defs, instance, start: int, end: int | None = None):
    """What a single-run backfill launches: one run over a partition range."""
    job = defs.resolve_job_def("payments_epochs_job")
    tags = {"dagster/asset_partition_range_start": epoch_key(start), "dagster/asset_partition_range_end": epoch_key(end or start)}
    return job.execute_in_process(instance=instance, tags=tags, raise_on_error=False)


def materializations(instance, asset: AssetKey) -> list[tuple[str, dict]]:
    records = instance.fetch_materializations(asset, limit=1000, ascending=True).records
    return [(r.asset_materialization.partition, r.asset_materialization.metadata) for r in records]


def processed(instance, asset: AssetKey, epoch: int) -> dict:
    """The metadata of the run that processed the epoch (not a later no-op over it)."""
    return next(md for p, md in materializations(instance, asset) if p == epoch_key(epoch)
                and not md["noop_already_committed"].value)


def check_results(run) -> dict[tuple[AssetKey, str], bool]:
    """The checks a run of the epochs job evaluated after its epochs."""
    return {(e.asset_check_evaluation_data.asset_key, e.asset_check_evaluation_data.check_name):
            e.asset_check_evaluation_data.passed for e in run.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}


@dataclass
class Scenario:
    defs: Definitions
    instance: DagsterInstance
    base: Path
    ticks: dict[str, Any]
    runs: dict[str, Any]
    delta_after_3: Any
    checks_clean: dict[tuple[AssetKey, str], bool]
    checks_corrupt: dict[tuple[AssetKey, str], bool]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, spark) -> Iterator[Scenario]:
    base = tmp_path_factory.mktemp("location")
    with ExitStack() as stack:
        defs, instance, _ = build_location(payments_cutting_at_3000(base), base, stack)
        ticks, runs = {}, {}
        generate(base / "events", 1, 2_000, KEYS)
        ticks["first"] = tick(defs, instance)  # 2,000 waiting < min_records 3,000
        generate(base / "events", 2, 2_000, KEYS, first_file=1)
        ticks["second"] = tick(defs, instance, ticks["first"].cursor)
        runs["1..2"] = run_range(defs, instance, 1, 2)  # the run the daemon launches for it
        ticks["restarted"] = tick(defs, instance, ticks["second"].cursor)  # a restarted daemon: the same cursor
        generate(base / "events", 1, 2_000, KEYS, first_file=3)
        ticks["third"] = tick(defs, instance, ticks["restarted"].cursor)
        runs["backfill 1..3"] = run_range(defs, instance, 1, 3)  # after epoch 3 was cut
        delta_after_3 = DeltaTable(str(base / "tables" / "delta" / "merchant_balances")).to_pyarrow_table()
        generate(base / "events", 2, 2_000, KEYS, first_file=4)
        ticks["fourth"] = tick(defs, instance, ticks["third"].cursor)
        runs["5 before 4"] = run_range(defs, instance, 5)
        instance.add_dynamic_partitions("payments_epochs", [epoch_key(42)])  # by hand: no recorded offsets
        runs["42"] = run_range(defs, instance, 42)
        # an SST epoch 3 wrote: the per-run check hashes what the epoch changed, the files it
        # shares with epoch 2 (hardlinks) were hashed when they were new
        snapshots = base / "state" / "payments" / "snapshots"
        sst = next(p for p in sorted((snapshots / epoch_key(3)).glob("shard-*/*.sst"))
                   if not any(p.samefile(q) for q in (snapshots / epoch_key(2)).glob("shard-*/*.sst")))
        data = bytearray(sst.read_bytes())
        data[-1] ^= 1
        sst.write_bytes(bytes(data))
        runs["corrupt"] = run_range(defs, instance, 3)  # a no-op over the committed epoch; its checks still run
        ticks["after corrupt"] = tick(defs, instance, ticks["fourth"].cursor)  # epochs 4..5 still wait
        yield Scenario(defs, instance, base, ticks, runs, delta_after_3, check_results(runs["backfill 1..3"]),
                       check_results(runs["corrupt"]))


def test_the_sensor_cuts_once_enough_records_wait_and_requests_one_run(scenario):
    first, second = scenario.ticks["first"], scenario.ticks["second"]
    assert not first.run_requests
    assert [range_of(r) for r in second.run_requests] == [(epoch_key(1), epoch_key(2))]  # 6,000 -> 2,000 + 2,000, one run
    assert all(r.tags["volley/pipeline"] == "payments" for r in second.run_requests)
    assert [range_of(r) for r in scenario.ticks["fourth"].run_requests] == [(epoch_key(4), epoch_key(5))]
    assert scenario.instance.get_dynamic_partitions("payments_epochs")[:5] == [epoch_key(e) for e in range(1, 6)]


def test_a_tick_observes_the_source_and_reports_its_checks_when_they_change(scenario):
    second = scenario.ticks["second"]
    observed = [e for e in second.asset_events if isinstance(e, AssetObservation)]
    assert [e.asset_key for e in observed] == [AssetKey(["payments", "source"])]
    md = {k: v.value for k, v in observed[0].metadata.items()}
    assert md["records_uncommitted"] == 6_000 and md["epochs_waiting"] == 2 and md["last_cut_epoch"] == 2
    assert md["records_waiting"] == 6_000 - sum(
        EpochLog(scenario.base / "state" / "payments").offsets(e).records for e in (1, 2))
    assert md["files_waiting"] == (1 if md["records_waiting"] else 0) and md["oldest_waiting_file_age_s"] >= 0
    first = [e for e in scenario.ticks["first"].asset_events if isinstance(e, AssetCheckEvaluation)]
    assert sorted((e.check_name, e.asset_key.to_user_string(), e.passed) for e in first) == [
        ("epochs_progress", "payments/state", True), ("freshness", "payments/delta_balances", True),
        ("freshness", "payments/iceberg_changes", True), ("freshness", "payments/state", True)]
    assert not [e for e in second.asset_events if isinstance(e, AssetCheckEvaluation)]  # unchanged: not again
    last = scenario.ticks["fourth"].cursor
    for _ in range(2):  # nothing landed, cut or committed since: no observation, however often it ticks
        again = tick(scenario.defs, scenario.instance, last)
        assert not [e for e in again.asset_events if isinstance(e, AssetObservation)]
        last = again.cursor


def test_each_pipeline_is_one_asset_group(scenario):
    graph = scenario.defs.resolve_asset_graph()
    assert {graph.get(k).group_name for k in (STATE, DELTA, ICEBERG, AssetKey(["payments", "source"]))} == {"payments"}


def test_a_range_run_commits_its_epochs_and_a_restarted_sensor_repeats_nothing(scenario):
    assert scenario.runs["1..2"].success
    restarted = scenario.ticks["restarted"]
    assert not restarted.run_requests and "every cut epoch is committed" in restarted.skip_reason.skip_message
    assert [range_of(r) for r in scenario.ticks["third"].run_requests] == [(epoch_key(3), epoch_key(3))]


def test_a_backfill_over_committed_epochs_runs_them_in_order_as_noops(scenario):
    backfill = scenario.runs["backfill 1..3"]
    assert backfill.success
    state_events = materializations(scenario.instance, STATE)
    assert [p for p, _ in state_events[:2]] == [epoch_key(1), epoch_key(2)]  # one event per epoch, as it commits
    in_backfill = dict(state_events[2:5])
    assert {p: m["noop_already_committed"].value for p, m in in_backfill.items()} == {epoch_key(1): True, epoch_key(2): True, epoch_key(3): False}
    messages = [e.user_message for e in scenario.instance.all_logs(backfill.run_id) if e.user_message.startswith("epoch ")]
    assert [m.split(":")[0] for m in messages] == [  # processed in ascending epoch order
        "epoch 1 was already committed", "epoch 2 was already committed", "epoch 3 committed"]
    expected = reference_state(log_records(3, 2_000, KEYS))  # epochs 1..3 hold the first 6,000 records
    assert_state_equal(scenario.delta_after_3.select(COLUMNS), expected[COLUMNS])


def test_each_epoch_carries_its_metadata_on_the_state_and_table_assets(scenario):
    last = processed(scenario.instance, STATE, 3)
    assert last["records_in"].value == 2_000 and last["epoch"].value == 3
    assert last["state_reads"].value == {"resident": last["shards"].value}  # epoch 2's mirror, from another run
    assert isinstance(last["seconds_total"].value, float)
    delta_md = processed(scenario.instance, DELTA, 3)
    assert delta_md["delta_table_version"].value == 2 and delta_md["dagster/uri"].value.endswith("merchant_balances")
    iceberg_md = processed(scenario.instance, ICEBERG, 3)
    assert iceberg_md["dagster/partition_row_count"].value > 0 and iceberg_md["dagster/table_name"].value == "payments.merchant_changes"
    assert [c.name for c in iceberg_md["dagster/column_schema"].schema.columns][:2] == ["merchant_id", "total"]
    # the tables' sizes from their own metadata, and the first rows each epoch wrote
    assert delta_md["dagster/row_count"].value == DeltaTable(str(scenario.base / "tables" / "delta" /
                                                                 "merchant_balances")).to_pyarrow_table().num_rows
    assert iceberg_md["dagster/row_count"].value >= iceberg_md["dagster/partition_row_count"].value > 0
    assert iceberg_md["preview"].value.startswith("| merchant_id | total |")


def test_an_epoch_before_its_predecessor_fails_naming_it_and_commits_nothing(scenario):
    early = scenario.runs["5 before 4"]
    assert not early.success
    failure = [e for e in early.all_events if e.is_failure]
    assert "needs epoch 4 committed first" in str(failure[0].event_specific_data.error)
    assert not (scenario.base / "state" / "payments" / "epochs" / epoch_key(5) / "manifest.json").exists()


def test_a_partition_key_added_by_hand_is_refused_not_run_empty(scenario):
    rogue = scenario.runs["42"]
    assert not rogue.success
    error = str([e for e in rogue.all_events if e.is_failure][0].event_specific_data.error)
    assert "epoch 42 has no recorded offset range" in error


def test_asset_checks_run_after_the_epochs_pass_and_catch_a_corrupted_snapshot(scenario):
    assert len(scenario.checks_clean) == 11 and all(scenario.checks_clean.values()), scenario.checks_clean
    assert {(STATE, "freshness"), (DELTA, "freshness"), (ICEBERG, "freshness")} <= set(scenario.checks_clean)
    failed = [k for k, passed in scenario.checks_corrupt.items() if not passed]
    assert failed == [(STATE, "snapshot_checksums"), (STATE, "epochs_progress")]  # stopped until it passes
    # a blocking check: the run fails once, permanently, naming it; the sensor asks a person
    run = scenario.runs["corrupt"]
    assert not run.success
    (failure,) = [e.event_specific_data.user_failure_data for e in run.all_events if e.is_step_failure]
    assert "blocking checks failed: payments/state snapshot_checksums" in failure.description
    assert failure.metadata[FAILURE_KIND].value == "permanent"
    assert permanent_failure(scenario.instance, run.run_id) == failure.description
    # recorded in the root, so that no tick requests the waiting epochs 4..5 until the checks pass
    after = scenario.ticks["after corrupt"]
    assert not after.run_requests
    message = after.skip_reason.skip_message
    assert f"failed over epochs 3..3 in run {run.run_id}: payments/state snapshot_checksums" in message
    assert "materialize partition 0000000003" in message


def test_the_watchdog_finds_the_process_of_each_run(scenario):
    """What the sensor's watchdog checks before failing an orphaned run: the pid the run
    worker reported (in process here, so this test's own)."""
    assert [run_worker_pid(scenario.instance, run.run_id) for run in scenario.runs.values()] == [os.getpid()] * len(scenario.runs)
