"""A blocking check that failed holds until the checks pass again: recorded in the
checkpoint root, it stops the sensor (the tick names it, ``epochs_progress`` is red),
every later run re-checks the flagged snapshot in full (a damaged file hardlinked
into the next epoch's snapshot would otherwise count as shared and never be hashed
again), and retention keeps the snapshots before it. Once the file is restored and a
run's checks pass, the record goes and the sensor resumes. Real RocksDB snapshots
(``tests/checkpoint/test_snapshot_check.py``) on a real SQLite DagsterInstance; no Spark."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from dagster import AssetCheckEvaluation, AssetKey

from tests.checkpoint.test_snapshot_check import commit_epochs, new_files
from tests.dagster.conftest import build_location
from tests.dagster.daemon import tick_sensor
from volley_dagster import FileLog, Pipeline, sum_
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.dagster.blocking import RECORD, blocking_failure
from volley_dagster.dagster.epochs import check_results, make_runner
from volley_dagster.dagster.resources import CheckpointResource, TablesResource
from volley_dagster.deploy import Deployment
from volley_dagster.sources.offsets import EpochRange

STATE = AssetKey(["p", "state"])


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def snapshot_check(results) -> tuple[bool, str]:
    (check,) = [r for r in results if r.check_name == "snapshot_checksums"]
    return check.passed, check.description or ""


def test_a_failed_snapshot_check_stops_the_sensor_and_holds_until_the_file_is_restored(tmp_path: Path) -> None:
    (tmp_path / "events").mkdir()
    deployment = Deployment(name="p", build=lambda tables: Pipeline("p").source(FileLog(tmp_path / "events"))
                            .key_by("k").aggregate(total=sum_("v")))
    root = tmp_path / "state" / "p"
    log = EpochLog(root)
    commit_epochs(log, tmp_path, 4)
    # an SST epoch 3 wrote, hardlinked into epoch 4's snapshot: damaged after epoch 3 committed
    sst = next(p for p in new_files(log, 3) if p.suffix == ".sst")
    in_4 = next(q for q in log.snapshots_dir(4).glob("shard-*/*.sst") if q.samefile(sst))
    manifest_4 = log.epoch_dir(4) / "manifest.json"
    os.rename(manifest_4, manifest_4.with_suffix(".later"))  # epoch 4 is cut, not yet committed
    damage(sst)
    checkpoints = CheckpointResource(root=str(tmp_path / "state"), keep_epochs=2)
    tables = TablesResource(warehouse=str(tmp_path / "tables"))
    with ExitStack() as stack:
        defs, instance, _ = build_location(deployment, tmp_path, stack)

        def checks(epochs: range, run_id: str):
            return check_results(instance, make_runner(deployment, checkpoints, tables), deployment, epochs, run_id)

        passed, description = snapshot_check(checks(range(3, 4), "run-a"))  # the run that committed epoch 3
        assert not passed and "epoch 3" in description
        held = blocking_failure(root)
        assert held is not None and (held.first, held.last, held.snapshot_epoch, held.run_id) == (3, 3, 3, "run-a")
        assert held.checks == ("p/state snapshot_checksums",)

        stopped = tick_sensor(defs, instance, "p_new_data")  # epoch 4 waits, and is not requested
        assert not stopped.run_requests
        message = stopped.skip_reason.skip_message
        assert "stopped: blocking check(s) of 'p' failed over epochs 3..3 in run run-a" in message
        assert "p/state snapshot_checksums" in message and "materialize partition 0000000003" in message
        assert str(root / RECORD) in message
        (progress,) = [e for e in stopped.asset_events
                       if isinstance(e, AssetCheckEvaluation) and e.check_name == "epochs_progress"]
        assert not progress.passed and progress.metadata["stopped"].value

        # retention keeps the snapshots before the flagged epoch: 2 and 3 with keep_epochs=2, not only 3 and 4
        runner = make_runner(deployment, checkpoints, tables)
        assert runner.settings.keep_epochs > checkpoints.keep_epochs
        os.rename(manifest_4.with_suffix(".later"), manifest_4)  # a person's backfill commits epoch 4
        runner.log.prune(4, runner.settings.keep_epochs)
        assert {2, 3, 4} <= set(runner.log.retained_snapshots())

        # epoch 4's run checks what it changed, and the flagged snapshot in full: still red
        passed, description = snapshot_check(checks(range(4, 5), "run-b"))
        assert not passed and "epoch 3" in description and "checked in full" in description
        assert not tick_sensor(defs, instance, "p_new_data", stopped.cursor).run_requests

        damage(in_4)  # the file restored (the same inode: epoch 3's and 4's copy at once)
        log.record_offsets(EpochRange(5, {}, {}))
        results = checks(range(4, 5), "run-c")
        assert all(r.passed for r in results), [(r.check_name, r.description) for r in results if not r.passed]
        assert blocking_failure(root) is None
        resumed = tick_sensor(defs, instance, "p_new_data", stopped.cursor)
        assert [r.partition_key for r in resumed.run_requests or []] == ["0000000005"]
        (progress,) = [e for e in resumed.asset_events
                       if isinstance(e, AssetCheckEvaluation) and e.check_name == "epochs_progress"]
        assert progress.passed
