"""One RocksDB per state shard: restore from a snapshot, write, snapshot again.

Snapshots are ``rocksdict.Checkpoint``s: SST files are hardlinked, so a
snapshot costs what changed since the last one. A restore never opens the snapshot
(read-write rewrites its MANIFEST and may unlink SSTs; rocksdict rewrites its
``rocksdict-config.json`` at every open, read-only too, and a reader checking the
snapshot meanwhile finds that file empty): it hardlinks the SSTs (immutable) into an
attempt-scoped working directory and copies RocksDB's other files beside them.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import rocksdict

from volley_dagster.errors import SnapshotError
from volley_dagster.io.atomic import fsync_dir
from volley_dagster.state.digests import FileDigest, FileDigests, sha256_file
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.resident import ResidentMirror
from volley_dagster.state.transaction import DEFAULT_SCAN_FRACTION, ShardTransaction

ROCKSDICT_CONFIG = "rocksdict-config.json"  # rocksdict's own, rewritten at every open: a restore's open writes its own


@dataclass(frozen=True)
class SnapshotInfo:
    path: Path
    files: FileDigests
    bytes_total: int
    bytes_new: int  # bytes not shared (by hardlink) with the previous snapshot
    compacted: bool = False  # level 0 was folded into the base first (``ShardStore.compact_when_due``)
    level0_files: int | None = None  # its level-0 files (each one more place a read looks); None: not opened


def verify_snapshot(path: Path, files: FileDigests, full: bool = False) -> None:
    """Check a snapshot against its manifest entry: every file present, same size
    (and same SHA-256 when ``full``)."""
    if not path.is_dir():
        raise SnapshotError(f"snapshot {path} is missing")
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise SnapshotError(f"snapshot {path} is corrupt: file {name} is missing")
        size = f.stat().st_size
        if size != meta["size"]:
            raise SnapshotError(f"snapshot {path} is corrupt: {name} has {size} bytes, manifest says {meta['size']}")
        if full and sha256_file(f) != meta["sha256"]:
            raise SnapshotError(f"snapshot {path} is corrupt: {name} does not match its SHA-256 in the manifest")


def open_snapshot_read_only(path: Path, options: RocksDBOptions | None = None) -> rocksdict.Rdict:
    """Open a snapshot without changing a byte of it."""
    try:
        return rocksdict.Rdict(
            str(path), (options or RocksDBOptions()).build(), access_type=rocksdict.AccessType.read_only()
        )
    except Exception as exc:  # rocksdict raises plain Exception
        raise SnapshotError(f"cannot open snapshot {path}: {exc}") from exc


class ShardStore:
    """A shard's writable RocksDB in its working directory."""

    def __init__(self, db: rocksdict.Rdict, work_dir: Path, options: RocksDBOptions | None = None) -> None:
        self.db = db
        self.work_dir = work_dir
        self.options = options or RocksDBOptions()

    @classmethod
    def restore(
        cls,
        snapshot: Path | None,
        snapshot_files: FileDigests | None,
        work_dir: Path,
        options: RocksDBOptions | None = None,
        verify_checksums: bool = False,
    ) -> ShardStore:
        """A writable copy of ``snapshot`` (empty state when None) in ``work_dir``: the files
        ``snapshot_files`` names, checked against it; without it, the folder's files."""
        options = options or RocksDBOptions()
        if work_dir.exists():
            shutil.rmtree(work_dir)
        work_dir.parent.mkdir(parents=True, exist_ok=True)
        if snapshot is not None:
            if snapshot_files is None:
                if not snapshot.is_dir():
                    raise SnapshotError(f"snapshot {snapshot} is missing")
                names = [entry.name for entry in os.scandir(snapshot) if entry.name != ROCKSDICT_CONFIG]
            else:
                own = {name: meta for name, meta in snapshot_files.items() if name != ROCKSDICT_CONFIG}
                verify_snapshot(snapshot, own, full=verify_checksums)
                names = list(own)
            work_dir.mkdir()
            for name in names:
                _link_or_copy(snapshot / name, work_dir / name, link=name.endswith(".sst"))
        return cls(rocksdict.Rdict(str(work_dir), options.build()), work_dir, options)

    def transaction(
        self, scan_fraction: float = DEFAULT_SCAN_FRACTION, resident: ResidentMirror | None = None
    ) -> ShardTransaction:
        return ShardTransaction(self.db, scan_fraction, resident)

    def snapshot(
        self, target: Path, previous: Path | None, previous_files: FileDigests | None, compaction_turn: bool = False,
        backstop: bool = False,
    ) -> SnapshotInfo:
        """Checkpoint into ``target``, a directory of this attempt's own (never replaced).
        ``compaction_turn``: ``RocksDBOptions.compaction_turn`` of the epoch and shard;
        ``backstop``: the background compactor does the compactions (``compact_when_due``)."""
        compacted, level0_files = self.compact_when_due(compaction_turn, backstop)
        info = self.checkpoint(target, previous, previous_files)
        return replace(info, compacted=compacted, level0_files=level0_files)

    def checkpoint(self, target: Path, previous: Path | None, previous_files: FileDigests | None) -> SnapshotInfo:
        """The database as it is, checkpointed into ``target`` (which must not exist), with
        the digests of the files it shares with ``previous`` taken from ``previous_files``."""
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        rocksdict.Checkpoint(self.db).create_checkpoint(str(tmp))
        files, new_bytes = _digest(tmp, previous, previous_files or {})
        _install(tmp, target)
        return SnapshotInfo(target, files, sum(meta["size"] for meta in files.values()), new_bytes)

    def compact_when_due(self, turn: bool = False, backstop: bool = False) -> tuple[bool, int]:
        """Flush the epoch's writes to level 0 and, when ``RocksDBOptions.compaction_due``,
        fold level 0 into the base in the foreground (auto compactions are off: a shard is
        open too briefly to finish one). Whether it compacted, and the level-0 files left."""
        self.db.flush()
        live = self.db.live_files()
        level0 = sorted((f for f in live if f["level"] == 0), key=lambda f: int(Path(f["name"]).stem))
        base = sum(f["size"] for f in live if f["level"] > 0)
        newer = level0 if base else level0[1:]  # never compacted: the oldest file is the base
        base = base or sum(f["size"] for f in level0[:1])
        if not self.options.compaction_due(len(level0), sum(f["size"] for f in newer), base, turn, backstop):
            return False, len(level0)
        self.db.compact_range(None, None)
        return True, 0

    def close(self, remove: bool = True) -> None:
        self.db.close()
        if remove:
            shutil.rmtree(self.work_dir, ignore_errors=True)


def carry_forward(previous: Path, previous_files: FileDigests, target: Path) -> SnapshotInfo:
    """The snapshot of a shard an epoch left unchanged: the previous snapshot's files,
    hardlinked (snapshots are never modified), under the same digests. No RocksDB
    is opened, so an empty epoch costs a few links per shard."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    tmp.mkdir()
    try:
        for name in previous_files:
            os.link(previous / name, tmp / name)
    except FileNotFoundError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SnapshotError(f"snapshot {previous} lost a file before it could be carried forward: {exc}") from exc
    _install(tmp, target)
    files: FileDigests = {name: FileDigest(size=meta["size"], sha256=meta["sha256"])
                          for name, meta in previous_files.items()}
    return SnapshotInfo(target, files, sum(meta["size"] for meta in files.values()), 0)


def _link_or_copy(source: Path, target: Path, link: bool) -> None:
    """Hardlink an immutable file (a copy when ``source`` is on another filesystem: a
    snapshot the store restored into a cache elsewhere); copy one RocksDB rewrites."""
    if link:
        try:
            os.link(source, target)
            return
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
    shutil.copyfile(source, target)


def _install(tmp: Path, target: Path) -> None:
    """Move a finished snapshot to its attempt's name. Attempts never overwrite each
    other: a snapshot a manifest names stays as it was written."""
    if target.exists():
        shutil.rmtree(tmp, ignore_errors=True)
        raise SnapshotError(f"snapshot {target} already exists; each attempt writes its own, so this is a bug or a "
                            "copied checkpoint root: nothing was replaced")
    os.rename(tmp, target)
    fsync_dir(target.parent)


def _digest(path: Path, previous: Path | None, previous_files: FileDigests) -> tuple[FileDigests, int]:
    """Digests of a new snapshot, reusing those of files hardlinked from the previous one."""
    files: FileDigests = {}
    new_bytes = 0
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        st = entry.stat()
        prev = previous_files.get(entry.name)
        shared = (
            prev is not None
            and previous is not None
            and prev["size"] == st.st_size
            and _same_inode(st, previous / entry.name)
        )
        if shared and prev is not None:
            files[entry.name] = FileDigest(size=prev["size"], sha256=prev["sha256"])
        else:
            files[entry.name] = FileDigest(size=st.st_size, sha256=sha256_file(Path(entry.path)))
            new_bytes += st.st_size
    return files, new_bytes


def _same_inode(st: os.stat_result, other: Path) -> bool:
    try:
        o = other.stat()
    except FileNotFoundError:
        return False
    return (st.st_ino, st.st_dev) == (o.st_ino, o.st_dev)
