"""Two runners of one pipeline, as they meet in production: real processes, real
Spark, a shard attempt held paused after its snapshot while another runner commits
the same epoch, and ``kill -9``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.processes import proc_ancestors
from tests.helpers import (
    assert_epoch_outputs,
    assert_state_equal,
    log_records,
    payments,
    read_sink,
    reference_state,
    tree_digest,
)
from volley_dagster import EpochRunner, PipelineBusyError
from volley_dagster.checkpoint.lease import newest_token
from volley_dagster.demo.events import generate
from volley_dagster.faults import PAUSE_DIR_ENV, PAUSE_MAX_ENV
from volley_dagster.settings import RunSettings

FILES, PER_FILE, KEYS, MAX, KEEP = 4, 1_500, 300, 1_500, 2
ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the runner exited before {what}:\n{proc.stderr.read()[-4000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_paused_attempt_cannot_touch_what_another_runner_committed(spark, tmp_path):
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    pause = tmp_path / "pause"
    pause.mkdir()
    (pause / "shard_after_snapshot-2-1.armed").touch()
    marker = pause / "shard_after_snapshot-2-1"
    env = {**os.environ, "PYTHONPATH": str(ROOT), PAUSE_DIR_ENV: str(pause), PAUSE_MAX_ENV: "300"}
    first = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.crash_worker", str(tmp_path), str(MAX), str(KEEP)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    pipeline = payments(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables")
    try:
        wait_for(marker.exists, 180, "shard 1 of epoch 2 to pause after its snapshot", first)
        paused = int(marker.read_text())
        state = tmp_path / "state"
        zombie_work = list((state / "work" / f"{2:010d}").glob("shard-0001-*"))
        zombie_snapshot = list((state / "snapshots" / f"{2:010d}").glob("shard-0001-*"))
        assert len(zombie_work) == 1 and len(zombie_snapshot) == 1

        # Two whole runners: the second waits for the lease, then names the holder; it writes nothing.
        second = EpochRunner(pipeline, state, RunSettings(max_records_per_epoch=MAX, keep_epochs=KEEP, lease_wait_s=1), spark=spark)
        with pytest.raises(PipelineBusyError, match=rf"is busy: .* pid {first.pid} \(pid {first.pid}\), token 1"):
            second.run(2)
        assert second.committed_epoch() == 1 and newest_token(state) == 1

        # The first runner's driver dies while its JVM stalls (frozen, as in a long GC pause or
        # a partition): the paused attempt lives on, as an attempt on a lost executor would.
        jvm = proc_ancestors(paused)[1]
        os.kill(jvm, signal.SIGSTOP)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        assert _state(paused) in ("S", "R")

        second = EpochRunner(pipeline, state, RunSettings(max_records_per_epoch=MAX, keep_epochs=KEEP, lease_wait_s=10), spark=spark)
        result = second.run(2)
        assert _state(paused) in ("S", "R")
        assert not result.already_committed and result.fencing_token == 2
        winner = state / result.shards[1].snapshot.path
        assert winner != zombie_snapshot[0]
        committed = tree_digest(winner)
        manifest = (state / "epochs" / f"{2:010d}" / "manifest.json").read_bytes()
        assert not zombie_snapshot[0].exists()  # the attempt that lost is pruned with the commit
        assert zombie_work[0].exists()  # but its working directory is in use: left alone

        marker.unlink()  # the paused attempt resumes, finishes and finds its Spark gone
        wait_for(lambda: not zombie_work[0].exists(), 60, "the resumed attempt to close its database")
        assert tree_digest(winner) == committed
        assert (state / "epochs" / f"{2:010d}" / "manifest.json").read_bytes() == manifest

        resumed = second.run_available()
        assert [r.epoch for r in resumed] == [3, 4]
        records = log_records(FILES, PER_FILE, KEYS)
        assert_state_equal(second.read_state(), reference_state(records))
        records_in = {e: second.result(e).records_in for e in range(1, FILES + 1)}
        assert_epoch_outputs(read_sink(tmp_path / "out"), records, records_in)
        for sink in pipeline.sinks[1:]:  # Delta and Iceberg hold each epoch once
            assert sink.committed_epoch("payments") == FILES
        assert second.log.retained_snapshots() == [FILES - 1, FILES]
        named = {Path(info.snapshot.path).name for info in second.result(FILES).shards.values()}
        assert {p.name for p in (state / "snapshots" / f"{FILES:010d}").iterdir()} == named
        assert not any((state / "work").iterdir())
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)  # the frozen JVM and anything left of the first runner
        except ProcessLookupError:
            pass


def test_a_holder_paused_past_its_lease_stops_then_heals_under_a_new_token(spark, tmp_path):
    """The runner's driver is frozen (SIGSTOP: a long GC pause, a suspended VM) mid-epoch
    for longer than its lease's ttl. Nobody took the lease over, so its token is still
    the newest; yet when it wakes it writes nothing more under that token: it takes the
    next one and runs the epoch again, with no person acting, and every epoch is
    committed once."""
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    pause = tmp_path / "pause"
    pause.mkdir()
    (pause / "shard_after_snapshot-2-1.armed").touch()
    marker = pause / "shard_after_snapshot-2-1"
    ttl = 3.0
    env = {**os.environ, "PYTHONPATH": str(ROOT), PAUSE_DIR_ENV: str(pause), PAUSE_MAX_ENV: "300",
           "VOLLEY_TEST_LEASE_TTL": str(ttl)}
    first = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.crash_worker", str(tmp_path), str(MAX), str(KEEP)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    pipeline = payments(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables")
    state = tmp_path / "state"
    try:
        wait_for(marker.exists, 180, "shard 1 of epoch 2 to pause after its snapshot", first)
        os.kill(first.pid, signal.SIGSTOP)  # the driver freezes, heartbeat and all
        time.sleep(ttl + 1.5)
        marker.unlink()  # the stage finishes while the driver is frozen
        os.kill(first.pid, signal.SIGCONT)
        out, err = first.communicate(timeout=180)
        assert first.returncode == 0, err[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # the JVM and anything left of the runner
    assert "lapsed" in err and "took the lease of 'payments' again (fencing token" in err, err[-3000:]
    assert out.split() == [w for e in range(1, FILES + 1) for w in ("committed", str(e))]
    newest = newest_token(state)  # the first runner's last token

    second = EpochRunner(pipeline, state, RunSettings(max_records_per_epoch=MAX, keep_epochs=KEEP), spark=spark)
    assert second.run_available() == []
    # epoch 2 under a newer token than epoch 1's (a loaded machine may lapse a 3 s lease more than once)
    tokens = [second.result(e).fencing_token for e in range(1, FILES + 1)]
    assert tokens == sorted(tokens) and tokens[0] < tokens[1] and tokens[-1] == newest, tokens
    records = log_records(FILES, PER_FILE, KEYS)
    final = reference_state(records)
    assert_state_equal(second.read_state(), final)
    records_in = {e: second.result(e).records_in for e in range(1, FILES + 1)}
    outputs = read_sink(tmp_path / "out")
    assert_epoch_outputs(outputs, records, records_in)  # the Parquet sink: each epoch once
    rows = {"DeltaSink": len(final), "IcebergSink": len(outputs)}  # upsert: the state; append: every epoch's output
    assert {type(sink).__name__ for sink in pipeline.sinks} >= set(rows)
    for sink in pipeline.sinks:
        assert sink.committed_epoch("payments") == FILES, sink.name
        if type(sink).__name__ in rows:
            assert sink.row_count() == rows[type(sink).__name__], sink.name


def test_speculative_shard_tasks_are_refused(tmp_path):
    generate(tmp_path / "events", 1, 200, 20)
    script = (
        "import sys\n"
        "from tests.helpers import payments\n"
        "from volley_dagster import ConfigError, EpochRunner, get_or_create_spark\n"
        "spark = get_or_create_spark(master='local[1]', conf={'spark.speculation': 'true'})\n"
        "runner = EpochRunner(payments(sys.argv[1] + '/events', sys.argv[1] + '/out'), sys.argv[1] + '/state', spark=spark)\n"
        "try:\n"
        "    runner.run_next()\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc)\n"
        "print('committed', runner.committed_epoch())\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=240)
    assert "refused: spark.speculation=true is not supported" in out.stdout, out.stderr[-3000:]
    assert "committed 0" in out.stdout


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
