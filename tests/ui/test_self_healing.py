"""Operating a pipeline unattended, as a user meets it: a real ``dagster dev`` with the
shipped ``dagster.yaml``, the sensor running and runs on the warm Spark (as
``./dev dagster``), files landing every few seconds, a run worker and the warm Spark's
server killed with ``kill -9`` mid-epoch, and two backfills racing the sensor over the
same epochs. Nobody intervenes; the tables must equal the reference."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from dagster import AssetKey, DagsterRunStatus, RunsFilter

from harness.dagster_dev import dagster_dev
from harness.processes import proc_descendants
from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.checkpoint.lease import current_holder
from volley_dagster.dagster.runs import pool_limit_problem, pool_runs, run_in_flight
from volley_dagster.demo.events import generate
from volley_dagster.demo.payments import local_tables, payments_pipeline
from volley_dagster.spark.warm import WarmSpark, read_record
from volley_dagster.verify import check_sink

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KEYS, PER_FILE = 200, 1_000
LANDED, LATER = 6, 3  # files landing while runs are killed; files for the racing backfills
EPOCH_ASSETS = ["payments/state", "payments/delta_balances", "payments/iceberg_changes"]
HEAL_WITHIN_S = 180


def serve(base: Path):
    return dagster_dev(
        HERE / "workspace.yaml",
        dagster_yaml=ROOT / "dagster.yaml",  # as shipped: pools, run monitoring, run retries
        overrides={"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}},
        home=base / "dagster_home",
        env={"VOLLEY_TEST_BASE": str(base), "VOLLEY_TEST_SENSOR": "1", "VOLLEY_TEST_WARM": "1"},  # as ./dev dagster
    )


@pytest.fixture(scope="module")
def healing(tmp_path_factory):
    base = tmp_path_factory.mktemp("healing")
    with serve(base) as srv:
        yield srv, base


def runner_for(base: Path) -> EpochRunner:
    return EpochRunner(payments_pipeline(base / "events", local_tables(base / "tables")), base / "state" / "payments")


def lease_holder(state: Path) -> int | None:
    """The pid of the run worker holding the pipeline's lease now, if one does. Runs
    are workers forked from the fork server (volley_dagster/dagster/launcher/), or spawned by the code server."""
    holder = current_holder(state)
    return holder.pid if holder is not None and holder.released_at is None else None


def run_worker_in_shard_stage(state: Path) -> int | None:
    """The lease holder while its attempt's shard RocksDBs are open (under ``work/``)."""
    return lease_holder(state) if any((state / "work").glob("*/shard-*")) else None


def warm_spark(base: Path) -> WarmSpark | None:
    """The warm Spark the runs share (``$DAGSTER_HOME/warm-spark``), once it serves."""
    record = read_record(base / "dagster_home" / "warm-spark")
    return record if record is not None and record.url is not None and record.accepting() else None


def run_logs(instance, run_id: str) -> str:
    return "\n".join(e.user_message for e in instance.all_logs(run_id))


def kill_9(pid: int) -> None:
    """The run worker and everything it started (its Spark JVM and Python workers)."""
    for victim in [pid] + proc_descendants(pid):
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_for(predicate, timeout: float, what: str, srv) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{srv.logtail(40)}")
        time.sleep(0.1)


def assert_tables_equal_reference(runner: EpochRunner, files: int) -> None:
    records = log_records(files, PER_FILE, KEYS)
    assert sum(runner.result(e).records_in for e in range(1, runner.committed_epoch() + 1)) == records.num_rows
    expected = reference_state(records)[["merchant_id", "total", "events", "avg_amount", "largest", "last_seen"]]
    assert_state_equal(runner.read_state(), expected)
    delta, iceberg = runner.pipeline.sinks
    assert_state_equal(delta.read().select(list(expected.columns)), expected)  # upsert: the current state
    for sink in (delta, iceberg):  # each epoch once, with its manifest's rows (Iceberg appends every change)
        outcomes = check_sink(runner, sink)
        assert all(o.passed for o in outcomes), [(o.name, o.description) for o in outcomes]


def failure_messages(instance, run_id: str) -> str:
    """What the run's failure events say: their messages and errors."""
    return "\n".join(f"{e.dagster_event.message} {e.dagster_event.event_specific_data or ''}"
                     for e in instance.all_logs(run_id) if e.is_dagster_event and e.dagster_event.is_failure)


def test_kill_9_mid_epoch_heals_without_anyone(healing):
    srv, base = healing
    state = base / "state" / "payments"
    landed_at: list[float] = []

    def land() -> None:
        for i in range(LANDED):
            generate(base / "events", 1, PER_FILE, KEYS, first_file=i)
            landed_at.append(time.monotonic())
            time.sleep(4)

    lander = threading.Thread(target=land)
    lander.start()
    try:
        # moment 1: a run in its shard stage (attempts' RocksDBs open under work/)
        first = wait_for(lambda: run_worker_in_shard_stage(state), 150, "a run in its shard stage", srv)
        kill_9(first)
        # moment 2: the warm Spark itself (its server JVM) dies while a later run works; its supervisor starts another
        server = wait_for(lambda: warm_spark(base), 150, "the warm Spark", srv)
        wait_for(lambda: (h := current_holder(state)) is not None and h.pid != first and h.released_at is None,
                 150, "a later run to hold the lease (its epochs under way)", srv)
        # inside a shard stage, not between two of them: the kill must fail an attempt
        wait_for(lambda: run_worker_in_shard_stage(state) not in (None, first), 150,
                 "a later run in its shard stage", srv)
        os.kill(server.server_pid, signal.SIGKILL)
    finally:
        lander.join()
    last_landed = landed_at[-1]

    runner = runner_for(base)
    wait_for(lambda: runner.records_waiting() == 0 and runner.committed_epoch() == runner.log.last_cut() > 0,
             HEAL_WITHIN_S, "every epoch to commit", srv)
    healed_in = time.monotonic() - last_landed
    print(f"committed everything {healed_in:.1f}s after the last file landed")
    assert healed_in <= HEAL_WITHIN_S
    assert_tables_equal_reference(runner, LANDED)

    with srv.instance() as instance:
        wait_for(lambda: run_in_flight(instance, "payments") is None, 60, "the last run to finish", srv)
        runs = pool_runs(instance, "payments", list(DagsterRunStatus))
        print("runs:", [(r.dagster_run.run_id[:8], r.dagster_run.status.value, r.dagster_run.tags.get("dagster/retry_number"),
                         r.dagster_run.tags.get("dagster/asset_partition_range_start", r.dagster_run.tags.get("dagster/partition")))
                        for r in reversed(runs)])
        failed = [r for r in runs if r.dagster_run.status == DagsterRunStatus.FAILURE]
        assert failed, [(r.dagster_run.run_id, r.dagster_run.status) for r in runs]
        for record in failed:  # the killed run, and none for ordering
            assert "needs epoch" not in failure_messages(instance, record.dagster_run.run_id)
        retried = [r for r in runs if r.dagster_run.tags.get("dagster/retry_number")]
        if not retried:
            # Dagster's retry daemon gives a run up when it cannot create the retry (its code
            # server too slow on a loaded machine): it says so on the run and tags it
            # will_retry=false, and the sensor requests the run's epochs itself (dagster/runs.py)
            gave_up = {r.dagster_run.run_id: run_logs(instance, r.dagster_run.run_id) for r in failed}
            assert any("Failed to retry run" in logs for logs in gave_up.values()), (
                "Dagster neither retried a killed run nor said it could not", gave_up)
        # the server's death failed an attempt inside a run, retried there on the server started in its place
        stepped = [r.dagster_run.run_id for r in runs if any(
            e.is_dagster_event and e.dagster_event.event_type_value == "STEP_UP_FOR_RETRY"
            for e in instance.all_logs(r.dagster_run.run_id))]
        assert stepped, "the warm server's death was retried within its run"
        urls = re.findall(r"warm Spark Connect server at (sc://\S+)", run_logs(instance, stepped[0]))
        assert len(set(urls)) == 2, urls
        assert all(r.dagster_run.status in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE) for r in runs)
        # the runs used the warm Spark, restarted once by its supervisor; each successful run checked everything
        healed = warm_spark(base)
        assert healed is not None and healed.restarts >= 1 and healed.server_pid != server.server_pid
        succeeded = [r.dagster_run.run_id for r in runs if r.dagster_run.status == DagsterRunStatus.SUCCESS]
        assert all("Spark: the warm Spark Connect server at sc://127.0.0.1:" in run_logs(instance, run_id)
                   for run_id in succeeded)
        assert all(any("Forked run worker" in (e.message or "") for e in instance.all_logs(run_id))
                   for run_id in succeeded)  # the launcher's engine event (volley_dagster/dagster/launcher/)
        for run_id in succeeded:
            checks = [e.dagster_event.event_specific_data for e in instance.all_logs(run_id)
                      if e.is_dagster_event and e.dagster_event.event_type_value == "ASSET_CHECK_EVALUATION"]
            assert len(checks) == 11 and all(c.passed for c in checks), [(c.check_name, c.description) for c in checks]
        observed = instance.fetch_observations(AssetKey(["payments", "source"]), limit=1000).records
        landed = len(list((base / "events").glob("*.parquet")))
        assert 1 <= len(observed) <= landed  # the sensor observes the source when data lands, not every tick (H4)
        assert {"records_waiting", "files_waiting", "oldest_waiting_file_age_s"} <= set(
            observed[0].asset_observation.metadata)


def test_two_backfills_and_the_sensor_never_overlap(healing):
    srv, base = healing
    runner = runner_for(base)
    with srv.instance() as instance:
        # the pool's own limit, as Dagster documents it (and ./dev dagster does)
        subprocess.run([sys.executable, "-m", "dagster", "instance", "concurrency", "set", "volley_payments", "1"],
                       env={**os.environ, "DAGSTER_HOME": str(base / "dagster_home")}, check=True, capture_output=True)
        assert pool_limit_problem(instance, "payments") is None
        started = time.time()
        for i in range(LANDED, LANDED + LATER):
            generate(base / "events", 1, PER_FILE, KEYS, first_file=i)
        while runner.cut_next() is not None:  # as the sensor would; whoever cuts first, the ranges are the same
            pass
        first, last = runner.committed_epoch() + 1, runner.log.last_cut()
        keys = [epoch_key(e) for e in range(first, last + 1)]
        for key in keys:
            srv.client.add_dynamic_partition("payments_epochs", key, exist_ok=True)
        backfills = [srv.client.launch_partition_backfill(EPOCH_ASSETS, keys) for _ in range(2)]
        for backfill in backfills:
            done = srv.client.wait_backfill(backfill, timeout=300, until="runs")
            assert done.succeeded, (done, srv.logtail())
        wait_for(lambda: runner.committed_epoch() == last, 120, "the epochs to commit", srv)
        # the run that committed the last epoch still runs its checks; later runs are no-ops
        wait_for(lambda: run_in_flight(instance, "payments") is None, 120, "the runs to finish", srv)

        runs = [r for r in pool_runs(instance, "payments", list(DagsterRunStatus), created_after=started)]
        assert len(runs) >= 2 and all(r.dagster_run.status == DagsterRunStatus.SUCCESS for r in runs), \
            [(r.dagster_run.run_id, r.dagster_run.status) for r in runs]
        spans = sorted((r.start_time, r.end_time) for r in runs)
        for (_, previous_end), (start, _) in zip(spans, spans[1:]):
            assert start >= previous_end, spans  # one run of the pipeline at a time
        backfill_runs = instance.get_run_records(RunsFilter(tags={"dagster/backfill": backfills[1]}))
        assert backfill_runs, "the second backfill ran too (as no-ops, after the first)"
    assert_tables_equal_reference(runner, LANDED + LATER)


def test_a_killed_dagster_dev_heals_after_a_restart(healing):
    """The whole of ``dagster dev`` (webserver, daemons, code server, the run worker and
    its Spark) killed mid-run, as a crashed machine: after a restart, nobody marks the
    run failed but the sensor's watchdog, and its retry commits the epoch."""
    srv, base = healing
    runner = runner_for(base)
    files = len(list((base / "events").glob("*.parquet")))  # the earlier tests' files, if they ran on this server
    state = base / "state" / "payments"
    with srv.instance() as instance:  # the last test's runs finish first: the crash must catch only the new one
        wait_for(lambda: run_in_flight(instance, "payments") is None and lease_holder(state) is None, 120,
                 "the last test's runs to finish", srv)
    committed = runner.committed_epoch()
    since = time.time()  # this test's runs (the first test's killed run may be marked gone alike)
    generate(base / "events", 1, PER_FILE, KEYS, first_file=files)
    wait_for(lambda: runner.log.last_cut() > committed, 120, "the sensor to cut the new epoch", srv)
    victim = wait_for(lambda: lease_holder(state), 120, "the run of the new epoch to hold the lease", srv)
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.stop()  # stragglers outside the group, if any
    assert not Path(f"/proc/{victim}").exists() and runner.committed_epoch() < runner.log.last_cut()

    with serve(base) as again:
        wait_for(lambda: runner.records_waiting() == 0 and runner.committed_epoch() == runner.log.last_cut(),
                 150, "the epoch to commit after the restart", again)
        with again.instance() as instance:
            wait_for(lambda: run_in_flight(instance, "payments") is None, 60, "the last run to finish", again)
            failed = [r for r in pool_runs(instance, "payments", [DagsterRunStatus.FAILURE], created_after=since)
                      if "is gone (killed, or the machine restarted)" in failure_messages(instance, r.dagster_run.run_id)]
            assert len(failed) == 1, "the watchdog marked the killed run failed"
            retries = instance.get_run_records(RunsFilter(tags={"dagster/parent_run_id": failed[0].dagster_run.run_id}))
            assert [r.dagster_run.status for r in retries] == [DagsterRunStatus.SUCCESS]
    assert_tables_equal_reference(runner, files + 1)
