"""Epochs cut and run by hand, as a team without a sensor does from the command line:
the cut job cuts what waits and registers the partitions, then a launch of one asset
of the pipeline over a partition (``dg launch --assets payments/state --partition K``,
the implicit asset job with a selection) commits the whole epoch, every table with it."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
from dagster import AssetKey
from deltalake import DeltaTable

from tests.dagster.conftest import build_location, payments_cutting_at_3000
from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster.checkpoint.epoch_log import EpochLog, epoch_key
from volley_dagster.demo.events import generate

STATE = AssetKey(["payments", "state"])
DELTA = AssetKey(["payments", "delta_balances"])
ICEBERG = AssetKey(["payments", "iceberg_changes"])
KEYS = 200
COLUMNS = ["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory, spark):
    base = tmp_path_factory.mktemp("by_hand")
    with ExitStack() as stack:
        defs, instance, _ = build_location(payments_cutting_at_3000(base), base, stack)
        generate(base / "events", 2, 2_000, KEYS)  # 4,000 records: two epochs of 2,000 (max_records_per_epoch)
        cut = defs.resolve_job_def("payments_cut_job").execute_in_process(instance=instance)
        assets = defs.resolve_implicit_global_asset_job_def()
        state_alone = assets.execute_in_process(instance=instance, partition_key=epoch_key(1), asset_selection=[STATE])
        generate(base / "events", 1, 1_000, KEYS, first_file=2)
        again = defs.resolve_job_def("payments_cut_job").execute_in_process(instance=instance)
        table_alone = assets.execute_in_process(instance=instance, partition_key=epoch_key(2), asset_selection=[DELTA])
        yield base, instance, cut, state_alone, again, table_alone, assets


def test_the_cut_job_cuts_what_waits_and_registers_the_partitions(by_hand):
    base, instance, cut, _, again, _, _ = by_hand
    assert cut.success and again.success
    assert instance.get_dynamic_partitions("payments_epochs") == [epoch_key(e) for e in (1, 2, 3)]
    log = EpochLog(base / "state" / "payments")
    assert [log.offsets(e).records for e in (1, 2, 3)] == [2_000, 2_000, 1_000]  # min_records does not hold it back
    md = next(e.event_specific_data.metadata for e in cut.all_events if e.event_type_value == "STEP_OUTPUT")
    assert md["epochs_cut"].value == 2 and md["last_cut_epoch"].value == 2 and md["partitions_registered"].value == 2
    said = [e.user_message for e in instance.all_logs(cut.run_id) if "registered" in e.user_message]
    assert said == ["payments: cut epochs 1..2; registered 2 partition(s); epochs 1..2 wait to run: the sensor "
                    "requests them, or run `dg launch --job payments_epochs_job --partition-range "
                    "0000000001...0000000002`"]


def test_launching_the_state_alone_commits_the_epoch_and_every_table(by_hand):
    base, instance, _, state_alone, _, _, _ = by_hand
    assert state_alone.success
    materialized = {e.asset_key for e in state_alone.all_events if e.event_type_value == "ASSET_MATERIALIZATION"
                    for e in [e.event_specific_data.materialization]}
    assert materialized == {STATE, DELTA, ICEBERG}  # one epoch, one commit of all of them
    checks = {(e.event_specific_data.asset_key, e.event_specific_data.check_name)
              for e in state_alone.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"}
    assert checks == {(STATE, "snapshot_checksums"), (STATE, "epochs_progress"), (STATE, "freshness")}  # the selected


def test_launching_a_table_alone_commits_the_next_epoch_exactly(by_hand):
    base, instance, _, _, _, table_alone, assets = by_hand
    assert table_alone.success
    balances = DeltaTable(str(base / "tables" / "delta" / "merchant_balances")).to_pyarrow_table()
    assert_state_equal(balances.select(COLUMNS), reference_state(log_records(2, 2_000, KEYS))[COLUMNS])
    early = assets.execute_in_process(instance=instance, partition_key=epoch_key(3), asset_selection=[ICEBERG],
                                      raise_on_error=False)
    assert early.success  # epoch 3 follows the committed 2
    assert EpochLog(base / "state" / "payments").last_committed() == 3
