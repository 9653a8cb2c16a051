"""Two pipelines chained under a real ``dagster dev``, as a team deploys them: the
refunds join over two logs landing every few seconds, and the refunds per merchant per
hour reading its Iceberg table, both sensors running and the runs on the warm Spark.
A run of each pipeline is killed with ``kill -9`` in its shard stage; nobody acts.
The downstream table must equal the window reference fed exactly the rows its epochs
recorded, which must be every row of the upstream table, each once. The same flow as
one pipeline of both operators (``chain.py``), killed in each stage's shard stage,
must equal the join's and the window's references composed."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from deltalake import DeltaTable

from harness.dagster_dev import dagster_dev
from tests.chain_reference import assert_hourly_refunds_equal_reference
from tests.engine.test_chain import _ComposedReference, _hours
from tests.ui.test_self_healing import kill_9, run_worker_in_shard_stage, wait_for
from volley_dagster import EpochRunner
from volley_dagster.demo.merchant_refunds import hourly_refunds_pipeline, merchant_refunds_pipeline
from volley_dagster.demo.payments import local_tables
from volley_dagster.demo.refunds import refunds_pipeline, write_refund_logs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FILES, PER_FILE = 9, 300  # 90 minutes of payments: the first hours of refunds close
HEAL_WITHIN_S = 240

pytestmark = pytest.mark.deep  # a second dagster dev with two pipelines: tests/ui/test_self_healing.py covers healing


@contextlib.contextmanager
def killed_in_shard_stages(base: Path, chain: str, files: int, roots: list[Path]) -> Iterator[object]:
    """``dagster dev`` serving ``VOLLEY_TEST_CHAIN=chain`` while both logs land a file
    every 4 s; the run holding each of ``roots`` in turn is killed in its shard stage.
    Yields the server, once every kill is done and every file landed."""
    env = {"VOLLEY_TEST_BASE": str(base), "VOLLEY_TEST_SENSOR": "1", "VOLLEY_TEST_WARM": "1", "VOLLEY_TEST_CHAIN": chain}
    with dagster_dev(HERE / "workspace.yaml", dagster_yaml=ROOT / "dagster.yaml",
                     overrides={"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}},
                     home=base / "dagster_home", env=env) as srv:
        def land() -> None:
            for i in range(files):
                write_refund_logs(base / "streams", 1, PER_FILE, first_file=i)
                time.sleep(4)

        lander = threading.Thread(target=land)
        lander.start()
        killed = []
        try:
            for root in roots:
                kill_9(wait_for(lambda r=root: run_worker_in_shard_stage(r), 200, f"a run in {root}'s shard stage", srv))
                killed.append(root)
        finally:
            lander.join()
        assert killed == roots
        yield srv


def test_a_chain_of_two_pipelines_heals_from_a_kill_9_in_each_to_the_reference(tmp_path):
    base = tmp_path
    roots = [base / "state" / "refunds", base / "state" / "merchant_refunds"]
    with killed_in_shard_stages(base, "1", FILES, roots) as srv:
        tables = local_tables(base / "tables")
        upstream = EpochRunner(refunds_pipeline(base / "streams", tables), base / "state" / "refunds")
        downstream = EpochRunner(merchant_refunds_pipeline(tables), base / "state" / "merchant_refunds")
        settled = lambda r: r.records_waiting() == 0 and r.committed_epoch() == r.log.last_cut() > 0  # noqa: E731
        wait_for(lambda: settled(upstream) and settled(downstream), HEAL_WITHIN_S, "both pipelines to commit", srv)
        hours = assert_hourly_refunds_equal_reference(downstream, tables, end_of_stream=False)
        print(f"{downstream.committed_epoch()} epochs of merchant_refunds, {hours} hours equal the reference")
        assert hours > 0


def test_a_chain_in_one_pipeline_heals_from_a_kill_9_in_each_stage_to_the_references(tmp_path):
    base = tmp_path
    root = base / "state" / "hourly_refunds"
    # two hours of files: the join's watermark, less its 30 minutes, closes the first; the join's stage, then the window's
    with killed_in_shard_stages(base, "one", FILES + 3, [root / "stages" / "0", root]) as srv:
        tables = local_tables(base / "tables")
        runner = EpochRunner(hourly_refunds_pipeline(base / "streams", tables), root)
        settled = lambda: runner.records_waiting() == 0 and runner.committed_epoch() == runner.log.last_cut() > 0  # noqa: E731
        wait_for(settled, HEAL_WITHIN_S, "the chain to commit every epoch", srv)
        reference = _ComposedReference()
        for epoch in range(1, runner.committed_epoch() + 1):
            reference.epoch(runner, base / "streams", epoch)
        expected = {row[:6] for rows in reference.hours(end_of_stream=False).fired.values() for row in rows}
        table = DeltaTable(str(base / "tables" / "delta" / "hourly_refunds")).to_pyarrow_table()
        assert _hours(table) == expected and table.num_rows == len(expected) > 0  # each hour once
        print(f"{runner.committed_epoch()} epochs of hourly_refunds, {len(expected)} hours equal the references")
