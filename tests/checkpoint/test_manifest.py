"""Typed manifest records (shard entries, sink results, enrichment reads) read every
manifest written so far and write the same flat JSON."""

from __future__ import annotations

from pathlib import Path

from volley_dagster.checkpoint.manifest import ShardEntry, ShardSnapshot, SnapshotDownload, SnapshotUpload
from volley_dagster.dimensions.base import EnrichmentRead
from volley_dagster.operators.base import OperatorStats
from volley_dagster.result import EpochResult
from volley_dagster.sinks.base import SinkCommitResult, SinkPosition

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


def test_a_compacted_shard_says_so_and_reads_back_as_compacted() -> None:
    entry = ShardEntry.from_dict({**WRITTEN_BEFORE, "compacted": True})
    assert entry.compacted and "compacted" not in entry.operator.figures
    assert entry.to_dict()["compacted"] is True and ShardEntry.from_dict(entry.to_dict()) == entry
    assert not ShardEntry.from_dict(WRITTEN_BEFORE).compacted


def test_a_snapshot_path_is_recorded_relative_to_the_checkpoint_root(tmp_path: Path) -> None:
    absolute = ShardSnapshot(str(tmp_path / "snapshots" / "0000000001" / "shard-0000-aa"), FILES, 1250, "aa")
    entry = ShardEntry(0, absolute, "carried_forward")
    assert entry.relative_to(tmp_path).snapshot.path == "snapshots/0000000001/shard-0000-aa"
    # a rescale's rewrite: no attempt, never uploaded
    rewrite = ShardSnapshot.from_dict({"snapshot": "snapshots/x", "files": FILES, "bytes_total": 5})
    assert rewrite.to_dict() == {"snapshot": "snapshots/x", "files": FILES, "bytes_total": 5}
    assert (rewrite.attempt, rewrite.stored_remotely) == (None, False)


# a deduplicating aggregate's manifest as the engine wrote it before sink results,
# enrichment reads and operator figures were typed (trimmed to one shard)
MANIFEST_BEFORE = {
    "pipeline": "payments", "epoch": 7, "range": {"0": "a.parquet:0 -> a.parquet:900"}, "records_in": 900,
    "records_aggregated": 880, "dead_letters": 0, "records_out": 40, "keys_touched": 40, "new_keys": 3,
    "state_bytes": 1250, "state_bytes_written": 1234, "shards": {"2": WRITTEN_BEFORE},
    "sinks": {"balances": {"skipped": False, "rows": 40, "mode": "upsert", "conflicts": 0, "replaced": False,
                           "version": 6, "inserted": 3, "updated": 37, "seconds": 0.4, "lineage": "ab12",
                           "sink_epoch": 7},
              "changes": {"skipped": True, "held_epoch": 7, "conflicts": 0, "mode": "append", "snapshot_id": 991,
                          "seconds": 0.1, "lineage": "ab12", "sink_epoch": 7},
              "events": {"skipped": False, "rows": 40, "mode": "append", "topic": "out", "read_back": True,
                         "seconds": 0.2, "lineage": "ab12", "sink_epoch": 7}},
    "durations": {"total": 2.5}, "dead_letter_path": None, "keys_expired": 0, "watermark": 1_700_000_000_000_000,
    "late_records": 0, "late_records_path": None, "duplicates": 15, "dedup_late": 5, "duplicates_path": None,
    "end_of_stream": False, "committed_at": "2026-11-20T10:00:00+00:00", "fencing_token": 3,
    "enrichments": {"merchants": {"kind": "delta", "version": "4", "how": "inner", "on": ["merchant_id"],
                                  "records": 900, "unmatched": 2, "dropped": 2}},
}


def test_a_manifest_written_before_typed_records_reads_back_whole() -> None:
    result = EpochResult.from_manifest(MANIFEST_BEFORE)
    assert result.figures == {"duplicates": 15, "dedup_late": 5}  # the operator's, a zero left out
    balances, changes, events = (result.sinks[name] for name in ("balances", "changes", "events"))
    assert balances == SinkCommitResult(False, 40, "upsert", 0, False, None, SinkPosition(version=6),
                                        {"inserted": 3, "updated": 37}, 0.4, "ab12", 7)
    assert changes.skipped and changes.held_epoch == 7 and changes.position.snapshot_id == 991 and not changes.counts
    assert events.position == SinkPosition(topic="out", read_back=True)
    assert result.enrichments["merchants"] == EnrichmentRead("delta", "4", "inner", ("merchant_id",), 900, 2, 2)
    assert result.shards[2] == ShardEntry.from_dict(WRITTEN_BEFORE)
    again = EpochResult.from_manifest(result.to_manifest())
    assert again == result
    # what the typed records write: the same sink entries; the figures under their own key
    written = result.to_manifest()
    assert written["sinks"] == MANIFEST_BEFORE["sinks"] and written["enrichments"] == MANIFEST_BEFORE["enrichments"]
    assert written["figures"] == {"duplicates": 15, "dedup_late": 5} and "duplicates" not in written


def test_a_sink_entry_keeps_its_counts_and_passes_over_a_field_a_later_version_added() -> None:
    entry = {"skipped": False, "rows": 12, "mode": "upsert", "version": 4, "inserted": 7, "updated": 5,
             "commit_strategy": "merge-on-read", "verified": True}
    result = SinkCommitResult.from_dict(entry)
    assert result.counts == {"inserted": 7, "updated": 5} and result.position == SinkPosition(version=4)
    assert result.rows == 12 and result.mode == "upsert"
