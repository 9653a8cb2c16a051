"""Typed shard entries read every manifest written so far and write the same flat JSON."""

from __future__ import annotations

from pathlib import Path

from volley_dagster.checkpoint.manifest import ShardEntry, ShardSnapshot, SnapshotDownload, SnapshotUpload
from volley_dagster.operators.base import OperatorStats

FILES = {"000009.sst": {"size": 1234, "sha256": "ab" * 32}, "CURRENT": {"size": 16, "sha256": "cd" * 32}}

# a window shard's entry as the engine wrote it before shard entries were typed (S3 store on)
WRITTEN_BEFORE = {
    "shard": 2, "attempt": "1a2b3c4d5e6f", "snapshot": "snapshots/0000000007/shard-0002-1a2b3c4d5e6f",
    "files": FILES, "bytes_total": 1250, "bytes_new": 1234, "keys_touched": 40, "new_keys": 3, "records": 900,
    "null_key_records": 1, "keys_written": 41, "restore_s": 0.01, "merge_s": 0.2, "flush_s": 0.03,
    "snapshot_s": 0.04, "peak_rss_mib": 150.5, "windows_fired": 7, "pending_resident": 12, "read_mode": "multi_get",
    "s3_bytes_uploaded": 1234, "s3_files_uploaded": 1, "s3_files_reused": 1, "s3_upload_s": 0.5,
    "s3_restore_bytes": 99, "s3_restore_s": 0.2, "task_pid": 4242,
}


def test_an_entry_written_before_types_reads_back_whole_and_writes_the_same_json() -> None:
    entry = ShardEntry.from_dict(WRITTEN_BEFORE)
    assert entry.snapshot == ShardSnapshot(WRITTEN_BEFORE["snapshot"], FILES, 1250, "1a2b3c4d5e6f", True)
    assert entry.operator == OperatorStats(40, 3, {"windows_fired": 7, "pending_resident": 12})
    assert (entry.keys_touched, entry.new_keys, entry.records, entry.task_pid) == (40, 3, 900, 4242)
    assert entry.upload == SnapshotUpload(1234, 1, 1, 0.5)
    assert entry.download == SnapshotDownload(99, 0.2)
    # the flag the old entry lacked is now written; every other key is as it was
    assert entry.to_dict() == {**WRITTEN_BEFORE, "stored_remotely": True}
    assert ShardEntry.from_dict(entry.to_dict()) == entry


def test_an_entry_without_the_snapshot_store_is_not_stored_remotely() -> None:
    local = {k: v for k, v in WRITTEN_BEFORE.items() if not k.startswith("s3_")}
    entry = ShardEntry.from_dict(local)
    assert not entry.snapshot.stored_remotely and entry.upload is None and entry.download is None
    assert entry.to_dict() == local


def test_a_snapshot_path_is_recorded_relative_to_the_checkpoint_root(tmp_path: Path) -> None:
    absolute = ShardSnapshot(str(tmp_path / "snapshots" / "0000000001" / "shard-0000-aa"), FILES, 1250, "aa")
    entry = ShardEntry(0, absolute, "carried_forward")
    assert entry.relative_to(tmp_path).snapshot.path == "snapshots/0000000001/shard-0000-aa"
    # a rescale's rewrite: no attempt, never uploaded
    rewrite = ShardSnapshot.from_dict({"snapshot": "snapshots/x", "files": FILES, "bytes_total": 5})
    assert rewrite.to_dict() == {"snapshot": "snapshots/x", "files": FILES, "bytes_total": 5}
    assert (rewrite.attempt, rewrite.stored_remotely) == (None, False)
