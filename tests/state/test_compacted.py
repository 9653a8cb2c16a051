"""Compacted alternates and the background compactor: an alternate holds its
snapshot's state exactly, is trusted only through its record, and anything short of
a sound one (no record, other digests, a wrong size, a compactor killed midway)
restores the snapshot itself."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil

from tests.state.test_store import keys_for
from volley_dagster.state.compacted import compact_snapshot, record_path, remove_alternates, restore_source
from volley_dagster.state.compactor import BackgroundCompactor, CompactionJob, _Queue, worth_compacting
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.store import ShardStore, SnapshotInfo, open_snapshot_read_only

EAGER = RocksDBOptions(compact_l0_share=0.1, compact_l0_files=20)  # the compactor's: due from the second file on


def epoch_of_writes(prev: SnapshotInfo | None, tmp: Path, epoch: int, ids: list[int], model: dict[bytes, bytes],
                    options: RocksDBOptions | None = None, background: bool = True) -> tuple[SnapshotInfo, bool]:
    """One epoch as a shard task runs it: restore N-1 (its alternate when sound),
    write, snapshot N with the compaction left to the background."""
    base = restore_source(tmp, prev.path if prev else None, prev.files if prev else None)
    store = ShardStore.restore(base.path, base.files, tmp / "work" / str(epoch), options or RocksDBOptions())
    try:
        keys = sorted(keys_for(ids))
        values = [epoch.to_bytes(4, "big") + bytes(24)] * len(keys)
        txn = store.transaction()
        txn.set_many(keys, values)
        txn.flush()
        model.update(zip(keys, values, strict=True))
        snap = store.snapshot(tmp / "snapshots" / f"{epoch:04d}" / "shard-0000-a", base.path, base.files,
                              backstop=background)
    finally:
        store.close()
    return snap, base.compacted


def alternate_of(root: Path, snap: SnapshotInfo) -> Path:
    source = restore_source(root, snap.path, snap.files)
    assert source.compacted and source.path is not None, snap.path
    return source.path


def alternate_of_record(record: Path) -> Path:
    return record.with_name(json.loads(record.read_text())["dir"])


def contents(path: Path) -> dict[bytes, bytes]:
    db = open_snapshot_read_only(path)
    try:
        return dict(db.items())
    finally:
        db.close()


def level0(path: Path) -> int:
    db = open_snapshot_read_only(path)
    try:
        return sum(1 for f in db.live_files() if f["level"] == 0)
    finally:
        db.close()


def test_epochs_restored_from_alternates_keep_every_write_and_level_0_small(tmp_path):
    """Twelve epochs, each rewriting a third of the keys, the compactor after each
    commit: each epoch after a compaction restores the alternate, the snapshots never
    change, level 0 stays within two files, and the state is the model's throughout."""
    rng = np.random.default_rng(11)
    model: dict[bytes, bytes] = {}
    snap, used, made = None, [], []
    for epoch in range(1, 13):
        ids = sorted(rng.choice(3000, 3000 if epoch == 1 else 1000, replace=False).tolist())
        snap, from_alternate = epoch_of_writes(snap, tmp_path, epoch, ids, model)
        used.append(from_alternate)
        assert level0(snap.path) <= 2 and contents(snap.path) == model
        before = {p.name: p.stat().st_size for p in snap.path.iterdir()}
        made.append(compact_snapshot(tmp_path, snap.path, snap.files, EAGER))
        assert {p.name: p.stat().st_size for p in snap.path.iterdir()} == before, "the snapshot changed"
        if made[-1]:
            assert contents(alternate_of(tmp_path, snap)) == model and level0(alternate_of(tmp_path, snap)) == 0
    assert used == [False] + made[:-1] and sum(made) >= 5, (used, made)


def test_no_record_other_digests_or_a_wrong_size_restore_the_snapshot(tmp_path):
    model: dict[bytes, bytes] = {}
    first, _ = epoch_of_writes(None, tmp_path, 1, list(range(500)), model)
    snap, _ = epoch_of_writes(first, tmp_path, 2, list(range(0, 500, 2)), model)
    assert compact_snapshot(tmp_path, snap.path, snap.files, EAGER)
    assert restore_source(tmp_path, snap.path, snap.files).compacted

    other = {**snap.files, "CURRENT": {"size": 16, "sha256": "0" * 64}}
    assert restore_source(tmp_path, snap.path, other).path == snap.path  # made from another snapshot's files

    sst = max(alternate_of(tmp_path, snap).glob("*.sst"), key=lambda p: p.stat().st_size)
    sst.write_bytes(sst.read_bytes()[:-10])  # a damaged alternate
    assert restore_source(tmp_path, snap.path, snap.files).path == snap.path

    record = record_path(tmp_path, snap.path)
    assert record is not None
    damaged = alternate_of_record(record)
    assert compact_snapshot(tmp_path, snap.path, snap.files, EAGER) and alternate_of(tmp_path, snap) != damaged
    leftover = alternate_of_record(record)
    record.unlink()  # a compactor killed after installing its folder, before the record
    assert restore_source(tmp_path, snap.path, snap.files).path == snap.path
    assert compact_snapshot(tmp_path, snap.path, snap.files, EAGER)  # the next one writes its own folder
    assert alternate_of(tmp_path, snap) != leftover and leftover.is_dir()  # never one another's
    assert contents(alternate_of(tmp_path, snap)) == model

    record.write_text('{"of": "trunc')  # a record cut short
    assert restore_source(tmp_path, snap.path, snap.files).path == snap.path

    remove_alternates(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "compacted").iterdir()) == ["0002"]
    remove_alternates(tmp_path, 3)
    assert not list((tmp_path / "compacted").iterdir()) and sorted(p.name for p in snap.path.parent.iterdir()) == [
        snap.path.name]


def test_the_backstop_compacts_a_shard_whose_compactions_the_background_missed(tmp_path):
    """No compactor at all: the task folds level 0 itself, only at twice the share."""
    options = RocksDBOptions(compact_l0_share=1.0, compact_l0_files=50)
    assert not options.compaction_due(3, 150, 100, backstop=True) and options.compaction_due(3, 250, 100, backstop=True)
    assert not options.compaction_due(2, 10, 100, turn=True, backstop=True)
    model: dict[bytes, bytes] = {}
    snap, compactions = None, 0
    for epoch in range(1, 9):
        snap, _ = epoch_of_writes(snap, tmp_path, epoch, list(range(0, 2000, 1 if epoch == 1 else 2)), model, options)
        compactions += snap.compacted
    assert snap is not None and compactions >= 1 and contents(snap.path) == model


def test_a_newer_job_replaces_a_waiting_one_and_jobs_run_oldest_first():
    def job(epoch: int, shard: int, root: str = "/r") -> CompactionJob:
        return CompactionJob(root, epoch, shard, f"{root}/snapshots/{epoch}/shard-{shard}", {}, RocksDBOptions())

    queue = _Queue()
    lines = [job(3, 1), job(3, 0), job(4, 1), job(2, 5, "/other"), job(3, 1)]
    queue.read(io.StringIO("".join(j.to_json() + "\n" for j in lines) + "not json\n"))
    order = []
    while (nxt := queue.next(0.01)) is not None:
        order.append((nxt.root, nxt.epoch, nxt.shard))
    assert order == [("/other", 2, 5), ("/r", 3, 0), ("/r", 4, 1)]
    assert CompactionJob.from_json(lines[0].to_json()) == lines[0]
    assert not worth_compacting({"000009.sst": {"size": 1, "sha256": ""}, "CURRENT": {"size": 1, "sha256": ""}})


def test_the_compactor_process_writes_alternates_and_a_kill_9_midway_leaves_none_trusted(tmp_path):
    """The real process: killed with SIGKILL while it compacts, it leaves its working
    folder and no record (the task restores the snapshot); a new one does the job, and
    closing its pipe ends it."""
    model: dict[bytes, bytes] = {}
    rng = np.random.default_rng(2)
    snap = None
    for epoch in range(1, 4):
        ids = sorted(rng.choice(400_000, 400_000 if epoch == 1 else 200_000, replace=False).tolist())
        snap, _ = epoch_of_writes(snap, tmp_path, epoch, ids, model, background=True)
    assert snap is not None
    job = CompactionJob(str(tmp_path), 3, 0, str(snap.path), snap.files, EAGER)

    proc = subprocess.Popen([sys.executable, "-m", "volley_dagster.state.compactor"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write((job.to_json() + "\n").encode())
    proc.stdin.flush()
    deadline = time.monotonic() + 60
    working = tmp_path / "compacted" / "0003"
    while not list(working.glob(".*.work")) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert psutil.Process(proc.pid).nice() == 19
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(working.glob(".*.work")), "the compactor was not killed midway"
    assert restore_source(tmp_path, snap.path, snap.files).path == snap.path

    compactor = BackgroundCompactor()
    compactor.submit([job])
    pid = compactor.pid
    deadline = time.monotonic() + 60
    while not restore_source(tmp_path, snap.path, snap.files).compacted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert contents(alternate_of(tmp_path, snap)) == model
    compactor.close(timeout=30)
    assert pid is not None and not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_compactor_that_died_is_started_again_on_the_next_submission(tmp_path):
    model: dict[bytes, bytes] = {}
    first, _ = epoch_of_writes(None, tmp_path, 1, list(range(300)), model)
    snap, _ = epoch_of_writes(first, tmp_path, 2, list(range(0, 300, 3)), model)
    compactor = BackgroundCompactor()
    compactor.submit([CompactionJob(str(tmp_path), 1, 0, str(first.path), first.files, EAGER)])  # one SST: nothing due
    first_pid = compactor.pid
    assert first_pid is not None
    os.kill(first_pid, signal.SIGKILL)
    psutil.Process(first_pid).wait(10)
    compactor.submit([CompactionJob(str(tmp_path), 2, 0, str(snap.path), snap.files, EAGER)])
    assert compactor.pid not in (None, first_pid)
    compactor.close(timeout=30)
    assert restore_source(tmp_path, snap.path, snap.files).compacted
    assert not restore_source(tmp_path, first.path, first.files).compacted
