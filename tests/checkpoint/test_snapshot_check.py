"""The per-run snapshot check (``verify.check_latest_snapshot``) on real RocksDB
checkpoints: it hashes only the files the latest epoch added, as many as that
epoch changed whatever the state's size; the files it shares with the epoch before
(hardlinks, the same name, size and digest) were hashed when they were new. A
damaged new file fails it by name; ``full`` hashes everything."""

from __future__ import annotations

from pathlib import Path

import rocksdict

from volley_dagster import EpochRunner, FileLog, Pipeline, sum_
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.manifest import ShardEntry, ShardSnapshot
from volley_dagster.result import EpochResult
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.state.digests import sha256_file
from volley_dagster.state.options import RocksDBOptions, write_options
from volley_dagster.verify import check_latest_snapshot

SHARDS = 2


def runner_for(tmp_path: Path) -> EpochRunner:
    (tmp_path / "events").mkdir(exist_ok=True)
    pipeline = Pipeline("p").source(FileLog(tmp_path / "events")).key_by("k").aggregate(total=sum_("v"))
    return EpochRunner(pipeline, tmp_path / "state")


def commit_epochs(log: EpochLog, tmp_path: Path, epochs: int, keys_per_epoch: int = 2_000) -> None:
    """Each epoch writes new keys into every shard's DB and checkpoints it, as a shard
    task does (SSTs the epoch did not rewrite are hardlinked), then the manifest names
    the checkpoints with their files' digests."""
    dbs = {s: rocksdict.Rdict(str(tmp_path / f"db-{s}"), RocksDBOptions().build()) for s in range(SHARDS)}
    try:
        for epoch in range(1, epochs + 1):
            shards = {}
            for shard, db in dbs.items():
                batch = rocksdict.WriteBatch(raw_mode=True)
                for i in range(keys_per_epoch):
                    batch.put(f"{shard}-{epoch}-{i:06d}".encode(), b"v" * 40)
                db.write(batch, write_options())
                db.flush()
                snapshot = log.snapshots_dir(epoch) / f"shard-{shard:04d}-aa"
                snapshot.parent.mkdir(parents=True, exist_ok=True)
                rocksdict.Checkpoint(db).create_checkpoint(str(snapshot))
                files = {f.name: {"size": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(snapshot.iterdir())}
                path = str(snapshot.relative_to(log.root))
                shards[shard] = ShardEntry(shard, ShardSnapshot(path, files, sum(m["size"] for m in files.values()), "aa"),
                                           "scan")
            log.record_offsets(EpochRange(epoch, {}, {}))
            assert log.write_manifest(EpochResult("p", epoch, {}, 1, 1, 0, 1, 1, 0, 0, 0, shards, {}, {"total": 1.0}))
    finally:
        for db in dbs.values():
            db.close()


def new_files(log: EpochLog, epoch: int) -> dict[Path, int]:
    """The files of ``epoch``'s snapshots that are not hardlinks of ``epoch - 1``'s."""
    before = [p for p in log.snapshots_dir(epoch - 1).glob("shard-*/*")]
    return {p: p.stat().st_size for p in sorted(log.snapshots_dir(epoch).glob("shard-*/*"))
            if not any(p.samefile(q) for q in before)}


def test_the_check_hashes_only_what_the_latest_epoch_added(tmp_path: Path) -> None:
    runner = runner_for(tmp_path)
    commit_epochs(runner.log, tmp_path, 5)  # one SST per epoch and shard, none compacted yet
    added = new_files(runner.log, 5)
    outcome = check_latest_snapshot(runner)
    assert outcome.passed, outcome.description
    total = sum(len(s.files) for s in runner.log.state_shards(5).values())
    assert outcome.metadata["files"] == total
    # epochs 1..4's SSTs are shared: per shard only epoch 5's SST and the small files (copied) are hashed
    assert outcome.metadata["files_hashed"] == len(added) < total
    assert sum(p.suffix == ".sst" for p in added) == SHARDS
    assert outcome.metadata["bytes_hashed"] == sum(added.values())
    assert outcome.metadata["since_epoch"] == 4
    assert f"{len(added)} new since epoch 4 hashed" in outcome.description
    # a run that committed epochs 3..5 checks what they added; the deep check hashes all
    assert check_latest_snapshot(runner, since=2).metadata["files_hashed"] == len(added) + 2 * SHARDS  # 2 SSTs more
    deep = check_latest_snapshot(runner, full=True)
    assert deep.passed and deep.metadata["files_hashed"] == total and "every file hashed" in deep.description


def test_a_damaged_new_file_fails_the_check_naming_it(tmp_path: Path) -> None:
    runner = runner_for(tmp_path)
    commit_epochs(runner.log, tmp_path, 3)
    sst = next(p for p in new_files(runner.log, 3) if p.suffix == ".sst")
    data = bytearray(sst.read_bytes())
    data[len(data) // 2] ^= 1  # same size: only the digest tells
    sst.write_bytes(bytes(data))
    outcome = check_latest_snapshot(runner)
    assert not outcome.passed and outcome.metadata == {"epoch": 3}
    assert f"epoch 3: snapshot {sst.parent} is corrupt: {sst.name} does not match its SHA-256" in outcome.description


def test_a_shared_file_is_hashed_when_it_is_a_copy_or_only_in_the_deep_check(tmp_path: Path) -> None:
    runner = runner_for(tmp_path)
    commit_epochs(runner.log, tmp_path, 3)
    shared = next(p for p in sorted(runner.log.snapshots_dir(3).glob("shard-*/*.sst")) if p not in new_files(runner.log, 3))
    # damaged in place: the hardlinked copy in epoch 2 is the same inode, hashed when it was new
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 1
    shared.write_bytes(bytes(data))
    assert check_latest_snapshot(runner).passed
    assert not check_latest_snapshot(runner, full=True).passed
    # a copy (as a restore from S3 makes) is no hardlink: it is hashed, and caught
    copy = shared.with_name(shared.name + ".tmp")
    copy.write_bytes(shared.read_bytes())
    shared.unlink()
    copy.rename(shared)
    outcome = check_latest_snapshot(runner)
    assert not outcome.passed and shared.name in outcome.description
    # with epoch 2's snapshot pruned, the manifests' equal name, size and digest say shared
    runner.log.prune(3, 1)
    assert runner.log.retained_snapshots() == [3]
    assert check_latest_snapshot(runner).passed
