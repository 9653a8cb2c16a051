"""Reading what a committed epoch's shard snapshots hold, as Arrow, without changing
a byte of them: snapshots are checked against their manifest digests and opened
read-only, and one that is only in the snapshot store is restored into a private
copy that is removed after the read.

One shard is read in bounded batches (``batch_keys`` state records at a time), so a
Spark task that reads a shard (``spark/state_table.py``) holds one batch, never the
shard, and the driver's ``EpochRunner.read_state`` uses the same code.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Literal

import numpy as np
import pyarrow as pa

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.checkpoint.snapshots import SnapshotRef, locate, on_this_machine
from volley_dagster.errors import ConfigError
from volley_dagster.operators.base import StatefulOperator
from volley_dagster.operators.recorded import recorded_operator
from volley_dagster.state.keys import decode_keys, key_columns, namespace_prefix
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.pending_index import stored_entries
from volley_dagster.state.store import open_snapshot_read_only, verify_snapshot
from volley_dagster.state.transaction import scan_prefix

StateView = Literal["state", "pending"]  # the operator's state rows, or its pending entries (windows, state TTL)
KEY_GROUP, SHARD = "key_group", "shard"
WINDOW_END, EVICTED = "window_end", "evicted"
_TIMESTAMP = pa.timestamp("us", tz="UTC")


def shards_to_read(log: EpochLog, epoch: int, store: S3SnapshotStore | None) -> list[SnapshotRef]:
    """The shards of a committed epoch, each where a reader finds it; a shard neither on
    this machine nor in the store (retention removed it) is a ``SnapshotError`` here,
    before any task starts. After a rescale of the epoch: its rewrite."""
    return list(locate(log.root, epoch, log.state_shards(epoch), store, verify=None,
                       retained=log.retained_snapshots).values())


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


def read_state(log: EpochLog, epoch: int, settings: ReadSettings, keys: Sequence[str] | None) -> pa.Table:
    """The full keyed state of a committed, retained epoch, read on the driver from its
    snapshots, sorted by ``keys`` (None: the first column, a deduplication's key)."""
    reader = recorded_reader(log, epoch, settings)
    tables = [t for shard in shards_to_read(log, epoch, settings.store) for t in reader.read(shard, "state")]
    table = pa.concat_tables(tables) if tables else reader.schema("state").empty_table()
    table = table.drop_columns([KEY_GROUP, SHARD])
    return table.sort_by([(c, "ascending") for c in (keys or table.column_names[:1])])


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

    def read(self, shard: SnapshotRef, view: StateView) -> Iterator[pa.Table]:
        """The shard's rows of ``view``, a batch at a time."""
        self._check(view)
        with on_this_machine(shard, self.settings.store, self.settings.cache_root) as (path, _):
            assert path is not None
            verify_snapshot(path, shard.files, full=self.settings.verify_checksums)
            db = open_snapshot_read_only(path, self.settings.rocksdb)
            try:
                if view == "state":
                    for ns in self.operator.namespaces.state_shown:
                        entries = scan_prefix(db, namespace_prefix(ns))
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


def _with_shard(table: pa.Table, shard: int) -> pa.Table:
    return table.append_column(SHARD, pa.array(np.full(table.num_rows, shard, np.int32)))
