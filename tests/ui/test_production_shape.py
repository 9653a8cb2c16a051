"""Dagster's production shape (issue 77, point 4), not ``dagster dev``: run, event log and
schedule storage on PostgreSQL (``dagster-postgres``); ``dagster-daemon run`` and
``dagster-webserver`` as processes of their own; the code location (``location.py``,
its sensor running) served by ``dagster api grpc``, which the workspace names by host
and port; the queued run coordinator with the pipeline's pool and the rest of what
``volley dagster-instance`` prints; Dagster's default run launcher (the code server
starts each run: ``harness/dagster_production.py`` says why not the warm one); and
every run's Spark on the suite's standalone cluster, whose master listens on a veth
pair's address and whose second worker sits in a network namespace of its own
(``tests/conftest.py``'s ``spark_cluster``).

Files land and the sensor cuts epochs and requests their runs; a run worker is killed
with ``kill -9`` in its shard stage, and its epochs commit with nobody acting (the code
server marks the run failed, Dagster's run retries re-run it). Then, the sensor
switched off as the UI's toggle does, a partition backfill launched as the UI's dialog
does (GraphQL) runs the next epochs and skips a committed one. The tables equal the
reference (``tests/helpers``) and the soak's oracle (``harness/soak_oracle.py``), each
epoch once. About 5 minutes: the deep lane."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, DefaultRunLauncher, RunsFilter
from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

from harness import soak_oracle as oracle
from harness.dagster_production import DagsterProduction, dagster_production
from harness.postgres import Postgres
from harness.processes import proc_ancestors
from harness.soak import recorded_epochs
from harness.spark_cluster import SparkCluster
from tests.engine.cluster_worker import CONF
from tests.ui.test_self_healing import (
    EPOCH_ASSETS,
    KEYS,
    PER_FILE,
    assert_tables_equal_reference,
    kill_9,
    run_logs,
    run_worker_in_shard_stage,
    runner_for,
    wait_for,
)
from volley_dagster.checkpoint.epoch_log import epoch_key
from volley_dagster.checkpoint.lease import current_holder
from volley_dagster.dagster.runs import instance_problems, pipeline_pool, pool_runs, run_in_flight
from volley_dagster.demo.events import generate
from volley_dagster.sinks.iceberg import sqlite_catalog

pytestmark = pytest.mark.deep

UI = Path(__file__).resolve().parent
ROOT = UI.parents[1]
LANDED, LATER = 4, 2  # files the sensor's runs commit (one run killed); files the backfill commits
SENSOR = "payments_new_data"
HEAL_WITHIN_S = 300


@pytest.fixture
def production(tmp_path: Path, postgres: Postgres,
               spark_cluster: SparkCluster) -> Iterator[tuple[DagsterProduction, Path]]:
    # each run is a Spark application of the cluster, its driver reached at the veth address
    spark = {**CONF, "spark.driver.host": spark_cluster.host, "spark.driver.bindAddress": spark_cluster.host}
    env = {"VOLLEY_TEST_BASE": str(tmp_path), "VOLLEY_TEST_SENSOR": "1",
           "VOLLEY_TEST_SPARK_MASTER": spark_cluster.master_url, "VOLLEY_TEST_SPARK_CONFIG": json.dumps(spark)}
    with dagster_production(UI / "location.py", postgres, home=tmp_path / "dagster_home", working_directory=ROOT,
                            env=env) as srv:
        yield srv, tmp_path


def cluster_apps(cluster: SparkCluster) -> set[str]:
    """Every application the master knows, running or ended."""
    state = cluster.state()
    return {app["id"] for app in state["activeapps"] + state["completedapps"]}


def test_production_shape_heals_a_killed_run_and_backfills(production: tuple[DagsterProduction, Path],
                                                            spark_cluster: SparkCluster) -> None:
    srv, base = production
    state = base / "state" / "payments"
    runner = runner_for(base)
    apps_before = cluster_apps(spark_cluster)
    with srv.instance() as instance:  # the shape itself
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
        assert isinstance(instance.run_launcher, DefaultRunLauncher)
        assert instance_problems(instance, "payments") == []  # queued coordinator, pool of one, retries, monitoring
    assert not list(srv.home.rglob("*.db")), "no SQLite storage beside PostgreSQL"

    # 1. files land; the sensor cuts and requests runs; one run worker is killed mid-epoch
    started = time.time()

    def land() -> None:
        for i in range(LANDED):
            generate(base / "events", 1, PER_FILE, KEYS, first_file=i)
            time.sleep(3)

    lander = threading.Thread(target=land)
    lander.start()
    try:
        victim = wait_for(lambda: run_worker_in_shard_stage(state), 300, "a run in its shard stage", srv)
        holder = current_holder(state)
        assert holder is not None and holder.pid == victim
        killed_run = holder.owner.removeprefix("dagster run ")
        assert srv.code_server.pid in proc_ancestors(victim), "the code server started the run worker"
        kill_9(victim)
    finally:
        lander.join()
    wait_for(lambda: runner.records_waiting() == 0 and runner.committed_epoch() == runner.log.last_cut() > 0,
             HEAL_WITHIN_S, "every epoch to commit after the kill", srv)
    assert_tables_equal_reference(runner, LANDED)
    with srv.instance() as instance:
        wait_for(lambda: run_in_flight(instance, "payments") is None, 120, "the last run to end", srv)
        killed = instance.get_run_by_id(killed_run)
        assert killed is not None and killed.status == DagsterRunStatus.FAILURE, killed
        said = "\n".join(e.message for e in instance.all_logs(killed_run))  # an engine event has no user message
        assert f"[DagsterApiServer] Run execution process for {killed_run} was terminated by signal 9" in said, said
        retries = instance.get_run_records(RunsFilter(tags={"dagster/parent_run_id": killed_run}))
        assert [r.dagster_run.status for r in retries] == [DagsterRunStatus.SUCCESS], "run retries re-ran it"
        runs = pool_runs(instance, "payments", list(DagsterRunStatus), created_after=started)
        print("runs:", [(r.dagster_run.run_id[:8], r.dagster_run.status.value,
                         r.dagster_run.tags.get("dagster/retry_number")) for r in reversed(runs)])
        assert all({"dagster/sensor_name", "dagster/parent_run_id"} & set(r.dagster_run.tags) for r in runs), \
            "nobody launched a run: the sensor did, or a run retry"
        assert_queued_in_pool(instance, [r.dagster_run.run_id for r in runs])
        assert_runs_in_shape(instance, [r.dagster_run.run_id for r in runs], spark_cluster)

    # 2. the sensor switched off, the next epochs run by a partition backfill, as from the UI
    srv.client.stop_sensor(SENSOR)
    wait_for(lambda: (s := srv.client.sensor_state(SENSOR))["status"] == "STOPPED" and
             all(t["status"] != "STARTED" for t in s["ticks"]), 60, "the sensor's last tick to end", srv)
    committed = runner.committed_epoch()
    for i in range(LANDED, LANDED + LATER):
        generate(base / "events", 1, PER_FILE, KEYS, first_file=i)
    while runner.cut_next() is not None:  # as the sensor would have
        pass
    last = runner.log.last_cut()
    assert last > committed
    keys = [epoch_key(e) for e in range(committed, last + 1)]  # the last committed epoch too: skipped
    for key in keys:
        srv.client.add_dynamic_partition("payments_epochs", key, exist_ok=True)  # the UI's "Add partition"
    backfill = srv.client.launch_partition_backfill(EPOCH_ASSETS, keys)
    done = srv.client.wait_backfill(backfill, timeout=300, until="runs")
    assert done.succeeded, (done, srv.logtail())
    assert runner.committed_epoch() == last
    latest = srv.client.latest_materializations("payments/state")
    assert {latest[k]["run_id"] for k in keys[1:]} <= set(done.run_ids), "the backfill committed the new epochs"
    with srv.instance() as instance:
        wait_for(lambda: run_in_flight(instance, "payments") is None, 120, "the backfill's run to end", srv)
        assert_queued_in_pool(instance, done.run_ids)
        assert_runs_in_shape(instance, done.run_ids, spark_cluster)

    # 3. the tables: the reference from the generated records, and the oracle from the recorded ranges
    assert_tables_equal_reference(runner, LANDED + LATER)
    tables = base / "tables"
    verdict = oracle.check_payments(base / "events", [s for _, s in recorded_epochs(state)],
                                    oracle.delta_table(str(tables / "delta" / "merchant_balances"), None),
                                    oracle.iceberg_table(sqlite_catalog(tables / "iceberg"), "payments.merchant_changes"))
    assert verdict.passed, verdict
    print("oracle:", "; ".join(verdict.checks))
    # every run was an application of the cluster, with executors on both workers, the namespace's one too
    apps = cluster_apps(spark_cluster) - apps_before
    assert apps
    for worker in spark_cluster.workers:
        assert apps & {d.name for d in worker.work_dir.glob("app-*")}, f"no executor of these runs on worker {worker.index}"


def assert_queued_in_pool(instance: DagsterInstance, run_ids: list[str]) -> None:
    """Each run went through the queue, in the pipeline's pool (and no other)."""
    for run_id in run_ids:
        run = instance.get_run_by_id(run_id)
        assert run is not None and run.run_op_concurrency is not None, run_id
        assert run.run_op_concurrency.all_pools == {pipeline_pool("payments")}, run.run_op_concurrency
        assert instance.all_logs(run_id, of_type=DagsterEventType.RUN_ENQUEUED), run_id


def assert_runs_in_shape(instance: DagsterInstance, run_ids: list[str], cluster: SparkCluster) -> None:
    """Each successful run ran on the cluster and passed every check it ran."""
    for run_id in run_ids:
        run = instance.get_run_by_id(run_id)
        if run is None or run.status != DagsterRunStatus.SUCCESS:
            continue
        assert f"Spark: {cluster.master_url}" in run_logs(instance, run_id)
        checks = [e.dagster_event.event_specific_data for e in instance.all_logs(run_id)
                  if e.is_dagster_event and e.dagster_event.event_type_value == "ASSET_CHECK_EVALUATION"]
        assert checks and all(c.passed for c in checks), [(c.check_name, c.description) for c in checks]
