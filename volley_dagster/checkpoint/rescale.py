"""Rescaling: rewrite the last committed epoch's state into another shard count.

Key groups never change (``pipeline.json``); shards are contiguous key-group
ranges (``state.keys.ShardLayout``). A rescale at the boundary after epoch E
builds each new shard from the old shards whose ranges overlap its own:

- namespaces keyed by key group (``ns | key group | key``: the running aggregate,
  window state) are range scans ``[ns|lo, ns|hi)`` of the overlapping old shards,
  already in key order, so they stream into one SST;
- ``pending_index/`` entries (``ns | end | state key``) carry their key group
  inside the embedded state key, so they are filtered by it and sorted;
- the per-shard pending-window index (meta namespace) is split by the key group
  of its entries' state keys and its meta record recomputed (``PendingIndex``,
  ``PendingMeta`` through ``PersistentPendingIndex``, as a shard task does).

The SSTs (``rocksdict.SstFileWriter``) are ingested into a fresh DB per new shard,
which is checkpointed with file digests (``ShardStore.snapshot``) into
``snapshots/<E>/rescale-<seq>-<attempt>/shard-NNNN``, and, with a snapshot store,
uploaded to it as epoch E's shard under the rescale's attempt id. The rescale commits with one
exclusive, atomic write of ``layouts/<seq>.json`` (the layout, the first epoch it
applies to, the new snapshots and their digests). Before that file exists the old
layout is in force and the attempt's directories are garbage (retention removes
them with epoch E); after it, the new one. A crash leaves one or the other.

Refused: before any epoch committed, and while an epoch is cut but not committed
(an attempt of it may be running, or have half-written snapshots, in the old
layout; run it first). Rescaling to the current shard count is a no-op.

Needs no Spark: only the epoch log, the snapshots and the layout.

Fault points (``faults.py``, for kill -9 tests): ``rescale_after_shard`` (one new
shard snapshotted, ``VOLLEY_KILL_SHARD`` picks which), ``rescale_before_commit``,
``rescale_after_commit``.
"""

from __future__ import annotations

import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator, Protocol, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import rocksdict

from volley_dagster import faults
from volley_dagster.checkpoint.epoch_log import EpochLog, LayoutChange
from volley_dagster.checkpoint.lease import PipelineLease
from volley_dagster.checkpoint.manifest import ShardSnapshot
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.errors import EpochOrderError, FencedError, StateLayoutError
from volley_dagster.json_records import JsonObject
from volley_dagster.operators.base import StateNamespaces
from volley_dagster.operators.recorded import recorded_namespaces
from volley_dagster.state.keys import PREFIX_BYTES, ShardLayout, namespace_prefix
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.pending_index import PendingIndex, PersistentPendingIndex
from volley_dagster.state.store import ShardStore, SnapshotInfo, open_snapshot_read_only, verify_snapshot
from volley_dagster.state.transaction import ShardTransaction, scan_prefix, scan_range

SST_ROLL_BYTES = 256 << 20  # start another SST beyond this size
CONVERT_BATCH = 65_536  # values a migration converts at once
_STATE_KEY_GROUP_AT = 2  # state key: ns (2 B) | key group (2 B) | key
_PENDING_KEY_GROUP_AT = 2 + 8 + _STATE_KEY_GROUP_AT  # pending_index/ key: ns (2 B) | end (8 B) | state key


@dataclass(frozen=True)
class RescaleResult:
    epoch: int  # the committed epoch whose state was rewritten
    from_epoch: int  # the first epoch that runs with the new layout
    old_shards: int
    new_shards: int
    keys: int  # keyed state entries rewritten (aggregate values, or keys with open windows)
    keys_moved: int  # of those, the ones now in a shard with another number
    pending_entries: int  # evicted pending-index entries rewritten (windows)
    seconds: float
    bytes_written: int  # bytes of the new snapshots
    sequence: int | None  # the layouts/ record; None for a no-op
    noop: bool = False

    def describe(self) -> str:
        if self.noop:
            return f"already {self.new_shards} shards: nothing to do"
        return (
            f"rescaled epoch {self.epoch}'s state from {self.old_shards} to {self.new_shards} shards in "
            f"{self.seconds:.2f} s: {self.keys:,} keys ({self.keys_moved:,} moved), "
            f"{self.pending_entries:,} evicted pending entries, {self.bytes_written:,} bytes written; "
            f"epochs from {self.from_epoch} on run with {self.new_shards} shards (layouts/{self.sequence:010d}.json)"
        )


class ValueConversion(Protocol):
    """A migration's rewrite of stored values (``checkpoint/migrate.py``): the same keys,
    values in the new operator's record layout, a batch at a time in key order."""

    @property
    def aggregate(self) -> JsonObject:
        """The operator layout the converted state is in."""

    def convert(self, namespace: int, values: list[bytes]) -> list[bytes]: ...

    def kept(self, namespace: int, entries: Iterator[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        """The entries of ``namespace`` the new layout keeps (a processor's dropped state
        variable keeps none), in order."""


def rescale(
    log: EpochLog, num_shards: int, lease: PipelineLease, rocksdb: RocksDBOptions | None = None,
    verify_checksums: bool = False, conversion: ValueConversion | None = None, uncommitted_ok: bool = False,
    store: S3SnapshotStore | None = None,
) -> RescaleResult:
    """Rewrite the last committed epoch's state into ``num_shards`` shards (and with a
    ``conversion``, into another operator's layout) and record the layout for the
    epochs after it. Only under the pipeline's ``lease``, held by the caller, which is
    checked just before the layout record is written: no runner commits an epoch in
    the old layout meanwhile, and a holder that lost or outlived its lease writes
    nothing. ``uncommitted_ok``: the caller checked that no sink holds an epoch cut
    after the last committed one, so no attempt of those epochs has written anything
    that stays: they run in the new layout. ``store``: the pipeline's snapshot store,
    which gets each new shard too, so executors on their own disks restore it there."""
    if not lease.held or lease.root != log.root.absolute():
        raise FencedError(f"rescaling {log.root}: the caller must hold the pipeline's lease of that root "
                          f"({'held for ' + str(lease.root) if lease.held else 'not held'})")
    t0 = time.perf_counter()
    options = rocksdb or RocksDBOptions()
    epoch = log.last_committed()
    if epoch == 0 or not log.has_identity():
        raise EpochOrderError(
            f"cannot rescale {log.root}: no epoch is committed yet (choose the shard count with with_shards)"
        )
    old = log.current_layout()
    assert old is not None
    new = ShardLayout(num_shards, old.num_key_groups)  # validates the count
    if log.last_cut() > epoch and not uncommitted_ok:
        raise EpochOrderError(
            f"cannot rescale {log.root}: epoch {log.last_cut()} is cut but not committed (the last committed "
            f"epoch is {epoch}); an attempt of it may be running in the current layout. Run it, then rescale"
        )
    if new == old and conversion is None:
        return RescaleResult(epoch, epoch + 1, old.num_shards, num_shards, 0, 0, 0, time.perf_counter() - t0, 0, None, True)

    namespaces = recorded_namespaces(log.identity()["aggregate"])
    sources = log.state_shards(epoch)
    if sorted(sources) != list(range(old.num_shards)):
        raise StateLayoutError(
            f"epoch {epoch}'s state has shards {sorted(sources)}, its layout says {old.num_shards}"
        )
    changes = log.layout_changes()
    sequence = (changes[-1].sequence if changes else 0) + 1
    attempt = uuid.uuid4().hex[:12]
    snap_root = log.rescale_snapshot_root(epoch, sequence, attempt)
    work_root = log.work_dir(epoch) / f"rescale-{sequence:04d}-{attempt}"

    dbs: list[rocksdict.Rdict] = []
    try:
        for shard in range(old.num_shards):
            path = log.root / sources[shard].path
            verify_snapshot(path, sources[shard].files, full=verify_checksums)
            dbs.append(open_snapshot_read_only(path, options))
            _check_old_shard(dbs[-1], shard, old, namespaces)
        writer = _Rewriter(dbs, old, namespaces, options, conversion)
        shards: dict[int, ShardSnapshot] = {}
        totals = {"keys": 0, "keys_moved": 0, "pending_entries": 0, "pending_resident": 0, "bytes_written": 0}
        for shard in range(num_shards):
            info, counts = writer.build(shard, new, work_root / f"shard-{shard:04d}", snap_root / f"shard-{shard:04d}")
            snapshot = ShardSnapshot.of(info)
            if store is not None:  # under the rescale's own attempt id: the epoch's original manifests stay apart
                store.upload(epoch, shard, info.path, attempt=attempt)
                snapshot = ShardSnapshot.of(info, attempt=attempt, stored_remotely=True)
            shards[shard] = snapshot.relative_to(log.root)
            for k, v in counts.items():
                totals[k] += v
            totals["bytes_written"] += info.bytes_total
            faults.fault_point("rescale_after_shard", epoch, shard=shard)
        writer.check_complete(totals["pending_entries"], totals["pending_resident"])
    finally:
        for db in dbs:
            db.close()
        shutil.rmtree(work_root, ignore_errors=True)

    seconds = time.perf_counter() - t0
    change = LayoutChange(
        sequence=sequence, from_epoch=epoch + 1, num_shards=num_shards, num_key_groups=new.num_key_groups,
        previous_shards=old.num_shards, shards=shards,
        stats={**totals, "seconds": seconds, "created_at": datetime.now(timezone.utc).isoformat()},
        aggregate=conversion.aggregate if conversion is not None else None,
    )
    faults.fault_point("rescale_before_commit", epoch)
    lease.check(f"rescaling {log.root} to {num_shards} shards")
    if not log.record_layout_change(change):
        raise StateLayoutError(
            f"another rescale of {log.root} committed layout record {sequence} first; nothing was changed by this one"
        )
    faults.fault_point("rescale_after_commit", epoch)
    return RescaleResult(epoch, epoch + 1, old.num_shards, num_shards, totals["keys"], totals["keys_moved"],
                         totals["pending_entries"], seconds, totals["bytes_written"], sequence)


class _Rewriter:
    """Builds the new shards from the old shards' read-only snapshots."""

    def __init__(self, dbs: list[rocksdict.Rdict], old: ShardLayout, namespaces: StateNamespaces,
                 options: RocksDBOptions, conversion: ValueConversion | None = None) -> None:
        self.dbs, self.old, self.ns, self.options, self.conversion = dbs, old, namespaces, options, conversion
        self._indexes: dict[int, PendingIndex] = {}
        self._evicted: dict[int, tuple[list[tuple[bytes, bytes]], np.ndarray]] = {}

    def build(self, shard: int, new: ShardLayout, work: Path, target: Path) -> tuple[SnapshotInfo, dict[str, int]]:
        lo, hi = new.key_group_range(shard)
        overlapping = [s for s in range(self.old.num_shards) if _overlaps(self.old.key_group_range(s), (lo, hi))]
        counts = {"keys": 0, "keys_moved": 0, "pending_entries": 0, "pending_resident": 0}
        work.mkdir(parents=True, exist_ok=True)
        sst = _SstWriter(work / "ingest", self.options)
        for ns in sorted(self.ns.all()):  # namespaces in key order: the SST is written in one ascending pass
            if ns in self.ns.keyed:
                for s in overlapping:
                    o_lo, o_hi = self.old.key_group_range(s)
                    keyed = scan_range(self.dbs[s], _group_prefix(ns, max(lo, o_lo)), _group_prefix(ns, min(hi, o_hi)))
                    n = sst.add(self._converted(ns, keyed))
                    counts["keys"] += n
                    counts["keys_moved"] += n if s != shard else 0
            elif ns == self.ns.pending:
                entries = sorted(e for s in overlapping for e in self._pending_entries(s, lo, hi))
                counts["pending_entries"] += sst.add(entries)
        files = sst.finish()
        store = ShardStore(rocksdict.Rdict(str(work / "db"), self.options.build()), work / "db", self.options)
        try:
            if files:
                ingest = rocksdict.IngestExternalFileOptions()
                ingest.set_move_files(True)
                store.db.ingest_external_file([str(f) for f in files], ingest)
            if self.ns.meta is not None:
                counts["pending_resident"] = self._write_pending_index(store, overlapping, lo, hi, counts["pending_entries"])
            info = store.snapshot(target, None, None)
        finally:
            store.close()
        return info, counts

    def _converted(self, ns: int, entries: Iterable[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        """The entries with their values converted by the migration, a batch at a time."""
        if self.conversion is not None:
            entries = self.conversion.kept(ns, iter(entries))
        if self.conversion is None or ns != self.ns.state:  # a migration converts the operator's own records
            yield from entries
            return
        it = iter(entries)
        while batch := list(islice(it, CONVERT_BATCH)):
            keys = [k for k, _ in batch]
            yield from zip(keys, self.conversion.convert(ns, [v for _, v in batch]), strict=True)

    def _pending_entries(self, shard: int, lo: int, hi: int) -> list[tuple[bytes, bytes]]:
        """The old shard's evicted index entries whose state key is in key groups [lo, hi)
        (each old shard scanned once, however many new shards it feeds)."""
        if shard not in self._evicted:
            entries = list(scan_prefix(self.dbs[shard], namespace_prefix(self.ns.pending_ns)))
            groups = _key_groups([k for k, _ in entries], _PENDING_KEY_GROUP_AT) if entries else np.empty(0, np.int64)
            self._evicted[shard] = (entries, groups)
        entries, groups = self._evicted[shard]
        keep = (groups >= lo) & (groups < hi)
        return [e for e, k in zip(entries, keep, strict=True) if k]

    def _old_index(self, shard: int) -> PendingIndex:
        if shard not in self._indexes:
            txn = ShardTransaction(self.dbs[shard])
            self._indexes[shard] = PersistentPendingIndex(
                txn, namespace_prefix(self.ns.meta_ns), namespace_prefix(self.ns.pending_ns), None
            ).index
        return self._indexes[shard]

    def _write_pending_index(self, store: ShardStore, overlapping: list[int], lo: int, hi: int, evicted: int) -> int:
        """The new shard's in-memory index (the old ones' entries in its key groups, by
        end) and meta record, written as a shard task writes them; returns its size."""
        keys, ends, used = [], [], []
        for s in overlapping:
            index = self._old_index(s)
            if len(index):
                groups = _key_groups(list(index.keys), _STATE_KEY_GROUP_AT)
                keep = (groups >= lo) & (groups < hi)
                keys.append(index.keys[keep])
                ends.append(index.ends[keep])
                used.append(index.used[keep])
        txn = store.transaction()
        pending = PersistentPendingIndex(txn, namespace_prefix(self.ns.meta_ns), namespace_prefix(self.ns.pending_ns), None)
        merged = pending.index  # the new DB has none yet: empty, and marked loaded so flush writes it
        if keys:
            all_ends = np.concatenate(ends)
            order = np.argsort(all_ends, kind="stable")
            merged.keys, merged.ends, merged.used = np.concatenate(keys)[order], all_ends[order], np.concatenate(used)[order]
        pending.meta.evicted = evicted
        pending.flush()  # recomputes resident and min_end
        txn.flush()
        return len(merged)

    def check_complete(self, evicted: int, resident: int) -> None:
        """Every pending-index entry of the old shards went to exactly one new shard (an
        entry outside its old shard's key groups would otherwise be dropped)."""
        if self.ns.meta is None:
            return
        old_evicted = sum(_count(scan_prefix(db, namespace_prefix(self.ns.pending_ns))) for db in self.dbs)
        old_resident = sum(len(self._old_index(s)) for s in range(self.old.num_shards))
        if (evicted, resident) != (old_evicted, old_resident):
            raise StateLayoutError(
                f"the old shards hold {old_resident} in-memory and {old_evicted} evicted pending-index entries, the "
                f"rewrite placed {resident} and {evicted}: some lie outside their shard's key groups; nothing was changed"
            )


class _SstWriter:
    """Sorted entries into SST files of bounded size, for one ingestion."""

    def __init__(self, prefix: Path, options: RocksDBOptions) -> None:
        self.prefix, self.options = prefix, options
        self.files: list[Path] = []
        self._writer: rocksdict.SstFileWriter | None = None

    def add(self, entries: Iterable[tuple[bytes, bytes]]) -> int:
        n = 0
        writer = self._writer
        for key, value in entries:
            if writer is None:
                writer = self._writer = rocksdict.SstFileWriter(options=self.options.build())
                self.files.append(self.prefix.with_name(f"{self.prefix.name}-{len(self.files):04d}.sst"))
                writer.open(str(self.files[-1]))
            writer[key] = value
            n += 1
            if n % 65536 == 0 and writer.file_size() >= SST_ROLL_BYTES:
                writer.finish()
                writer = self._writer = None
        return n

    def finish(self) -> list[Path]:
        if self._writer is not None:
            self._writer.finish()
            self._writer = None
        return self.files


def _check_old_shard(db: rocksdict.Rdict, shard: int, layout: ShardLayout, namespaces: StateNamespaces) -> None:
    """Every namespace in the old shard is one the rewrite knows, and its keyed entries
    lie in the shard's key groups (so range scans miss nothing)."""
    lo, hi = layout.key_group_range(shard)
    lower = b""
    while True:
        first = cast("bytes | None", next(iter(db.keys(from_key=lower)), None))
        if first is None:
            return
        ns = int.from_bytes(first[:2], "big")
        if ns not in namespaces.all():
            raise StateLayoutError(
                f"shard {shard} holds state in namespace {ns}, which this operator does not write "
                f"(known: {sorted(namespaces.all())}); refusing to rescale rather than drop it"
            )
        if ns == 0xFFFF:
            return
        upper = namespace_prefix(ns + 1)
        if ns in namespaces.keyed:
            read_opt = rocksdict.ReadOptions()
            read_opt.set_iterate_upper_bound(upper)
            last = cast(bytes, next(iter(db.keys(backwards=True, from_key=upper, read_opt=read_opt))))
            for key in (first, last):
                group = int.from_bytes(key[_STATE_KEY_GROUP_AT:PREFIX_BYTES], "big")
                if not lo <= group < hi:
                    raise StateLayoutError(
                        f"shard {shard} holds a key of key group {group} in namespace {ns}, outside its range "
                        f"[{lo}, {hi}) of {layout.num_shards} shards: the snapshot does not match the layout history"
                    )
        lower = upper


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _group_prefix(namespace: int, key_group: int) -> bytes:
    return namespace_prefix(namespace) + int(key_group).to_bytes(2, "big")


def _key_groups(keys: list[bytes], offset: int) -> np.ndarray:
    """The 2-byte big-endian key group at ``offset`` of each key, in bulk."""
    arr = pa.array(keys, pa.binary())
    groups = pc.binary_slice(arr, offset, offset + 2).cast(pa.binary(2))
    return np.frombuffer(groups.buffers()[1], dtype=">u2", count=len(arr)).astype(np.int64)



def _count(items: Iterable[object]) -> int:
    return sum(1 for _ in items)
