"""Compacted alternates of committed shard snapshots: the same state as a snapshot,
its level 0 folded into the base, written beside it by the background compactor
(``compactor.py``) so that the next epoch restores a compacted shard instead of
compacting one on its own critical path (RisingWave's Hummock moves compaction off
the write path to its compactor nodes alike).

A snapshot, and the ``snapshots/`` folder, are never changed. The alternate of
``snapshots/<epoch>/<name>`` is a second RocksDB checkpoint in
``compacted/<epoch>/<name>-<id>/`` under the same checkpoint root (hardlinks need the
same filesystem; each compaction writes its own folder, so two compactors never
write one), trusted only through the record ``<name>.json`` beside it (written last
and atomically), which names that folder, the digests of the snapshot it was made
from and its own files' digests. A task that finds no record, a record of other digests, or
a file of the wrong size restores the snapshot itself: an alternate is a shortcut,
never the truth, and no manifest names one. Once the next epoch commits nothing
restores from an epoch's alternates, and the prune removes them (``remove_alternates``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from volley_dagster.errors import SnapshotError
from volley_dagster.io.atomic import read_json, write_json_atomic
from volley_dagster.state.digests import FileDigests
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.store import ShardStore, verify_snapshot

ALTERNATES = "compacted"  # under the checkpoint root, beside snapshots/


@dataclass(frozen=True)
class RestoreSource:
    """What a task restores a shard from: the snapshot itself, or its compacted alternate."""

    path: Path | None  # None: no snapshot, the first epoch
    files: FileDigests | None
    compacted: bool = False  # the alternate: it shares no SST with the snapshot


def record_path(root: Path, snapshot: Path) -> Path | None:
    """Where the record of the alternate of a snapshot under ``root``'s ``snapshots/``
    goes (None: the snapshot is elsewhere)."""
    try:
        relative = snapshot.relative_to(root / "snapshots")
    except ValueError:
        return None
    return (root / ALTERNATES / relative).with_name(f"{snapshot.name}.json")


def made_from(files: FileDigests) -> str:
    """One digest of a snapshot's file digests: what an alternate must have been made from."""
    canonical = json.dumps({name: [meta["size"], meta["sha256"]] for name, meta in sorted(files.items())})
    return hashlib.sha256(canonical.encode()).hexdigest()


def restore_source(root: Path, snapshot: Path | None, files: FileDigests | None, full: bool = False) -> RestoreSource:
    """The alternate of a snapshot under checkpoint root ``root`` when it has a sound
    one (``full``: every byte checked against its digests, else sizes), else the snapshot."""
    record = record_path(root, snapshot) if snapshot is not None and files is not None else None
    if record is None:
        return RestoreSource(snapshot, files)
    try:
        data = read_json(record)
        alternate, alternate_files = record.with_name(data["dir"]), data["files"]
        if data["of"] != made_from(files or {}) or alternate.parent != record.parent:
            return RestoreSource(snapshot, files)
        verify_snapshot(alternate, alternate_files, full=full)
    except (OSError, ValueError, KeyError, TypeError, SnapshotError):  # none; cut short; not as recorded
        return RestoreSource(snapshot, files)
    return RestoreSource(alternate, alternate_files, compacted=True)


def compact_snapshot(root: Path, snapshot: Path, files: FileDigests, options: RocksDBOptions,
                     turn: bool = False) -> bool:
    """Write the alternate of ``snapshot`` (under checkpoint root ``root``) when its
    level 0 is due a compaction (``RocksDBOptions.compaction_due``; ``turn``: its
    ``compaction_turn``). Whether one exists now. A process killed midway leaves a
    folder no record names, which the prune removes with the epoch's alternates."""
    record = record_path(root, snapshot)
    if record is None or not snapshot.is_dir():  # not a snapshot of this root; or retention got there first
        return False
    if restore_source(root, snapshot, files).compacted:
        return True
    name = f"{snapshot.name}-{uuid.uuid4().hex[:8]}"
    store = ShardStore.restore(snapshot, files, record.with_name(f".{name}.work"), options)
    try:
        compacted, _ = store.compact_when_due(turn)
        if not compacted:
            return False
        info = store.checkpoint(record.with_name(name), snapshot, files)
    finally:
        store.close()
    write_json_atomic(record, {"of": made_from(files), "dir": name, "files": info.files})
    return True


def remove_alternates(root: Path, before: int) -> None:
    """Remove the alternates of the epochs before ``before`` (the last committed): nothing
    restores from them any more. A compactor still at work in one (late) fails its job,
    which costs nothing."""
    folder = root / ALTERNATES
    if folder.is_dir():
        for entry in folder.iterdir():
            if entry.name.isdigit() and int(entry.name) < before:
                shutil.rmtree(entry, ignore_errors=True)
