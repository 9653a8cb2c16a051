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
from volley_dagster.io.paths import TableIdentity, table_identity, table_uri
from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.json_records import JsonObject
from volley_dagster.sources import formats
from volley_dagster.sources.base import NativeParquetFile, Source, SourceSnapshot
from volley_dagster.sources.offsets import Backlog, EpochRange, Segment, SourcePosition, TableVersion
from volley_dagster.sources.storage import LocalStorage, Storage, storage_for

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
    change_files: tuple[str, ...] = ()  # its change data files (``cdc``), which the change data feed reads
    removed: tuple[str, ...] = ()  # the data files it removes: without change data files, the feed reads them

    def feed_files(self) -> tuple[str, ...]:
        """The files its change data feed reads: its change data files, else the files it adds and removes."""
        return self.change_files or tuple(a.path for a in self.added if a.data_change) + self.removed

    @classmethod
    def parse(cls, version: int, text: bytes) -> DeltaCommit:
        added: list[AddedFile] = []
        cdc: list[str] = []
        removed: list[str] = []
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
                if action["remove"].get("dataChange", True):
                    changes = True
                    removed.append(unquote(action["remove"]["path"]))
            elif "cdc" in action:
                changes = True
                cdc.append(unquote(action["cdc"]["path"]))
            elif "metaData" in action:
                mode = (action["metaData"].get("configuration") or {}).get("delta.columnMapping.mode", "none")
                mapping = mode != "none"
        return cls(version, operation, timestamp, tuple(sorted(added, key=lambda a: a.path)), changes, mapping,
                   tuple(sorted(cdc)), tuple(sorted(removed)))

    def refusal(self, uri: str) -> str | None:
        """Why an append-only reading cannot follow this commit (None: it can)."""
        if self.changes_rows:
            return (f"Delta table {uri} version {self.version} ({self.operation or 'a commit'}) changes or deletes "
                    "rows, and this source reads appends only")
        if self.column_mapping:
            return (f"Delta table {uri} version {self.version} turns on column mapping (its files name columns by "
                    "physical names), which this source's append reader does not read")
        return None


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

    def upstream_table(self) -> TableIdentity:
        return table_identity("delta", self.uri)

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
        """The table's columns when first asked (then kept: every attempt reads with them)."""
        if self._schema is None:
            table = self._table()
            mapping = table.metadata().configuration.get("delta.columnMapping.mode", "none")
            if mapping != "none" and not self.changes:
                raise SourceError(f"Delta table {self.uri} uses column mapping (delta.columnMapping.mode={mapping}), "
                                  "which this source's append reader does not read: read its change data feed "
                                  "with DeltaTableSource(..., changes=True) (the table needs "
                                  "delta.enableChangeDataFeed=true)")
            columns = formats.plain_schema(pa.schema(table.schema().to_arrow()))
            self._schema = pa.schema([*columns, *CHANGE_COLUMNS]) if self.changes else columns
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
        """The segments of a commit an append-only reading (or the change feed) can follow."""
        if self.changes:
            return [Segment(first_id, PARTITION, f"{_LOG}/{commit.version:020d}.json", 0,
                            self._change_rows(commit.version, epoch).num_rows, 0, str(commit.version))]
        segments: list[Segment] = []
        for add in commit.added:
            if add.data_change:
                records = add.records if add.records is not None else self._footer_rows(add.path, commit.version, epoch)
                segments.append(Segment(first_id + len(segments), PARTITION, add.path, 0, records, add.size,
                                        str(commit.version)))
        return segments

    def _refused(self, commit: DeltaCommit) -> SourceError:
        return SourceError(
            f"{commit.refusal(self.uri)}. Nothing was cut: every version before it is read. Read the table's "
            "changes with DeltaTableSource(..., changes=True) (the table needs delta.enableChangeDataFeed=true), "
            f"or start a new checkpoint root with starting_version={commit.version + 1} (the rows this version "
            "changed are not read)")

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
        except SourceError:
            raise
        except Exception as exc:  # delta-rs raises DeltaError, and plain Exception from its Arrow stream
            text = str(exc)
            if "does not have change data" in text.lower():
                raise SourceError(
                    f"Delta table {self.uri} version {version} has no change data feed ({text}); set "
                    "delta.enableChangeDataFeed=true on the table before the versions this source reads, or read "
                    "its appends (changes=False)") from exc
            if "not found" in text.lower():
                raise self._lost(epoch, version, f"a file its change data feed reads is gone (VACUUM): {text}") from exc
            if isinstance(exc, (DeltaError, OSError)) or "error" in text.lower():
                raise SourceUnavailableError(f"{'epoch %d: ' % epoch if epoch is not None else ''}Delta table "
                                             f"{self.uri} version {version}: its change data feed could not be read "
                                             f"({type(exc).__name__}: {text}); retried") from exc
            raise
        rows = rows.select([f.name for f in self.schema()]).cast(self.schema())
        keys = [(f.name, "ascending", "at_end") for f in rows.schema if not pa.types.is_nested(f.type)]
        return rows.take(pc.sort_indices(rows, sort_keys=keys)) if keys else rows

    # -- Source --------------------------------------------------------------------

    def _unread(self, after: Mapping[str, SourcePosition]) -> list[DeltaCommit]:
        """The commits after the last one read, up to one the append reader refuses
        (named when it is the next: nothing before it waits any more)."""
        commits: list[DeltaCommit] = []
        for version in range(self._start(after), self.latest_version() + 1):
            commit = self._commit(version)
            if not self.changes and commit.refusal(self.uri) is not None:
                if not commits:
                    raise self._refused(commit)
                break
            commits.append(commit)
        return commits

    def cut(self, epoch: int, after: Mapping[str, SourcePosition], max_records: int | None,
            final: bool = False) -> EpochRange:
        segments: list[Segment] = []
        begin = after.get(PARTITION, TableVersion(None))
        last = begin.table_version if isinstance(begin, TableVersion) else None
        # a share of nothing: several sources, one waiting for its first file
        for commit in self._unread(after) if max_records != 0 else []:
            taken = self._segments_of(commit, len(segments), None)
            if segments and max_records is not None and sum(s.records for s in segments + taken) > max_records:
                break  # whole commits only: a commit is the table's unit of change
            segments.extend(taken)
            last = commit.version
        return EpochRange(epoch, {PARTITION: begin}, {PARTITION: TableVersion(last)}, tuple(segments))

    def backlog(self, after: Mapping[str, SourcePosition]) -> Backlog:
        commits = self._unread(after)
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
                commit = self._commit(version, rng.epoch)
                for path in commit.feed_files():
                    if self.storage.stat(path) is None:
                        raise self._lost(rng.epoch, version, f"its file {path} is gone (VACUUM)")
            elif self.storage.stat(seg.file) is None:
                raise self._lost(rng.epoch, version, f"its data file {seg.file} is gone (VACUUM)")

    def native_parquet_files(self, rng: EpochRange, schema: pa.Schema) -> list[NativeParquetFile] | None:
        """An append range's data files when Spark's own scan reads them exactly: local,
        without partition values (which the files leave out), each with the columns of
        ``schema``, name and type. None otherwise: ``read_segment`` reads them."""
        if self.changes or not isinstance(self.storage, LocalStorage):
            return None
        files = []
        for seg in rng.segments:
            add = next((a for a in self._commit(int(seg.version), rng.epoch).added if a.path == seg.file), None)
            if add is None or add.partition_values:
                return None
            native = formats.native_parquet_file(self.storage.root / seg.file, schema)
            if native is None:
                return None
            files.append(native)
        return files

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
            rows = _with_partition_values(rows, add.partition_values, self.schema(),
                                          f"epoch {epoch}: Delta table {self.uri} version {version} ({seg.file})")
        if rows.num_rows < seg.end:
            raise SourceError(f"epoch {epoch}: Delta table {self.uri} version {version} ({seg.file}) holds "
                              f"{rows.num_rows} rows, not the {seg.end} recorded; was the table re-created?")
        rows = rows.slice(seg.start, seg.end - seg.start)
        return formats.decode_table(rows, schema, seg.position_base() + np.arange(seg.start, seg.end, dtype=np.int64))

    def snapshot(self) -> SourceSnapshot:
        version = self.latest_version()
        return SourceSnapshot(str(version), {"table_version": version, "read": self.describe()["read"]}
                              if version >= 0 else {"table_version": "no table yet"})


def _with_partition_values(rows: pa.Table, values: Mapping[str, str | None], schema: pa.Schema,
                           where: str) -> pa.Table:
    """A partitioned table's partition columns, which its data files leave out. Delta
    writes them as text: a timestamp as ``2024-01-02 03:04:05.123456`` in UTC."""
    for name, value in values.items():
        if name in rows.column_names or name not in schema.names:
            continue
        kind = schema.field(name).type
        text = pa.array([value] * rows.num_rows, pa.string())
        try:
            if pa.types.is_timestamp(kind):
                naive = pc.replace_substring(pc.replace_substring(text, "T", " "), "Z", "")
                column = naive.cast(pa.timestamp(kind.unit)).cast(kind)
            else:
                column = text.cast(kind)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SourceError(f"{where}: partition value {name}={value!r} does not read as {kind} ({exc}); the "
                              "epoch cannot be read as recorded") from exc
        rows = rows.append_column(name, column)
    return rows
