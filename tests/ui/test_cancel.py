"""A run canceled from the UI mid-epoch, under a real ``dagster dev`` with the shipped
``dagster.yaml`` and the sensor running (as ``./dev dagster``): the UI's own GraphQL
mutation (``terminateRuns``, its default safe policy) cancels the run while its shard
tasks work; nobody acts after that. The sensor requests the epochs again under a new
run key, they commit, the tables equal the reference, and the committing run's
``epochs_progress`` check names the canceled run (review H1: the run key was reused
and Dagster skipped it, so the epoch waited for a new cut). It starts a ``dagster dev``
and the warm Spark (``tests/ui/location.py``, its code location)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from dagster import DagsterRunStatus

from harness.dagster_dev import dagster_dev
from tests.ui.test_self_healing import assert_tables_equal_reference, runner_for, wait_for
from volley_dagster.checkpoint.lease import current_holder
from volley_dagster.dagster.runs import pool_runs, run_in_flight
from volley_dagster.demo.events import generate

UI = Path(__file__).resolve().parent
ROOT = UI.parents[1]
KEYS, PER_FILE = 200, 1_000
FILES = 4  # 4,000 records: three epochs of at most 1,500 (the location's cut), one run
TERMINATE = """
mutation Terminate($runIds: [String!]!) {
  terminateRuns(runIds: $runIds, terminatePolicy: SAFE_TERMINATE) {
    __typename
    ... on TerminateRunsResult {
      terminateRunResults { __typename ... on TerminateRunFailure { message } ... on PythonError { message } }
    }
    ... on PythonError { message }
  }
}"""


def running_in_shard_stage(instance, state: Path) -> str | None:
    """The pipeline's started run while its attempt's shard RocksDBs are open (under ``work/``)."""
    holder = current_holder(state)
    if holder is None or holder.released_at is not None or not any((state / "work").glob("*/shard-*")):
        return None
    started = pool_runs(instance, "payments", [DagsterRunStatus.STARTED], limit=1)
    return started[0].dagster_run.run_id if started else None


# deep: a minute; the default lane covers a canceled run requested again under a new key and its epoch
# committed (tests/dagster/test_recovery.py, test_run_keys.py) on a real instance, without the browser
@pytest.mark.deep
def test_a_run_canceled_from_the_ui_mid_epoch_is_run_again_and_commits(tmp_path: Path) -> None:
    env = {"VOLLEY_TEST_BASE": str(tmp_path), "VOLLEY_TEST_SENSOR": "1", "VOLLEY_TEST_WARM": "1",
           "VOLLEY_TEST_BACKOFF": "2,4,1"}  # first_s, max_s, retries_in_run: the shipped shape, scaled down
    with dagster_dev(UI / "workspace.yaml", dagster_yaml=ROOT / "dagster.yaml", home=tmp_path / "dagster_home",
                     overrides={"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}}, env=env) as srv:
        state = tmp_path / "state" / "payments"
        generate(tmp_path / "events", FILES, PER_FILE, KEYS)
        with srv.instance() as instance:
            run_id = wait_for(lambda: running_in_shard_stage(instance, state), 240, "a run in its shard stage", srv)
            answer = srv.client.execute(TERMINATE, {"runIds": [run_id]})["terminateRuns"]
            assert answer["__typename"] == "TerminateRunsResult", answer
            assert [r["__typename"] for r in answer["terminateRunResults"]] == ["TerminateRunSuccess"], answer
            wait_for(lambda: instance.get_run_by_id(run_id).status == DagsterRunStatus.CANCELED, 60,
                     "the run to be canceled", srv)
            canceled_at = time.monotonic()
            runner = runner_for(tmp_path)
            wait_for(lambda: runner.committed_epoch() == runner.log.last_cut() >= 3 and runner.records_waiting() == 0,
                     180, "every epoch to commit", srv)
            print(f"committed {time.monotonic() - canceled_at:.1f}s after the cancel")
            assert_tables_equal_reference(runner, FILES)
            wait_for(lambda: run_in_flight(instance, "payments") is None, 60, "the last run to end", srv)
            runs = pool_runs(instance, "payments", list(DagsterRunStatus))
            keys = [r.dagster_run.tags.get("dagster/run_key") for r in runs]
            assert len(set(keys)) == len(keys)  # each request its own key
            committing = next(r for r in runs if r.dagster_run.status == DagsterRunStatus.SUCCESS)
            checks = [e.dagster_event.event_specific_data for e in instance.all_logs(committing.dagster_run.run_id)
                      if e.is_dagster_event and e.dagster_event.event_type_value == "ASSET_CHECK_EVALUATION"]
            (progress,) = [c for c in checks if c.check_name == "epochs_progress"]
            assert progress.passed and progress.metadata["canceled_runs"].value == 1, progress.description
            assert f"1 canceled (the newest {run_id})" in progress.description
