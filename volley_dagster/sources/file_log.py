"""An append-only log of Parquet or JSON-lines files, optionally split into
partitions (one sub-folder each).

Files are ordered by name within a partition, so writers name them in arrival
order (zero-padded sequence numbers or timestamps) and publish them whole
(write elsewhere, then rename/PUT). Names starting with ``_`` or ``.`` are
in-progress or marker files and are never read; so are files without the
format's extension.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from volley_dagster.errors import ConfigError, SourceChangedError, SourceError, SourceNotReadyError
from volley_dagster.json_records import JsonObject
from volley_dagster.sources import formats
from volley_dagster.sources.base import NativeParquetFile, Source, SourceSnapshot
from volley_dagster.sources.offsets import Backlog, EpochRange, Position, Segment, SourcePosition, fair_shares
from volley_dagster.sources.storage import FileInfo, LocalStorage, Storage, storage_for

DEFAULT_PARTITION = ""
# Every this many epochs a cut lists the whole log: on S3 the cuts between list only
# from the last file read, which cannot see a file landing before it.
FULL_LISTING_EVERY = 1000


class FileLog(Source):
    """``FileLog("data/events", format="parquet")`` or ``FileLog("s3://bucket/events", format="json", schema=...)``:
    files in a folder (or an S3 prefix), each subfolder a partition, read in name order."""

    def __init__(
        self,
        uri: str | os.PathLike[str],
        format: str = "parquet",
        schema: pa.Schema | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if format not in formats.FORMATS:
            raise ConfigError(f"unknown source format {format!r}; use one of {sorted(formats.FORMATS)}")
        if format == "json" and schema is None:
            raise ConfigError(
                "a JSON source needs an explicit schema (FileLog(..., schema=pa.schema([...]))): "
                "inferring types from whichever records come first would change them between epochs"
            )
        self.format = format
        self.storage: Storage = storage_for(uri, storage_options)
        self.uri = self.storage.uri
        self._schema = schema
        self._counts: dict[tuple[str, int, str, bool], tuple[int, int, str]] = {}
        self._native_ok: dict[tuple[str, int, str], NativeParquetFile | None] = {}  # None: not native

    def describe(self) -> JsonObject:
        return {"type": "file_log", "uri": self.uri, "format": self.format}

    def snapshot(self) -> SourceSnapshot:
        """Its files, and the newest per partition (which changes when a file lands)."""
        files = self.partitions()
        latest = {p or "(root)": infos[-1].path for p, infos in files.items() if infos}
        return SourceSnapshot(str(sorted(latest.items())), {
            "format": self.format, "files": sum(len(v) for v in files.values()), "latest_files": latest})

    # -- listing -------------------------------------------------------------------

    def partitions(self) -> dict[str, list[FileInfo]]:
        """Name-sorted data files per partition (the whole log)."""
        return self._data_files(self.storage.list().files)

    def _data_files(self, files: list[FileInfo]) -> dict[str, list[FileInfo]]:
        parts: dict[str, list[FileInfo]] = {}
        for info in files:
            pieces = info.path.split("/")
            if any(p.startswith(("_", ".")) for p in pieces) or not pieces[-1].endswith(self._suffixes):
                continue
            if len(pieces) > 2:
                raise SourceError(
                    f"{self.uri}/{info.path}: files may sit in the log root or one partition folder deep, not deeper"
                )
            parts.setdefault(pieces[0] if len(pieces) == 2 else DEFAULT_PARTITION, []).append(info)
        if DEFAULT_PARTITION in parts and len(parts) > 1:
            raise SourceError(f"{self.uri}: has files both in the root and in partition folders; use one or the other")
        return parts

    @property
    def _suffixes(self) -> tuple[str, ...]:
        return formats.FORMATS[self.format]

    def _unread(self, after: Mapping[str, SourcePosition], full: bool = False) -> dict[str, _Tail]:
        """Each partition's files from its read position's file on: the listing a cut and
        the backlog need, whose cost is what landed since, not the log's age. ``full``
        lists everything, which also checks what a listing from S3's mark cannot see."""
        positions = {name: self._position(after, name) for name in after}
        marks = {} if full else {name: pos.file for name, pos in positions.items() if pos.file is not None}
        listing = self.storage.list(marks)
        tails: dict[str, _Tail] = {}
        for name, files in self._data_files(listing.files).items():
            pos = positions.get(name, Position())
            if name in marks:
                earlier = listing.earlier.get(name)
                before = None if earlier is None else len(
                    [n for n in earlier if n.endswith(self._suffixes) and not n.startswith(("_", "."))])
                tails[name] = _Tail(files, pos.file_index, before)
            else:
                before = sum(1 for f in files if _base(f.path) < pos.file) if pos.file is not None else 0
                tails[name] = _Tail(files, 0, before)
        for name in marks:  # a partition read up to a file that is gone from the listing
            if name not in tails and listing.earlier.get(name):
                tails[name] = _Tail([], positions[name].file_index, len(listing.earlier[name] or []))
        return tails

    def schema(self) -> pa.Schema:
        """The declared schema, or the first Parquet file's (the log's first file never changes)."""
        if self._schema is None:
            parts = self.partitions()
            if not parts:
                raise SourceNotReadyError(f"{self.uri}: no {self.format} files yet, so no schema to infer: it is read "
                                          "once its first file lands (or pass schema= to read it from the start)")
            first = min((files[0] for files in parts.values()), key=lambda f: f.path)
            self._schema = formats.read_schema(self.format, self.storage.read(first.path))
        return self._schema

    def record_count(self, info: FileInfo, newest: bool = False) -> int:
        return self._scan(info, newest)[0]

    def _scan(self, info: FileInfo, newest: bool) -> tuple[int, int, str]:
        """(records, bytes, version) of what a range may pin of the file: all of it, or
        for a log that grows, its records and their bytes' digest; the ``newest`` file
        of a partition may still be written, so only its whole lines count."""
        key = (info.path, info.size, info.version, newest)
        if key not in self._counts:
            if formats.grows(self.format):
                data = formats.complete_part(self.format, self.storage.read(info.path), whole_lines_only=newest)
                self._counts[key] = (formats.count_records(self.format, data, whole_lines_only=newest), len(data),
                                     formats.content_version(data))
            else:
                data = self.storage.read(info.path, info.version)
                self._counts[key] = (formats.count_records(self.format, data), info.size, info.version)
        return self._counts[key]

    # -- cutting -------------------------------------------------------------------

    def cut(self, epoch: int, after: Mapping[str, SourcePosition], max_records: int | None, final: bool = False) -> EpochRange:
        """The range from ``after`` to what is available now, at most ``max_records`` long,
        shared fairly between partitions. ``final``: the stream ends here, so a last line
        without its newline is a record too. Every ``FULL_LISTING_EVERY``-th cut lists the
        whole log, to find a file that landed sorting before one already read on S3."""
        unread = self._unread(after, full=epoch % FULL_LISTING_EVERY == 0)
        available = {name: self._pending(name, unread[name], self._position(after, name), final)
                     for name in sorted(unread)}
        for name in after:
            if name not in available:
                raise SourceError(f"{self.uri}: partition {name!r} was read before and has disappeared")
        quota = fair_shares({p: sum(w.count for w in waiting) for p, waiting in available.items()}, max_records)

        segments: list[Segment] = []
        end: dict[str, SourcePosition] = {}
        for name, pending in available.items():
            pos = self._position(after, name)
            left = quota[name]
            for w in pending:
                take = min(left, w.count)
                if take <= 0:
                    break
                _, size, version = self._scan(w.info, newest=w.newest and not final)
                segments.append(Segment(len(segments), name, w.info.path, w.first, w.first + take, size, version))
                pos = Position(_base(w.info.path), w.index, w.first + take)
                left -= take
            end[name] = pos
        start: dict[str, SourcePosition] = {name: self._position(after, name) for name in available}
        return EpochRange(epoch, start, end, tuple(segments))

    def backlog(self, after: Mapping[str, SourcePosition]) -> Backlog:
        """The records beyond ``after``, the files that hold them, and the oldest one's age."""
        records, files, oldest = 0, 0, None
        for name, tail in self._unread(after).items():
            for w in self._pending(name, tail, self._position(after, name)):
                records, files = records + w.count, files + 1
                if w.info.modified and (oldest is None or w.info.modified < oldest):
                    oldest = w.info.modified
        return Backlog(records, files, oldest)

    def _position(self, after: Mapping[str, SourcePosition], partition: str) -> Position:
        pos = after.get(partition, Position())
        if not isinstance(pos, Position):
            raise SourceError(f"{self.uri}: partition {partition!r} was read up to {pos}, a position of another kind of "
                              "source; a checkpoint root reads one source: start a new one for this log")
        return pos

    def _pending(self, partition: str, tail: _Tail, pos: Position, final: bool = False) -> list[_Waiting]:
        """The files with unread records from ``pos`` on, after checking that the files
        already read are all still there, in their places, and none was added among them."""
        at = pos.file_index - tail.offset if pos.file is not None else 0
        if pos.file is not None:
            if tail.before is not None and tail.before > pos.file_index:
                raise SourceError(
                    f"{self.uri}: partition {partition!r} has {tail.before - pos.file_index} new file(s) sorting before "
                    f"{pos.file!r}, which was already read; the log is append-only, so name new files to sort last"
                )
            if ((tail.before is not None and tail.before < pos.file_index) or not 0 <= at < len(tail.files)
                    or _base(tail.files[at].path) != pos.file):
                raise SourceError(
                    f"{self.uri}: partition {partition!r} no longer has {pos.file!r} at position {pos.file_index}: "
                    "a file that was read has been removed or renamed"
                )
        out = []
        last = len(tail.files) - 1
        for i in range(at, len(tail.files)):
            first = pos.record if (pos.file is not None and i == at) else 0
            count = self.record_count(tail.files[i], newest=not final and i == last) - first
            if count > 0:
                out.append(_Waiting(tail.files[i], tail.offset + i, first, count, i == last))
        return out

    # -- reading -------------------------------------------------------------------

    def verify(self, rng: EpochRange) -> None:
        """Every file the range names is still there, the same size and version."""
        for seg in rng.segments:
            now = self.storage.stat(seg.file)
            if now is None:
                raise SourceError(f"epoch {rng.epoch}: source file {self.uri}/{seg.file} is missing")
            if formats.grows(self.format) and seg.version.startswith("sha256:"):
                if now.size >= seg.size:
                    continue  # appended to, maybe: ``read_segment`` checks the bytes the range read
            if now.size != seg.size or (seg.version and now.version != seg.version):
                change = (f"{seg.size} -> {now.size} bytes" if now.size != seg.size
                          else f"rewritten at the same size: version {seg.version} -> {now.version}")
                raise SourceChangedError(
                    f"epoch {rng.epoch}: source file {self.uri}/{seg.file} changed after the epoch was cut ({change}), "
                    f"at records {seg.start}..{seg.end}; log files must not be rewritten. Nothing was committed: "
                    "restore the file as it was, or start a new checkpoint root"
                )

    def native_parquet_files(self, rng: EpochRange, schema: pa.Schema) -> list[NativeParquetFile] | None:
        """The range's files when Spark's own Parquet scan can read them exactly: local
        Parquet files whose columns are the log's schema, name and type. None otherwise
        (JSON, S3, a file of another schema): the Python reader then turns what does not
        fit into bad records, one by one."""
        if self.format != "parquet" or not isinstance(self.storage, LocalStorage):
            return None
        files = []
        for seg in rng.segments:
            path = self.storage.root / seg.file
            key = (seg.file, seg.size, seg.version)
            if key not in self._native_ok:
                self._native_ok[key] = formats.native_parquet_file(path, schema)
            native = self._native_ok[key]
            if native is None:
                return None
            files.append(native)
        return files

    def read_segment(self, seg: Segment, schema: pa.Schema, epoch: int) -> pa.Table:
        if formats.grows(self.format) and seg.version.startswith("sha256:"):
            data = self.storage.read(seg.file)[: seg.size]
            if formats.content_version(data) != seg.version:
                raise SourceChangedError(
                    f"epoch {epoch}: source file {self.uri}/{seg.file} changed after the epoch was cut (rewritten: "
                    f"its first {seg.size} bytes, which hold records {seg.start}..{seg.end}, are not the ones cut; a "
                    "JSON-lines log may only be appended to). Nothing was committed: restore the file as it was"
                )
            return formats.decode_segment(self.format, data, seg.start, seg.end, schema, seg.position_base())
        data = self.storage.read(seg.file, seg.version)
        if len(data) != seg.size:
            raise SourceError(f"epoch {epoch}: source file {self.uri}/{seg.file} changed after the epoch was cut; "
                              "log files must not be rewritten")
        return formats.decode_segment(self.format, data, seg.start, seg.end, schema, seg.position_base())

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_counts": {}, "_native_ok": {}}


@dataclass(frozen=True)
class _Tail:
    """A partition's data files from index ``offset`` of its whole name-sorted listing
    on, and how many sort before the read position's file (None: not known)."""

    files: list[FileInfo]
    offset: int
    before: int | None


@dataclass(frozen=True)
class _Waiting:
    """Unread records ``first..first+count`` of a file at ``index`` of its partition."""

    info: FileInfo
    index: int
    first: int
    count: int
    newest: bool  # the partition's last file, which may still be written


def _base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


__all__ = ["FileLog", "DEFAULT_PARTITION"]
