"""Reading what a committed epoch's shard snapshots hold, as Arrow, without changing
a byte of them: snapshots are checked against their manifest digests and opened
read-only, and one that is only in the snapshot store is restored into a private
copy that is removed after the read.

One shard is read in bounded batches (``batch_keys`` state records at a time), so a
Spark task that reads a shard (``spark/state_table.py``) holds one batch, never the
shard, and the driver's ``EpochRunner.read_state`` uses the same code.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.errors import ConfigError, SnapshotError
from volley_dagster.operators import recorded_operator
from volley_dagster.operators.base import StatefulOperator
from volley_dagster.state.keys import decode_keys, key_columns, namespace_prefix
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.pending_index import stored_entries
from volley_dagster.state.store import FileDigests, open_snapshot_read_only, verify_snapshot
from volley_dagster.state.transaction import scan_prefix

StateView = Literal["state", "pending"]  # the operator's state rows, or its pending entries (windows, state TTL)
KEY_GROUP, SHARD = "key_group", "shard"
WINDOW_END, EVICTED = "window_end", "evicted"
_TIMESTAMP = pa.timestamp("us", tz="UTC")


@dataclass(frozen=True)
class ShardToRead:
    """One shard's snapshot of one epoch: on the checkpoint root, or in the snapshot store."""

    shard: int
    path: str
    files: FileDigests
    remote_epoch: int | None = None  # the epoch whose copy the snapshot store holds (None: no copy)
    remote_attempt: str | None = None


def shards_to_read(log: EpochLog, epoch: int, store: S3SnapshotStore | None) -> list[ShardToRead]:
    """The shards of a committed epoch, each where a reader finds it; a shard neither on
    this machine nor in the store (retention removed it) is a ``SnapshotError`` here,
    before any task starts."""
    shards = []
    for shard, snap in sorted(log.state_shards(epoch).items()):  # after a rescale of the epoch: its rewrite
        path = log.root / snap.path
        remote = store is not None and snap.stored_remotely
        if not remote and not path.exists():
            raise SnapshotError(
                f"epoch {epoch}'s snapshot of shard {shard} ({path}) was removed by retention; "
                f"retained epochs: {log.retained_snapshots()}: read one of those"
            )
        shards.append(ShardToRead(shard, str(path), snap.files, epoch if remote else None, snap.attempt))
    return shards


@dataclass(frozen=True)
class ReadSettings:
    """Where snapshots that are not on this machine come from, and how they are opened."""

    store: S3SnapshotStore | None = None
    cache_root: str = ""  # this user's snapshot cache: a snapshot only the store holds is restored there
    rocksdb: RocksDBOptions | None = None
    verify_checksums: bool = False


def recorded_reader(log: EpochLog, epoch: int, settings: ReadSettings | None = None) -> StateReader:
    """The reader of a checkpoint root's snapshots of ``epoch``, from the root alone: the
    operator and key it recorded (``pipeline.json``, and a migration's layout record
    from the epoch it rewrote on), so a tool needs no pipeline."""
    if not log.has_identity():
        raise ConfigError(f"{log.root} is not a checkpoint root (it has no pipeline.json): no epoch ran there")
    identity = log.identity(epoch)
    return StateReader(recorded_operator(identity["aggregate"]), identity["key_kind"], identity["key_column"],
                       settings or ReadSettings())


@dataclass(frozen=True)
class StateReader:
    """Decodes one operator's snapshots: picklable, so Spark tasks run it as it is."""

    operator: StatefulOperator
    key_kind: str  # "int" | "str", as the checkpoint root recorded it
    key_name: str
    settings: ReadSettings = ReadSettings()
    batch_keys: int = 65_536

    def schema(self, view: StateView) -> pa.Schema:
        """The columns ``read`` yields: the view's rows, then ``shard``."""
        self._check(view)
        empty = self._state_rows([], [], 0) if view == "state" else self._pending_rows([], [], [], 0)
        return empty.schema

    def read(self, shard: ShardToRead, view: StateView) -> Iterator[pa.Table]:
        """The shard's rows of ``view``, a batch at a time."""
        self._check(view)
        with self._local(shard) as path:
            verify_snapshot(path, shard.files, full=self.settings.verify_checksums)
            db = open_snapshot_read_only(path, self.settings.rocksdb)
            try:
                if view == "state":
                    entries = scan_prefix(db, namespace_prefix(self.operator.namespaces.state))
                    while batch := list(islice(entries, self.batch_keys)):
                        yield self._state_rows([k for k, _ in batch], [v for _, v in batch], shard.shard)
                else:
                    namespaces = self.operator.namespaces
                    evicted_ns = namespace_prefix(namespaces.pending_ns)
                    index_record = db.get(namespace_prefix(namespaces.meta_ns) + b"index")
                    evicted = [k for k, _ in scan_prefix(db, evicted_ns)]
                    keys, ends, flags = stored_entries(index_record, evicted, evicted_ns)
                    yield self._pending_rows(keys, ends.tolist(), flags.tolist(), shard.shard)
            finally:
                db.close()

    def _check(self, view: StateView) -> None:
        if view == "pending" and self.operator.namespaces.pending is None:
            raise ConfigError("pending entries are kept by window operators and state TTLs only; this state has none")

    def _state_rows(self, keys: list[bytes], values: list[bytes], shard: int) -> pa.Table:
        table = self.operator.decode_state(keys, values, self.key_kind, self.key_name, key_group=KEY_GROUP)
        return _with_shard(table, shard)

    def _pending_rows(self, keys: list[bytes], ends: list[int], evicted: list[bool], shard: int) -> pa.Table:
        """Pending entries: which key has a window ending when (a state TTL: when the key
        is next looked at, ``expires_in_epoch`` or ``expires_at``), and whether the entry
        was evicted from the in-memory index to RocksDB (``max_pending_windows``)."""
        groups, key_values = decode_keys(self.key_kind, keys)
        front, names = key_columns(key_values, self.key_name, groups, KEY_GROUP)
        ttl = getattr(self.operator, "ttl", None)
        when, name = pa.array(ends, pa.int64()), "expires_in_epoch"
        if ttl is None or not ttl.by_epochs:
            when, name = when.cast(_TIMESTAMP), WINDOW_END if ttl is None else "expires_at"
        table = pa.table(front + [when, pa.array(evicted, pa.bool_())], names=names + [name, EVICTED])
        return _with_shard(table, shard)

    @contextlib.contextmanager
    def _local(self, shard: ShardToRead) -> Iterator[Path]:
        """The snapshot on this machine: the checkpoint root's copy, or one restored from
        the store into this user's snapshot cache and removed after the read."""
        path = Path(shard.path)
        store = self.settings.store
        if path.exists() or store is None or shard.remote_epoch is None:
            if not path.exists():
                raise SnapshotError(f"snapshot {path} of shard {shard.shard} is not on this machine and the snapshot "
                                    "store has no copy of it")
            yield path
            return
        restored = store.restore(shard.remote_epoch, shard.shard, Path(self.settings.cache_root),
                                 attempt=shard.remote_attempt).path
        try:
            yield restored
        finally:
            shutil.rmtree(restored, ignore_errors=True)


def _with_shard(table: pa.Table, shard: int) -> pa.Table:
    return table.append_column(SHARD, pa.array(np.full(table.num_rows, shard, np.int32)))
