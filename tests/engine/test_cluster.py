"""The engine on a real Spark standalone cluster (a master and two 1-core workers
from the pyspark package's own jars, harness/spark_cluster.py), driven from its own
process (tests/engine/cluster_worker.py): shard tasks run in executor processes,
results equal the reference, and a worker killed (kill -9, with its executor and
Python workers) while it runs a shard task costs a retry on the other worker,
never a second commit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.processes import proc_ancestors
from harness.spark_cluster import SparkCluster
from tests.engine.cluster_worker import SHARDS
from tests.helpers import assert_epoch_outputs, assert_state_equal, log_records, payments, read_sink, reference_state
from volley_dagster import EpochRunner
from volley_dagster.demo.events import generate
from volley_dagster.faults import PAUSE_DIR_ENV, PAUSE_MAX_ENV
from volley_dagster.settings import RunSettings
from volley_dagster.state.store import verify_snapshot
from volley_dagster.verify import check_latest_snapshot, check_sink

FILES, PER_FILE, KEYS = 4, 1_500, 300
ROOT = Path(__file__).resolve().parents[2]


def start_driver(cluster: SparkCluster, base: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The driver, listening on the cluster's address (``spark_config``'s driver host)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.engine.cluster_worker", cluster.master_url, str(base), str(PER_FILE),
         cluster.host],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[list[dict], str]:
    """The driver's JSON lines (one per committed epoch) and its stderr (Spark's errors)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the driver did not finish in {timeout:.0f}s:\n{err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], err


def assert_exactly_once(base: Path) -> EpochRunner:
    """Epochs 1..FILES committed once each, with state, per-epoch outputs and tables
    equal to the reference computed from the log with pandas."""
    pipeline = payments(base / "events", base / "out", shards=SHARDS, tables=base / "tables")
    runner = EpochRunner(pipeline, base / "state", RunSettings(max_records_per_epoch=PER_FILE))
    assert runner.committed_epoch() == FILES
    assert runner.log.epochs_cut() == list(range(1, FILES + 1))
    records = log_records(FILES, PER_FILE, KEYS)
    final = reference_state(records)
    assert_state_equal(runner.read_state(), final)
    records_in = {e: runner.result(e).records_in for e in range(1, FILES + 1)}
    assert records_in == {e: PER_FILE for e in range(1, FILES + 1)}
    assert_epoch_outputs(read_sink(base / "out"), records, records_in)
    sinks = {s.name: s for s in pipeline.sinks}
    assert_state_equal(sinks["delta"].read(), final)  # upsert: exactly the current state
    appended = sinks["iceberg"].read().to_pandas()  # append: every epoch's rows exactly once
    expected = read_sink(base / "out").drop(columns="epoch")
    key = ["merchant_id", "events"]
    pd.testing.assert_frame_equal(appended.sort_values(key).reset_index(drop=True),
                                  expected.sort_values(key).reset_index(drop=True), check_dtype=False, rtol=1e-9)
    for sink in pipeline.sinks:  # each sink's own history: every epoch once, with the manifest's row count
        failed = [o for o in check_sink(runner, sink) if not o.passed]
        assert not failed, [(o.name, o.description) for o in failed]
        assert sorted(sink.epoch_history("payments")) == list(range(1, FILES + 1))
    assert check_latest_snapshot(runner).passed
    assert not any((base / "state" / "work").iterdir())  # every attempt's working directory is gone
    return runner


def assert_ran_in_executors(lines: list[dict], workers: set[int],
                            killed: dict[int, int] | None = None) -> dict[tuple[int, str], int]:
    """Each shard task ran in a Python worker under an executor JVM under one of
    ``workers`` (Worker JVM pids), none of them the driver or under it. Returns the
    worker pid per (epoch, shard). A Python worker that exited before the driver read its
    ancestors (a task killed when Spark resubmitted a stage ends its worker) has the
    ancestors read when it ran an earlier task; ``killed``: pids the test killed, by
    their Worker's pid."""
    ran_on = {}
    known = {info["task_pid"]: info["ancestors"] for line in lines for info in line["shards"].values()
             if info["ancestors"]}
    for line in lines:
        driver, driver_tree = line["driver_pid"], set(line["driver_descendants"])
        assert driver_tree, "the driver's JVM should be a child of the driver process"
        for shard, info in line["shards"].items():
            pid = info["task_pid"]
            chain = info["ancestors"] or known.get(pid, [])  # [[pid, kind], ...], parent first
            pids, kinds = [a for a, _ in chain], [k for _, k in chain]
            where = f"epoch {line['epoch']} shard {shard}: pid {pid}, ancestors {chain}"
            assert pid != driver and pid not in driver_tree and driver not in pids, where
            if not chain and killed and pid in killed:
                ran_on[(line["epoch"], shard)] = killed[pid]
                continue
            assert kinds.count("executor") == 1, where
            at = kinds.index("executor")  # the executor JVM is a child of a Worker JVM of the cluster
            assert at + 1 < len(pids) and pids[at + 1] in workers and kinds[at + 1] == "worker", where
            ran_on[(line["epoch"], shard)] = pids[at + 1]
    return ran_on


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_snapshots_share_files(lines: list[dict]) -> None:
    """Snapshots on the shared checkpoint root hardlink the SSTs earlier epochs wrote, but
    for a shard that compacted its level 0 first (it shares none)."""
    later = [s for line in lines[1:] for s in line["shards"].values()]
    assert all(s["bytes_new"] < s["bytes_total"] for s in later if not s["compacted"]), later
    assert any(not s["compacted"] for s in later), later


@pytest.mark.deep  # the killed-worker test runs the same epochs on the cluster, and checks them alike
def test_epochs_on_standalone_cluster(spark_cluster: SparkCluster, tmp_path: Path) -> None:
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    t0 = time.monotonic()
    lines, log = finish(start_driver(spark_cluster, tmp_path), timeout=240)
    assert "Lost executor" not in log, log[-3000:]
    elapsed = time.monotonic() - t0
    assert [line["epoch"] for line in lines] == list(range(1, FILES + 1)), lines
    assert all(sorted(line["shards"]) == [str(s) for s in range(SHARDS)] for line in lines)
    workers = {w.pid for w in spark_cluster.workers}
    ran_on = assert_ran_in_executors(lines, workers)
    assert set(ran_on.values()) == workers, f"shard tasks should spread over both workers: {ran_on}"
    assert_exactly_once(tmp_path)
    assert_snapshots_share_files(lines)
    print(f"{FILES} epochs on the cluster in {elapsed:.1f}s (driver start included)")


def test_killed_worker_during_shard_stage(spark_cluster: SparkCluster, tmp_path: Path) -> None:
    epoch, shard = 2, 1
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    pause = tmp_path / "pause"  # on the shared filesystem, like the checkpoint root
    pause.mkdir()
    point = f"shard_after_snapshot-{epoch}-{shard}"
    (pause / f"{point}.armed").touch()  # the first attempt of that shard task stops after its snapshot
    marker = pause / point
    proc = start_driver(spark_cluster, tmp_path, {PAUSE_DIR_ENV: str(pause), PAUSE_MAX_ENV: "120"})
    victim = None
    try:
        deadline = time.monotonic() + 180
        while not (marker.exists() and marker.read_text().strip()):
            if proc.poll() is not None:
                raise AssertionError(f"the driver exited before the pause:\n{proc.stderr.read()[-4000:]}")
            assert time.monotonic() < deadline, "the shard task never reached its pause point"
            time.sleep(0.05)
        paused_pid = int(marker.read_text())
        victim = spark_cluster.worker_of(paused_pid)
        survivor = next(w for w in spark_cluster.workers if w is not victim)
        # the paused attempt snapshotted but holds its working directory open
        attempt_dirs = list((tmp_path / "state" / "work" / f"{epoch:010d}").glob(f"shard-{shard:04d}-*"))
        assert len(attempt_dirs) == 1 and (attempt_dirs[0] / "CURRENT").is_file(), attempt_dirs
        killed_snapshot = f"shard-{shard:04d}-{attempt_dirs[0].name.rsplit('-', 1)[1]}"  # the attempt's own
        assert (tmp_path / "state" / "snapshots" / f"{epoch:010d}" / killed_snapshot).is_dir()
        executors = victim.executor_pids()
        assert set(executors) & set(proc_ancestors(paused_pid)), (executors, proc_ancestors(paused_pid))
        # the stage started once both executors registered: the one inside the network
        # namespace reached the driver at the veth address, where 127.0.0.1 is its own
        assert spark_cluster.netns is not None
        inside = [w for w in spark_cluster.workers if w.index in spark_cluster.netns_workers]
        in_netns = {p for w in inside for p in w.executor_pids()}
        assert in_netns and in_netns <= spark_cluster.netns.pids(), (in_netns, spark_cluster.netns.pids())
        assert not spark_cluster.host.startswith("127."), spark_cluster.host
        t_kill = time.monotonic()
        killed = spark_cluster.kill_worker(victim.index)
        assert paused_pid in killed and set(executors) <= set(killed)
        marker.unlink()  # nothing is left to wake; a retry finds no arming and does not pause
        lines, log = finish(proc, timeout=120)
        recovered = time.monotonic() - t_kill
        lost = [line for line in log.splitlines() if "Lost executor" in line]
        assert lost, f"the driver never noticed the lost executor:\n{log[-3000:]}"
        assert not [pid for pid in killed if running(pid)]

        assert [line["epoch"] for line in lines] == list(range(1, FILES + 1)), lines
        ran_on = assert_ran_in_executors(lines, {victim.pid, survivor.pid}, {pid: victim.pid for pid in killed})
        retried = next(line for line in lines if line["epoch"] == epoch)["shards"][str(shard)]
        assert retried["task_pid"] != paused_pid
        assert ran_on[(epoch, str(shard))] == survivor.pid  # the retry ran on the other worker
        assert all(ran_on[(e, s)] == survivor.pid for (e, s) in ran_on if e > epoch)
        runner = assert_exactly_once(tmp_path)
        assert_snapshots_share_files(lines)
        # the retry wrote its own snapshot, which the manifest names; retention removed the killed attempt's
        shards = runner.result(epoch).shards
        snap = shards[shard].snapshot
        assert Path(snap.path).name != killed_snapshot
        verify_snapshot(tmp_path / "state" / snap.path, snap.files, full=True)
        leftovers = [p.name for p in (tmp_path / "state" / "snapshots" / f"{epoch:010d}").iterdir()]
        assert sorted(leftovers) == sorted(Path(shards[s].snapshot.path).name for s in range(SHARDS))
        assert not marker.exists() and not list(pause.glob("*.armed"))
        print(f"killed worker {victim.index} (pids {killed}); the run finished {recovered:.1f}s later; "
              f"the driver logged: {lost}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if victim is not None:  # the session's cluster gets its second worker back
            spark_cluster.restart_worker(victim.index)
