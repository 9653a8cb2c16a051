"""An Iceberg table as a source: an epoch reads the data files a range of the table's
snapshots appended, recorded before the first attempt, as Spark's Iceberg streaming
source does.

The snapshots are the current snapshot's ancestors after the last one read, oldest
first. An ``append`` snapshot's added data files are segments (one each, a record's
offset its row in the file); a ``replace`` (compaction) adds no records. An
``overwrite`` or ``delete`` changes rows an append-only reading would miss, and is
refused by name. A snapshot that ``expire_snapshots`` removed before its epoch
committed, or a data file gone from storage, fails the epoch by name
(``SourceDataLostError``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from volley_dagster.errors import SourceDataLostError, SourceError, SourceNotReadyError
from volley_dagster.io.paths import TableIdentity, table_identity
from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.json_records import JsonObject
from volley_dagster.sources import formats
from volley_dagster.sources.base import Source, SourceSnapshot
from volley_dagster.sources.offsets import Backlog, EpochRange, Segment, SourcePosition, TableVersion

if TYPE_CHECKING:
    from pyiceberg.table import DataScan, FileScanTask, IncrementalAppendScan, Table
    from pyiceberg.table.snapshots import Snapshot

__all__ = ["IcebergTableSource"]

PARTITION = "table"
_NO_RECORDS = ("replace",)  # rewrites files, changes no row
_APPEND = "append"


class IcebergTableSource(Source):
    """``IcebergTableSource("payments.alerts", path="tables/iceberg")`` (the local SQLite
    catalog under ``path``) or ``IcebergTableSource("payments.alerts", catalog={...})``:
    the rows each ``append`` snapshot adds, oldest first."""

    def __init__(self, table: str, catalog: dict[str, str] | None = None, path: str | os.PathLike[str] | None = None,
                 s3: S3Endpoint | None = None, catalog_name: str = "volley") -> None:
        from volley_dagster.sinks.iceberg import catalog_properties, split_identifier

        split_identifier(table)
        self.identifier = table
        self.catalog_properties = catalog_properties(catalog, path, s3, "IcebergTableSource")
        self.catalog_name = catalog_name
        self.uri = f"iceberg:{table}"
        self._schema: pa.Schema | None = None
        self._schema_id: int | None = None  # of the schema ``schema()`` read: files are projected on it
        self._files: dict[tuple[int, bool], tuple[FileScanTask, ...]] = {}  # a snapshot's files never change

    def describe(self) -> JsonObject:
        return {"type": "iceberg_table", "table": self.identifier, "read": "appends"}

    def upstream_table(self) -> TableIdentity:
        from volley_dagster.sinks.iceberg import catalog_identity

        return table_identity("iceberg", self.identifier, catalog_identity(self.catalog_properties))

    def _table(self) -> Table:
        from pyiceberg.exceptions import NoSuchTableError

        from volley_dagster.sinks.iceberg import open_catalog

        try:
            return open_catalog(self.catalog_name, self.catalog_properties).load_table(self.identifier)
        except NoSuchTableError as exc:
            raise SourceNotReadyError(f"no Iceberg table {self.identifier} yet: it is read once it exists (once the "
                                      "pipeline writing it commits its first epoch)") from exc

    def schema(self) -> pa.Schema:
        """The table's columns when first asked (then kept: every attempt reads its
        files projected on them, by field id, so a column renamed since reads the same)."""
        if self._schema is None:
            current = self._table().schema()
            self._schema_id = current.schema_id
            self._schema = formats.plain_schema(current.as_arrow())
        return self._schema

    def _table_if_any(self) -> Table | None:
        try:
            return self._table()
        except SourceNotReadyError:
            return None

    # -- the snapshots ---------------------------------------------------------------

    def _appended(self, after: Mapping[str, SourcePosition]) -> list[tuple[Snapshot, tuple[FileScanTask, ...]]]:
        """Each unread snapshot with the files it added, oldest first, up to one this
        source refuses (none while there is no table yet)."""
        table = self._table_if_any()
        if table is None:
            return []
        first_read = self._last(after) is None
        found: list[tuple[Snapshot, tuple[FileScanTask, ...]]] = []
        for i, snapshot in enumerate(self._unread(table, after, None)):
            try:
                found.append((snapshot, self._added(table, snapshot, None, whole=first_read and i == 0)))
            except SourceError:
                if not found:
                    raise  # the next snapshot to read is refused: named
                break  # the snapshots before it are read first; the next cut names it
        return found

    def _unread(self, table: Table, after: Mapping[str, SourcePosition], epoch: int | None) -> list[Snapshot]:
        """The current snapshot's ancestors after the last one read, oldest first."""
        last = self._last(after)
        chain: list[Snapshot] = []
        snapshot = table.current_snapshot()
        while snapshot is not None and snapshot.snapshot_id != last:
            chain.append(snapshot)
            parent = snapshot.parent_snapshot_id
            snapshot = table.snapshot_by_id(parent) if parent is not None else None
        # on a first read the oldest snapshot left is read whole (``_added``), as Spark starts
        if last is not None and snapshot is None:
            read_last = table.snapshot_by_id(last)
            if read_last is None:
                raise self._lost(epoch, last, "it expired (expire_snapshots), so where the next epoch starts is unknown")
            if chain and chain[-1].timestamp_ms > read_last.timestamp_ms:  # the snapshots between expired
                raise self._lost(epoch, chain[-1].snapshot_id, f"the snapshots between it and snapshot {last}, read "
                                 "last, expired (expire_snapshots) before they were read")
            raise SourceError(f"Iceberg table {self.identifier}: snapshot {last}, read last, is no longer an ancestor "
                              "of the current snapshot (a rollback?); nothing was cut. Start a new checkpoint root")
        return chain[::-1]

    def _last(self, after: Mapping[str, SourcePosition]) -> int | None:
        pos = after.get(PARTITION)
        if pos is not None and not isinstance(pos, TableVersion):
            raise SourceError(f"Iceberg table {self.identifier}: the checkpoint root was read up to {pos}, a position "
                              "of another kind of source; a checkpoint root reads one source: start a new one")
        return None if pos is None else pos.table_version

    def _lost(self, epoch: int | None, snapshot: int, what: str) -> SourceDataLostError:
        return SourceDataLostError(
            f"{'epoch %d: ' % epoch if epoch is not None else ''}Iceberg table {self.identifier} snapshot {snapshot} "
            f"can no longer be read: {what}. Nothing was {'committed' if epoch is not None else 'cut'}. Keep "
            "snapshots longer than epochs wait to run (expire_snapshots' age), or start a new checkpoint root")

    def _added(self, table: Table, snapshot: Snapshot, epoch: int | None, whole: bool = False) -> tuple[FileScanTask, ...]:
        """The data files an append snapshot added, by path; ``whole``: every data file
        it holds (where a first read starts, its history before it maybe expired)."""
        operation = snapshot.summary.operation.value if snapshot.summary is not None else _APPEND
        if not whole and operation in _NO_RECORDS:
            return ()
        if not whole and operation != _APPEND:
            raise SourceError(
                f"{'epoch %d: ' % epoch if epoch is not None else ''}Iceberg table {self.identifier} snapshot "
                f"{snapshot.snapshot_id} is an {operation!r}, which changes or deletes rows, and this source reads "
                "appends only (the table is an upsert table?). Nothing was cut: every snapshot before it is read. "
                "Read an append-only table, or start a new checkpoint root")
        cached = (snapshot.snapshot_id, whole)
        if cached not in self._files:
            scan: DataScan | IncrementalAppendScan
            if whole:
                scan = table.scan(snapshot_id=snapshot.snapshot_id)
            elif snapshot.parent_snapshot_id is not None:
                scan = table.incremental_append_scan(from_snapshot_id_exclusive=snapshot.parent_snapshot_id,
                                                     to_snapshot_id_inclusive=snapshot.snapshot_id)
            else:
                scan = table.incremental_append_scan(to_snapshot_id_inclusive=snapshot.snapshot_id)
            tasks = tuple(sorted(scan.plan_files(), key=lambda t: t.file.file_path))
            deleted = [t.file.file_path for t in tasks if t.delete_files]
            if deleted:
                raise SourceError(f"Iceberg table {self.identifier} snapshot {snapshot.snapshot_id}: data file "
                                  f"{deleted[0]} has row-level deletes, which an append-only reading cannot follow; "
                                  "read an append-only table")
            self._files[cached] = tasks
        return self._files[cached]

    # -- Source ----------------------------------------------------------------------

    def cut(self, epoch: int, after: Mapping[str, SourcePosition], max_records: int | None,
            final: bool = False) -> EpochRange:
        begin = after.get(PARTITION, TableVersion(None))
        last = self._last(after)
        segments: list[Segment] = []
        for snapshot, added in self._appended(after) if max_records != 0 else []:  # 0: several sources, one waits
            records = sum(t.file.record_count for t in added)
            if segments and max_records is not None and sum(s.records for s in segments) + records > max_records:
                break  # whole snapshots only: a snapshot is the table's unit of change
            segments.extend(Segment(len(segments) + i, PARTITION, t.file.file_path, 0, t.file.record_count,
                                    t.file.file_size_in_bytes, str(snapshot.snapshot_id)) for i, t in enumerate(added))
            last = snapshot.snapshot_id
        return EpochRange(epoch, {PARTITION: begin}, {PARTITION: TableVersion(last)}, tuple(segments))

    def backlog(self, after: Mapping[str, SourcePosition]) -> Backlog:
        unread = self._appended(after)
        records = sum(t.file.record_count for _, added in unread for t in added)
        oldest = unread[0][0].timestamp_ms / 1000.0 if unread and records else None
        return Backlog(records, len(unread), oldest)

    def verify(self, rng: EpochRange) -> None:
        table = self._table()
        for seg in rng.segments:
            if table.snapshot_by_id(int(seg.version)) is None:
                raise self._lost(rng.epoch, int(seg.version), "it expired (expire_snapshots)")
            if not table.io.new_input(seg.file).exists():
                raise self._lost(rng.epoch, int(seg.version), f"its data file {seg.file} is gone")

    def read_segment(self, seg: Segment, schema: pa.Schema, epoch: int) -> pa.Table:
        from pyiceberg.expressions import AlwaysTrue
        from pyiceberg.io.pyarrow import ArrowScan

        table = self._table()
        snapshot = table.snapshot_by_id(int(seg.version))
        if snapshot is None:
            raise self._lost(epoch, int(seg.version), "it expired (expire_snapshots)")
        task = next((t for whole in (False, True) for t in self._added(table, snapshot, epoch, whole)
                     if t.file.file_path == seg.file), None)
        if task is None:
            raise SourceError(f"epoch {epoch}: Iceberg table {self.identifier} snapshot {seg.version} does not add "
                              f"{seg.file}, which the epoch recorded; was the table re-created?")
        try:
            self.schema()  # the columns every attempt projects on
            projection = table.schemas().get(self._schema_id, table.schema()) if self._schema_id is not None \
                else table.schema()
            rows = ArrowScan(table.metadata, table.io, projection, AlwaysTrue()).to_table([task])
        except FileNotFoundError as exc:
            raise self._lost(epoch, int(seg.version), f"its data file {seg.file} is gone") from exc
        rows = rows.slice(seg.start, seg.end - seg.start)
        return formats.decode_table(rows, schema, seg.position_base() + np.arange(seg.start, seg.end, dtype=np.int64))

    def snapshot(self) -> SourceSnapshot:
        table = self._table_if_any()
        current = table.current_snapshot() if table is not None else None
        version = current.snapshot_id if current is not None else None
        return SourceSnapshot(str(version), {"snapshot_id": str(version), "read": "appends"})

