"""A Delta table as a source: an epoch reads a range of the table's commits, as
Spark's Delta streaming source does, recorded before the first attempt.

Appends (``changes=False``) are read from the data files each commit adds, one
segment per file, so a record's offset is its row in that file. A commit that
removes or rewrites rows (a MERGE, an UPDATE, a DELETE) is refused by name, since an
append-only reading would lose what it changed; one that only rearranges files
(OPTIMIZE: ``dataChange`` false) adds no records. ``changes=True`` reads every
commit's change data feed (``DeltaTable.load_cdf``) instead: rows carry
``_change_type`` (insert, update_preimage, update_postimage, delete),
``_commit_version`` and ``_commit_timestamp``, one segment per commit, ordered by
their values so a retry gives every row the same offset.

Commits are read from the table's log (``_delta_log/<version>.json``), which is
never rewritten: a range names the versions and files it read, and an epoch whose
commit file or data files VACUUM or log cleanup removed fails by name
(``SourceDataLostError``), naming the retention to raise.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from volley_dagster.errors import (
    ConfigError,
    SourceDataLostError,
    SourceError,
    SourceNotReadyError,
    SourceUnavailableError,
)
from volley_dagster.io.paths import table_uri
from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.json_records import JsonObject
from volley_dagster.sources import formats
from volley_dagster.sources.base import Source, SourceSnapshot
from volley_dagster.sources.offsets import Backlog, EpochRange, Segment, SourcePosition, TableVersion
from volley_dagster.sources.storage import Storage, storage_for

__all__ = ["DeltaTableSource"]

PARTITION = "table"  # a table is one partition of the log: its commits are totally ordered
CHANGE_COLUMNS = pa.schema([("_change_type", pa.string()), ("_commit_version", pa.int64()),
                            ("_commit_timestamp", pa.timestamp("us", tz="UTC"))])
_LOG = "_delta_log"


@dataclass(frozen=True)
class AddedFile:
    """A data file one commit adds: its path in the table, size, rows and partition values."""

    path: str
    size: int
    records: int | None  # None: the log has no statistics for it
    partition_values: Mapping[str, str | None]
    data_change: bool


@dataclass(frozen=True)
class DeltaCommit:
    """One version's actions, as far as reading its records needs them."""

    version: int
    operation: str
    timestamp_ms: int | None
    added: tuple[AddedFile, ...]
    changes_rows: bool  # it removes rows, or writes a change data file: not an append
    column_mapping: bool

    @classmethod
    def parse(cls, version: int, text: bytes) -> DeltaCommit:
        added: list[AddedFile] = []
        operation, timestamp, changes, mapping = "", None, False, False
        for line in text.splitlines():
            if not line.strip():
                continue
            action = json.loads(line)
            if "commitInfo" in action:
                operation = str(action["commitInfo"].get("operation", ""))
                timestamp = action["commitInfo"].get("timestamp")
            elif "add" in action:
                add = action["add"]
                stats = json.loads(add["stats"]) if add.get("stats") else {}
                added.append(AddedFile(unquote(add["path"]), int(add.get("size", 0)), stats.get("numRecords"),
                                       add.get("partitionValues") or {}, bool(add.get("dataChange", True))))
                changes |= add.get("deletionVector") is not None and bool(add.get("dataChange", True))
            elif "remove" in action:
                changes |= bool(action["remove"].get("dataChange", True))
            elif "cdc" in action:
                changes = True
            elif "metaData" in action:
                mode = (action["metaData"].get("configuration") or {}).get("delta.columnMapping.mode", "none")
                mapping = mode != "none"
        return cls(version, operation, timestamp, tuple(sorted(added, key=lambda a: a.path)), changes, mapping)


class DeltaTableSource(Source):
    """``DeltaTableSource("tables/alerts")`` reads the rows each commit appends;
    ``DeltaTableSource("s3://bucket/alerts", changes=True, s3=endpoint)`` reads every
    commit's change data feed (the table needs ``delta.enableChangeDataFeed``).
    ``starting_version``: the first commit read (0: the table's whole history)."""

    def __init__(self, uri: str | os.PathLike[str], *, changes: bool = False, starting_version: int = 0,
                 s3: S3Endpoint | None = None, storage_options: dict[str, str] | None = None) -> None:
        if starting_version < 0:
            raise ConfigError(f"starting_version {starting_version}: a Delta version is 0 or more")
        self.uri = table_uri(uri)
        self.changes = changes
        self.starting_version = starting_version
        self.storage_options = {**(s3.delta_storage_options() if s3 else {}), **(storage_options or {})}
        self.storage: Storage = storage_for(self.uri, s3.boto3_options() if s3 else None)
        self._schema: pa.Schema | None = None
        self._commits: dict[int, DeltaCommit] = {}  # a commit file is never rewritten

    def describe(self) -> JsonObject:
        return {"type": "delta_table", "uri": self.uri, "read": "changes" if self.changes else "appends"}

    def upstream_table(self) -> tuple[str, str]:
        return ("delta", self.uri)

    def _table(self) -> Any:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        try:
            return DeltaTable(self.uri, storage_options=self.storage_options or None)
        except TableNotFoundError as exc:
            raise SourceNotReadyError(f"no Delta table at {self.uri} yet: it is read once it exists (once the "
                                      "pipeline writing it commits its first epoch)") from exc
        except OSError as exc:
            raise SourceUnavailableError(f"Delta table {self.uri}: {exc}") from exc

    def schema(self) -> pa.Schema:
        if self._schema is None:
            table = formats.plain_schema(pa.schema(self._table().schema().to_arrow()))
            self._schema = pa.schema([*table, *CHANGE_COLUMNS]) if self.changes else table
        return self._schema

    # -- the log -------------------------------------------------------------------

    def latest_version(self) -> int:
        """The table's newest version; -1 while there is no table yet."""
        try:
            return int(self._table().version())
        except SourceNotReadyError:
            return -1

    def _commit(self, version: int, epoch: int | None = None) -> DeltaCommit:
        """Version ``version``'s actions, read from its commit file once per process."""
        if version not in self._commits:
            name = f"{_LOG}/{version:020d}.json"
            if self.storage.stat(name) is None:
                raise self._lost(epoch, version, f"its commit file {name} is gone (log cleanup)")
            self._commits[version] = DeltaCommit.parse(version, self.storage.read(name))
        return self._commits[version]

    def _lost(self, epoch: int | None, version: int, what: str) -> SourceDataLostError:
        when = f"epoch {epoch}: " if epoch is not None else ""
        return SourceDataLostError(
            f"{when}Delta table {self.uri} version {version} can no longer be read: {what}. Nothing was "
            f"{'committed' if epoch is not None else 'cut'}; the range cannot be read exactly any more. Keep the "
            "table's history longer than epochs wait to run (delta.logRetentionDuration, VACUUM's retention), or "
            "start a new checkpoint root with starting_version past it")

    def _start(self, after: Mapping[str, SourcePosition]) -> int:
        pos = after.get(PARTITION)
        if pos is None:
            return self.starting_version
        if not isinstance(pos, TableVersion):
            raise SourceError(f"Delta table {self.uri}: the checkpoint root was read up to {pos}, a position of "
                              "another kind of source; a checkpoint root reads one source: start a new one")
        return self.starting_version if pos.table_version is None else pos.table_version + 1

    def _segments_of(self, commit: DeltaCommit, first_id: int, epoch: int | None) -> list[Segment]:
        if self.changes:
            return [Segment(first_id, PARTITION, f"{_LOG}/{commit.version:020d}.json", 0,
                            self._change_rows(commit.version, epoch).num_rows, 0, str(commit.version))]
        if commit.changes_rows:
            raise SourceError(
                f"{'epoch %d: ' % epoch if epoch is not None else ''}Delta table {self.uri} version {commit.version} "
                f"({commit.operation or 'a commit'}) changes or deletes rows, and this source reads appends only. "
                "Nothing was cut. Read the table's changes with DeltaTableSource(..., changes=True) (the table needs "
                "delta.enableChangeDataFeed=true), or start a new checkpoint root with starting_version past it")
        if commit.column_mapping:
            raise SourceError(f"Delta table {self.uri} version {commit.version} turns on column mapping, which the "
                              "append reader does not read; read it with changes=True")
        segments: list[Segment] = []
        for add in commit.added:
            if add.data_change:
                records = add.records if add.records is not None else self._footer_rows(add.path, commit.version, epoch)
                segments.append(Segment(first_id + len(segments), PARTITION, add.path, 0, records, add.size,
                                        str(commit.version)))
        return segments

    def _footer_rows(self, path: str, version: int, epoch: int | None) -> int:
        return pq.ParquetFile(pa.BufferReader(self._data(path, version, epoch))).metadata.num_rows

    def _data(self, path: str, version: int, epoch: int | None) -> bytes:
        if "://" in path or path.startswith("/"):
            raise SourceError(f"Delta table {self.uri} version {version} adds a file outside the table ({path}, a "
                              "shallow clone?), which this source does not read")
        if self.storage.stat(path) is None:
            raise self._lost(epoch, version, f"its data file {path} is gone (VACUUM)")
        return self.storage.read(path)

    def _change_rows(self, version: int, epoch: int | None) -> pa.Table:
        """Version ``version``'s change data feed, ordered by its values."""
        from deltalake.exceptions import DeltaError

        try:
            read = self._table().load_cdf(starting_version=version, ending_version=version)
            rows = pa.table(read.read_all())
        except DeltaError as exc:
            text = str(exc)
            if "change data" in text.lower():
                raise SourceError(
                    f"Delta table {self.uri} version {version} has no change data feed ({text}); set "
                    "delta.enableChangeDataFeed=true on the table before the versions this source reads, or read "
                    "its appends (changes=False)") from exc
            raise self._lost(epoch, version, text) from exc
        rows = rows.select([f.name for f in self.schema()]).cast(self.schema())
        keys = [(f.name, "ascending", "at_end") for f in rows.schema if not pa.types.is_nested(f.type)]
        return rows.take(pc.sort_indices(rows, sort_keys=keys)) if keys else rows

    # -- Source --------------------------------------------------------------------

    def cut(self, epoch: int, after: Mapping[str, SourcePosition], max_records: int | None,
            final: bool = False) -> EpochRange:
        start, latest = self._start(after), self.latest_version()
        segments: list[Segment] = []
        begin = after.get(PARTITION, TableVersion(None))
        last = begin.table_version if isinstance(begin, TableVersion) else None
        for version in range(start, latest + 1):
            taken = self._segments_of(self._commit(version), len(segments), None)
            if segments and max_records is not None and sum(s.records for s in segments + taken) > max_records:
                break  # whole commits only: a commit is the table's unit of change
            segments.extend(taken)
            last = version
        return EpochRange(epoch, {PARTITION: begin}, {PARTITION: TableVersion(last)}, tuple(segments))

    def backlog(self, after: Mapping[str, SourcePosition]) -> Backlog:
        start, latest = self._start(after), self.latest_version()
        commits = [self._commit(v) for v in range(start, latest + 1)]
        files = [a for c in commits for a in c.added if a.data_change]
        records = sum(a.records or 0 for a in files)
        if self.changes:  # the feed's rows, as far as the log's statistics tell
            records = max(records, len(commits))
        oldest = next((c.timestamp_ms / 1000.0 for c in commits if c.timestamp_ms is not None), None)
        return Backlog(records, len(commits), oldest if records else None)

    def verify(self, rng: EpochRange) -> None:
        for seg in rng.segments:
            version = int(seg.version)
            if self.changes:
                self._commit(version, rng.epoch)
            elif self.storage.stat(seg.file) is None:
                raise self._lost(rng.epoch, version, f"its data file {seg.file} is gone (VACUUM)")

    def read_segment(self, seg: Segment, schema: pa.Schema, epoch: int) -> pa.Table:
        version = int(seg.version)
        if self.changes:
            rows = self._change_rows(version, epoch)
        else:
            add = next((a for a in self._commit(version, epoch).added if a.path == seg.file), None)
            if add is None:
                raise SourceError(f"epoch {epoch}: Delta table {self.uri} version {version} does not add {seg.file}, "
                                  "which the epoch recorded; was the table deleted and re-created?")
            rows = pq.read_table(pa.BufferReader(self._data(seg.file, version, epoch)))
            rows = _with_partition_values(rows, add.partition_values, self.schema())
        if rows.num_rows < seg.end:
            raise SourceError(f"epoch {epoch}: Delta table {self.uri} version {version} ({seg.file}) holds "
                              f"{rows.num_rows} rows, not the {seg.end} recorded; was the table re-created?")
        rows = rows.slice(seg.start, seg.end - seg.start)
        return formats.decode_table(rows, schema, seg.position_base() + np.arange(seg.start, seg.end, dtype=np.int64))

    def snapshot(self) -> SourceSnapshot:
        version = self.latest_version()
        return SourceSnapshot(str(version), {"table_version": version, "read": self.describe()["read"]}
                              if version >= 0 else {"table_version": "no table yet"})


def _with_partition_values(rows: pa.Table, values: Mapping[str, str | None], schema: pa.Schema) -> pa.Table:
    """A partitioned table's partition columns, which its data files leave out."""
    for name, value in values.items():
        if name in rows.column_names or name not in schema.names:
            continue
        column = pa.array([value] * rows.num_rows, pa.string()).cast(schema.field(name).type)
        rows = rows.append_column(name, column)
    return rows
