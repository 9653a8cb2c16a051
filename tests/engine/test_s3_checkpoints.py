"""Shard snapshots on S3 (SeaweedFS), incremental like Flink's, under real epochs; and
the faults that storage brings: S3 down, disk full. Each fails the epoch with an
error naming it, commits nothing, and a re-run after the fault clears succeeds."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from harness.seaweedfs import SeaweedFS, start_seaweedfs
from tests.conftest import BUCKET
from tests.helpers import assert_state_equal, log_records, payments, reference_state
from volley_dagster import EpochRunner
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.cli import main
from volley_dagster.demo.events import generate
from volley_dagster.errors import SnapshotStorageError, StorageFullError
from volley_dagster.settings import RunSettings

FILES, PER_FILE, KEYS = 4, 2_000, 3_000


def runner_for(base: Path, spark, store: S3SnapshotStore | None, state: Path | None = None) -> EpochRunner:
    return EpochRunner(payments(base / "events", base / "out"), state or base / "state", RunSettings(max_records_per_epoch=PER_FILE, keep_epochs=2, snapshot_store=store, snapshot_cache=base / "cache"), spark=spark)


def test_snapshots_upload_incrementally_and_restore_from_s3(spark, seaweedfs: SeaweedFS, tmp_path):
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    store = S3SnapshotStore(f"s3://{BUCKET}/ckpt-{uuid.uuid4().hex[:8]}", seaweedfs.s3)
    runner = runner_for(tmp_path, spark, store)
    results = [runner.run_next() for _ in range(FILES - 1)]
    incremental = []
    for r in results:
        uploaded = sum(s.upload.bytes_uploaded for s in r.shards.values() if s.upload)
        assert uploaded == r.state_bytes_written  # what the epoch wrote locally, and nothing more
        if r.epoch > 1:  # the SSTs epoch N-1 left unchanged are reused, not uploaded again
            incremental += [s for s in r.shards.values() if not s.compacted]  # (a compacted shard shares none)
    assert incremental and all(s.upload and s.upload.files_reused > 0 for s in incremental)
    assert all(s.upload and s.upload.bytes_uploaded < s.snapshot.bytes_total for s in incremental)
    assert store.epochs() == runner.log.retained_snapshots() == [FILES - 2, FILES - 1]  # retention on both

    # another machine: the last epoch's snapshots are not on its disk, so read_state and the
    # next epoch's tasks restore them from S3 (downloaded once into the local cache)
    shutil.rmtree(runner.log.root / "snapshots" / f"{FILES - 1:010d}")
    assert_state_equal(runner.read_state(FILES - 1), reference_state(log_records(FILES - 1, PER_FILE, KEYS)))
    last = runner.run_next()
    assert all(s.download is not None for s in last.shards.values())  # each shard came back from S3,
    assert sum(s.download.bytes_downloaded for s in last.shards.values() if s.download) == 0  # from the cache read_state filled
    assert_state_equal(runner.read_state(), reference_state(log_records(FILES, PER_FILE, KEYS)))
    assert not any((tmp_path / "cache" / "restores").iterdir())  # restores were checkpointed into work/, then removed


def test_s3_down_fails_the_epoch_and_a_rerun_resumes(spark, tmp_path):
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    server = start_seaweedfs(tmp_path / "weed", bucket="outage")
    try:
        runner = runner_for(tmp_path, spark, S3SnapshotStore("s3://outage/ckpt", server.s3))
        runner.run_next()
        epoch = runner.cut_next().epoch
    finally:
        server.stop()
    with pytest.raises(SnapshotStorageError, match=rf"epoch {epoch} shard \d: uploading"):
        runner.run(epoch)
    assert runner.committed_epoch() == 1 and runner.log.manifest(epoch) is None

    server = start_seaweedfs(tmp_path / "weed", bucket="outage")  # the same data back, on new ports
    try:
        store = S3SnapshotStore("s3://outage/ckpt", server.s3)
        runner = runner_for(tmp_path, spark, store)
        result = runner.run(epoch)
        assert not result.already_committed and store.epochs() == [1, 2]
    finally:
        server.stop()
    assert_state_equal(runner.read_state(), reference_state(log_records(2, PER_FILE, KEYS)))


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 24 MiB tmpfs for the checkpoint root, so the disk can really fill up."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_disk_full_fails_the_epoch_and_a_rerun_after_freeing_space_succeeds(spark, tmp_path, small_disk):
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    runner = runner_for(tmp_path, spark, None, state=small_disk / "state")
    runner.run_next()
    epoch = runner.cut_next().epoch
    filler = small_disk / "filler"
    with filler.open("wb") as fh:  # take every byte left
        try:
            while True:
                fh.write(b"\0" * 65536)
                fh.flush()
        except OSError:
            pass
    # a full disk fails the epoch wherever it strikes first: taking the lease, or a shard task
    with pytest.raises(StorageFullError, match=rf"(epoch {epoch}( shard \d)?|pipeline 'payments'): no space left on the disk"):
        runner.run(epoch)
    assert runner.committed_epoch() == 1 and runner.log.manifest(epoch) is None

    filler.unlink()
    result = runner.run(epoch)
    assert not result.already_committed
    assert_state_equal(runner.read_state(), reference_state(log_records(2, PER_FILE, KEYS)))
    assert not any((small_disk / "state" / "work").iterdir())


def test_a_driver_without_local_snapshots_keeps_s3_whole_across_empty_epochs(spark, seaweedfs: SeaweedFS, tmp_path):
    """Executors that keep snapshots on their own disks: the driver's checkpoint root has
    no snapshots/. Retention decides from the manifests, an empty epoch is carried
    forward on S3 (a manifest naming the previous epoch's objects), and every retained
    epoch restores from S3 alone, even when the epoch whose files it names is pruned."""
    store = S3SnapshotStore(f"s3://{BUCKET}/driver-{uuid.uuid4().hex[:8]}", seaweedfs.s3)
    runner = runner_for(tmp_path, spark, store)
    files_by_epoch, files = {}, 0
    for kind in "DEDDEDEDEE":  # D: a file of records lands; E: an empty epoch
        if kind == "D":
            generate(tmp_path / "events", 1, PER_FILE, KEYS, first_file=files)
            files += 1
        result = runner.run(runner.cut_next(allow_empty=True).epoch)
        assert (result.records_in == 0) == (kind == "E")
        if kind == "E":
            assert {s.read_mode for s in result.shards.values()} == {"carried_forward"}
            assert sum(s.upload.bytes_uploaded for s in result.shards.values() if s.upload) == 0  # a manifest only
        files_by_epoch[result.epoch] = files
        shutil.rmtree(runner.log.root / "snapshots", ignore_errors=True)  # not on the driver's disk

    assert store.epochs() == [9, 10]  # kept from the manifests, though the driver lists no snapshot
    for epoch in (9, 10):  # both name epoch 8's files, whose own manifest retention removed
        assert_state_equal(runner.read_state(epoch), reference_state(log_records(files_by_epoch[epoch], PER_FILE, KEYS)))
    generate(tmp_path / "events", 1, PER_FILE, KEYS, first_file=files)
    after = runner.run_next()  # its tasks restore epoch 10 from S3
    assert all(s.download is not None for s in after.shards.values())
    assert_state_equal(runner.read_state(), reference_state(log_records(files + 1, PER_FILE, KEYS)))


@pytest.mark.parametrize("by", ["api", "cli"])
def test_a_rescale_uploads_its_rewrite_so_executors_on_their_own_disks_restore_it(spark, seaweedfs: SeaweedFS,
                                                                                     tmp_path, monkeypatch, by):
    """The rewrite of a rescale (``runner.rescale``, or ``volley rescale --snapshot-store``)
    goes to the store as the rescaled epoch's shards (its own attempt id); the next
    epoch's tasks restore it from there when the checkpoint root's copy is not on their
    disk, and retention keeps the rewrite while the epoch is kept."""
    generate(tmp_path / "events", FILES, PER_FILE, KEYS)
    prefix = f"s3://{BUCKET}/rescale-{uuid.uuid4().hex[:8]}"
    store = S3SnapshotStore(f"{prefix}/payments", seaweedfs.s3)  # as CheckpointResource names a pipeline's
    runner = runner_for(tmp_path, spark, store)
    runner.run_next(), runner.run_next()
    if by == "api":
        result = runner.rescale(5).describe()
    else:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweedfs.s3.access_key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweedfs.s3.secret_access_key)
        assert main(["rescale", str(runner.log.root), "--shards", "5", "--snapshot-store", prefix,
                     "--s3-endpoint", seaweedfs.s3.endpoint_url]) == 0
        result = "volley rescale"
    rewrite = runner.log.state_shards(2)
    assert len(rewrite) == 5 and all(s.stored_remotely and s.attempt for s in rewrite.values())
    assert {store.manifest(2, shard, snap.attempt).shard for shard, snap in rewrite.items()} == set(range(5))
    shutil.rmtree(runner.log.root / "snapshots")  # an executor's view: nothing of the root on its disk
    third = runner.run_next()  # restores the 5 rewritten shards from S3
    assert len(third.shards) == 5 and all(s.download is not None for s in third.shards.values()), result
    assert_state_equal(runner.read_state(2), reference_state(log_records(2, PER_FILE, KEYS)))  # the rewrite, kept
    fourth = runner.run_next()
    assert fourth.epoch == 4
    assert_state_equal(runner.read_state(), reference_state(log_records(FILES, PER_FILE, KEYS)))
    assert store.epochs() == [3, 4]
