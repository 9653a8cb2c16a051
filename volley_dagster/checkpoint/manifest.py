"""The typed shard entries of an epoch's manifest (``epochs/<n>/manifest.json``) and of
a rescale's layout record: where a shard's snapshot is, and what its task measured.

On disk they stay flat JSON objects (``to_dict``), as every manifest written so far
is; ``from_dict`` reads those too, older ones included.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from volley_dagster.json_records import JsonObject
from volley_dagster.operators.base import OperatorStats
from volley_dagster.state.digests import FileDigests
from volley_dagster.state.store import SnapshotInfo

__all__ = ["ShardEntry", "ShardSnapshot", "SnapshotDownload", "SnapshotUpload"]


@dataclass(frozen=True)
class ShardSnapshot:
    """A shard's state at an epoch: the snapshot directory (relative to the checkpoint
    root once recorded), its files' digests, and whether the snapshot store holds a
    copy. ``attempt`` is the epoch attempt or rescale that wrote it (None: a rescale's
    rewrite kept on the checkpoint root only)."""

    path: str
    files: FileDigests
    bytes_total: int
    attempt: str | None = None
    stored_remotely: bool = False

    @classmethod
    def of(cls, info: SnapshotInfo, attempt: str | None = None, stored_remotely: bool = False) -> ShardSnapshot:
        return cls(str(info.path), info.files, info.bytes_total, attempt, stored_remotely)

    def relative_to(self, root: Path) -> ShardSnapshot:
        return ShardSnapshot(str(Path(self.path).relative_to(root)), self.files, self.bytes_total, self.attempt,
                             self.stored_remotely)

    def to_dict(self) -> JsonObject:
        d: JsonObject = {"snapshot": self.path, "files": self.files, "bytes_total": self.bytes_total}
        if self.attempt is not None:
            d["attempt"] = self.attempt
        if self.stored_remotely:
            d["stored_remotely"] = True
        return d

    @classmethod
    def from_dict(cls, d: JsonObject) -> ShardSnapshot:
        # manifests written before the flag said "uploaded" by their upload timing alone
        stored = bool(d.get("stored_remotely", "s3_upload_s" in d))
        return cls(d["snapshot"], d["files"], d.get("bytes_total", 0), d.get("attempt"), stored)


@dataclass(frozen=True)
class SnapshotUpload:
    """What uploading a shard's snapshot to the snapshot store cost."""

    bytes_uploaded: int
    files_uploaded: int
    files_reused: int
    seconds: float

    def to_dict(self) -> JsonObject:
        return {"s3_bytes_uploaded": self.bytes_uploaded, "s3_files_uploaded": self.files_uploaded,
                "s3_files_reused": self.files_reused, "s3_upload_s": self.seconds}

    @classmethod
    def from_dict(cls, d: JsonObject) -> SnapshotUpload | None:
        if "s3_upload_s" not in d:
            return None
        return cls(d.get("s3_bytes_uploaded", 0), d.get("s3_files_uploaded", 0), d.get("s3_files_reused", 0),
                   d["s3_upload_s"])


@dataclass(frozen=True)
class SnapshotDownload:
    """What restoring epoch N-1's snapshot from the store cost (its files not cached here)."""

    bytes_downloaded: int
    seconds: float

    def to_dict(self) -> JsonObject:
        return {"s3_restore_bytes": self.bytes_downloaded, "s3_restore_s": self.seconds}

    @classmethod
    def from_dict(cls, d: JsonObject) -> SnapshotDownload | None:
        if "s3_restore_s" not in d:
            return None
        return cls(d.get("s3_restore_bytes", 0), d["s3_restore_s"])


_ENTRY_FIELDS = ("records", "null_key_records", "keys_written", "bytes_new", "restore_s", "merge_s", "flush_s",
                 "snapshot_s", "peak_rss_mib")
_SNAPSHOT_KEYS = {"snapshot", "files", "bytes_total", "attempt", "stored_remotely"}
_TRANSFER_KEYS = {"s3_bytes_uploaded", "s3_files_uploaded", "s3_files_reused", "s3_upload_s", "s3_restore_bytes",
                  "s3_restore_s"}
_OWN_KEYS = {"shard", "read_mode", "task_pid", "keys_touched", "new_keys", "compacted", *_ENTRY_FIELDS}


@dataclass(frozen=True)
class ShardEntry:
    """One shard's row of an epoch's manifest: the snapshot the next epoch restores,
    and what the shard's task did to write it. ``read_mode`` says how state was read:
    ``resident`` (the memory mirror), ``multi_get``, ``scan``, or ``carried_forward``
    (an epoch with no records, whose snapshot is the previous one)."""

    shard: int
    snapshot: ShardSnapshot
    read_mode: str
    operator: OperatorStats = field(default_factory=OperatorStats)
    records: int = 0
    null_key_records: int = 0
    keys_written: int = 0
    bytes_new: int = 0  # bytes not shared (by hardlink) with the previous snapshot
    compacted: bool = False  # level 0 folded into the base before the snapshot: it shares no SST with N-1's
    restore_s: float = 0.0
    merge_s: float = 0.0
    flush_s: float = 0.0
    snapshot_s: float = 0.0
    peak_rss_mib: float = 0.0
    task_pid: int | None = None  # the executor-side process that ran the shard
    upload: SnapshotUpload | None = None
    download: SnapshotDownload | None = None

    @property
    def keys_touched(self) -> int:
        return self.operator.keys_touched

    @property
    def new_keys(self) -> int:
        return self.operator.new_keys

    def relative_to(self, root: Path) -> ShardEntry:
        return replace(self, snapshot=self.snapshot.relative_to(root))

    def to_dict(self) -> JsonObject:
        d: JsonObject = {"shard": self.shard, **self.snapshot.to_dict(), "read_mode": self.read_mode,
                             "keys_touched": self.keys_touched, "new_keys": self.new_keys,
                             **{name: getattr(self, name) for name in _ENTRY_FIELDS}, **self.operator.figures}
        if self.task_pid is not None:
            d["task_pid"] = self.task_pid
        if self.compacted:  # written only when true: an entry from before reads back as it was
            d["compacted"] = True
        for transfer in (self.upload, self.download):
            if transfer is not None:
                d.update(transfer.to_dict())
        return d

    @classmethod
    def from_dict(cls, d: JsonObject) -> ShardEntry:
        figures = {k: v for k, v in d.items() if k not in _OWN_KEYS | _SNAPSHOT_KEYS | _TRANSFER_KEYS}
        return cls(
            shard=d["shard"], snapshot=ShardSnapshot.from_dict(d), read_mode=d.get("read_mode", ""),
            operator=OperatorStats(d.get("keys_touched", 0), d.get("new_keys", 0), figures),
            **{name: d.get(name, 0) for name in _ENTRY_FIELDS}, compacted=bool(d.get("compacted", False)),
            task_pid=d.get("task_pid"),
            upload=SnapshotUpload.from_dict(d), download=SnapshotDownload.from_dict(d),
        )

