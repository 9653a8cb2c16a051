"""Where a committed epoch's shard snapshots are, and bringing one onto this machine.

The one place that turns an epoch's recorded shard snapshots into something a task
can open: the checkpoint root's copy, or the snapshot store's (restored into this
user's cache and removed after use). The epoch attempt restores N-1 through it, the
deduplication probe reads N-1 through it, and state reads (``state_reader.py``) read
any retained epoch through it (Flink keeps restore in one place alike:
``RocksDBIncrementalRestoreOperation``).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from volley_dagster.checkpoint.manifest import ShardSnapshot, SnapshotDownload
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.errors import SnapshotError
from volley_dagster.state.digests import FileDigests
from volley_dagster.state.store import verify_snapshot

__all__ = ["SnapshotRef", "locate", "on_this_machine"]


@dataclass(frozen=True)
class SnapshotRef:
    """One shard's snapshot of one committed epoch, as a task finds it: picklable."""

    shard: int
    path: str  # absolute, on the checkpoint root
    files: FileDigests
    remote_epoch: int | None = None  # the epoch whose copy the snapshot store holds (None: no copy)
    remote_attempt: str | None = None  # the attempt that uploaded it (None: a store written before attempts)


def locate(root: Path, epoch: int, shards: Mapping[int, ShardSnapshot], store: S3SnapshotStore | None, *,
           verify: bool | None, retained: Callable[[], list[int]] = list) -> dict[int, SnapshotRef]:
    """``epoch``'s shard snapshots, each where a task finds it. A snapshot on this
    machine is checked against its digests when ``verify`` is not None (sizes, or every
    byte when True), so a corrupt one fails before Spark starts work; one neither here
    nor in the store (retention removed it) is a ``SnapshotError`` naming the ``retained()`` epochs."""
    refs = {}
    for shard, snap in sorted(shards.items()):
        path = root / snap.path
        remote = store is not None and snap.stored_remotely
        if path.exists() or not remote:
            if not path.exists():
                raise SnapshotError(
                    f"epoch {epoch}'s snapshot of shard {shard} ({path}) was removed by retention or deleted, and no "
                    f"snapshot store holds a copy; retained epochs: {retained()}: read one of those, or restore "
                    "the checkpoint root from a copy"
                )
            if verify is not None:
                verify_snapshot(path, snap.files, full=verify)
        refs[shard] = SnapshotRef(shard, str(path), snap.files, epoch if remote else None, snap.attempt)
    return refs


@contextlib.contextmanager
def on_this_machine(ref: SnapshotRef | None, store: S3SnapshotStore | None,
                    cache_root: str) -> Iterator[tuple[Path | None, SnapshotDownload | None]]:
    """The snapshot as a local directory (None: no snapshot, the first epoch) and what
    bringing it here cost: the checkpoint root's copy, or when it is not on this
    machine, the store's restored into ``cache_root`` and removed when the block ends."""
    if ref is None:
        yield None, None
        return
    path = Path(ref.path)
    if path.exists() or store is None:
        yield path, None
        return
    if ref.remote_epoch is None:
        raise SnapshotError(
            f"snapshot {ref.path} of shard {ref.shard} is not on this machine and the snapshot store has no copy of "
            "it: a rescale or migration run without the snapshot store rewrote it on the checkpoint root only. Run "
            "the next epoch where the checkpoint root is on disk (a local Spark); its snapshots go to the store again"
        )
    restored = store.restore(ref.remote_epoch, ref.shard, Path(cache_root), attempt=ref.remote_attempt)
    try:
        yield restored.path, SnapshotDownload(restored.bytes_downloaded, restored.seconds)
    finally:
        shutil.rmtree(restored.path, ignore_errors=True)
