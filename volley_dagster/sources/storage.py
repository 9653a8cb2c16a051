"""Where log files live: a local directory or an S3 prefix (through boto3).

Storage objects are pickled into Spark tasks, so they hold settings only and
open clients lazily in the process that uses them.
"""

from __future__ import annotations

import builtins
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from volley_dagster.errors import ConfigError, SourceChangedError, SourceError, SourceUnavailableError, VolleyError
from volley_dagster.io.s3 import S3Location, is_missing, is_transient, s3_client, s3_error_code


@dataclass(frozen=True)
class FileInfo:
    path: str  # relative to the storage root, "/"-separated
    size: int
    # Which write of the file this is: local, its mtime (ns) and inode; S3, its ETag. A
    # file rewritten at the same size has another version ("" where none is known).
    version: str = ""
    modified: float = field(default=0.0, compare=False)  # Unix time it was written (0: unknown)


@dataclass(frozen=True)
class Listing:
    """A listing of a storage root, or of what a reader has not passed yet.

    With marks (folder -> file name), a marked folder lists only its files named at or
    after its mark, so a log read to its end costs what landed since, not its age. The
    names before a mark are still counted where that is cheap (a local folder's names
    come without a stat each), so a file that lands sorting before the mark is noticed;
    ``earlier`` is None for a folder where it is not (S3 lists from ``StartAfter``)."""

    files: list[FileInfo]  # sorted by path
    earlier: dict[str, list[str] | None] = field(default_factory=dict)  # marked folder -> names before its mark


def _timestamp(when: Any) -> float:
    """S3's LastModified (a datetime from boto3) as Unix time; 0 when absent."""
    return when.timestamp() if when is not None else 0.0


def _local_version(st: os.stat_result) -> str:
    return f"{st.st_mtime_ns}-{st.st_ino}"


class Storage(ABC):
    uri: str

    @abstractmethod
    def list(self, start_at: Mapping[str, str] | None = None) -> Listing:
        """Every file under the root (any depth), sorted by path; in a folder named in
        ``start_at`` ("" is the root), only the files named at or after its mark."""

    @abstractmethod
    def read(self, path: str, version: str = "") -> bytes:
        """A file's bytes; SourceError when it is gone, SourceChangedError when it is no
        longer ``version`` (when given)."""

    @abstractmethod
    def stat(self, path: str) -> FileInfo | None:
        """A file's size and version, or None when it does not exist."""

    @abstractmethod
    def write(self, path: str, data: bytes) -> None:
        """Publish a file whole (used by the demo generator and tests)."""


class LocalStorage(Storage):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.uri = str(self.root)

    def list(self, start_at: Mapping[str, str] | None = None) -> Listing:
        """Names come from the directory without a stat each; only files at or after a
        folder's mark are stat-ed (the cost of a listing that grows with the log)."""
        if not self.root.is_dir():
            raise SourceError(f"source directory {self.root} does not exist")
        marks = dict(start_at or {})
        out = []
        earlier: dict[str, list[str] | None] = {folder: [] for folder in marks}
        for dirpath, _, files in os.walk(self.root):
            folder = Path(dirpath).relative_to(self.root).as_posix()
            folder = "" if folder == "." else folder
            mark = marks.get(folder)
            if mark is not None:
                earlier[folder] = [name for name in files if name < mark]
                files = [name for name in files if name >= mark]
            for name in files:
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # renamed or removed while listing: the next listing sees it as it is
                    continue
                out.append(FileInfo(f"{folder}/{name}" if folder else name, st.st_size, _local_version(st), st.st_mtime))
        return Listing(sorted(out, key=lambda f: f.path), earlier)

    def read(self, path: str, version: str = "") -> bytes:
        try:
            with open(self.root / path, "rb") as fh:
                st = os.fstat(fh.fileno())  # the file this read sees, whatever is renamed over it later
                data = fh.read()
        except FileNotFoundError:
            raise SourceError(f"source file {self.root / path} is missing") from None
        if version and (_local_version(st) != version or st.st_size != len(data)):
            raise SourceChangedError(f"source file {self.root / path} was rewritten after it was listed "
                                     f"(version {version}, now {_local_version(st)}); log files must not be rewritten")
        return data

    def stat(self, path: str) -> FileInfo | None:
        try:
            st = (self.root / path).stat()
        except FileNotFoundError:
            return None
        return FileInfo(path, st.st_size, _local_version(st), st.st_mtime)

    def write(self, path: str, data: bytes) -> None:
        from volley_dagster.io.atomic import write_bytes_atomic

        write_bytes_atomic(self.root / path, data)


class S3Storage(Storage):
    """An S3 prefix. ``options`` are boto3 client arguments (``endpoint_url``,
    ``aws_access_key_id``, ``aws_secret_access_key``, ``region_name``);
    unset ones come from the usual AWS environment."""

    def __init__(self, uri: str, options: dict[str, Any] | None = None) -> None:
        self.location = S3Location.parse(uri)
        self.uri = uri
        self.bucket, self.prefix = self.location.bucket, self.location.prefix
        self.options = dict(options or {})
        self._client: Any = None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_client": None}

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.options)
        return self._client

    def _key(self, path: str) -> str:
        return self.location.key(path)

    def list(self, start_at: Mapping[str, str] | None = None) -> Listing:
        """A marked folder is listed from its mark on (``StartAfter``, plus a HEAD of the
        mark itself), so its cost is what landed since; the names before the mark are
        not seen (``earlier`` None). Without marks, one paginated listing of the prefix."""
        marks = dict(start_at or {})
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[FileInfo] = []
        try:
            if not marks:
                out += self._objects(base, base)
            elif "" in marks:
                out += self._objects(base, base, marks[""])
            else:
                folders: list[str] = []
                for page in self._pages(Prefix=base, Delimiter="/"):
                    out += [self._info(obj, base) for obj in page.get("Contents", [])]
                    folders += [p["Prefix"][len(base):].rstrip("/") for p in page.get("CommonPrefixes", [])]
                for folder in folders:
                    out += self._objects(f"{base}{folder}/", base, marks.get(folder))
        except VolleyError:
            raise
        except Exception as exc:
            raise _source_error(f"cannot list {self.uri}", exc) from exc
        return Listing(sorted(out, key=lambda f: f.path), {folder: None for folder in marks})

    def _pages(self, **kwargs: Any) -> Any:
        return self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, **kwargs)

    def _objects(self, prefix: str, base: str, mark: str | None = None) -> builtins.list[FileInfo]:
        """The objects under ``prefix`` (paths relative to ``base``), from ``mark`` on."""
        extra = {"StartAfter": f"{prefix}{mark}"} if mark else {}
        found = [self._info(obj, base) for page in self._pages(Prefix=prefix, **extra) for obj in page.get("Contents", [])]
        if mark:
            at = self.stat(f"{prefix}{mark}"[len(base):])
            found += [at] if at is not None else []
        return found

    @staticmethod
    def _info(obj: dict[str, Any], base: str) -> FileInfo:
        return FileInfo(obj["Key"][len(base):], int(obj["Size"]), obj.get("ETag", "").strip('"'),
                        _timestamp(obj.get("LastModified")))

    def read(self, path: str, version: str = "") -> bytes:
        """With ``version``, the read itself is conditional (``If-Match`` on the ETag): a
        re-PUT object is never read as the one that was cut."""
        try:
            extra = {"IfMatch": f'"{version}"'} if version else {}
            return self.client.get_object(Bucket=self.bucket, Key=self._key(path), **extra)["Body"].read()
        except Exception as exc:
            if is_missing(exc):
                raise SourceError(f"source file {self.uri}/{path} is missing") from None
            if s3_error_code(exc) in ("412", "PreconditionFailed"):
                raise SourceChangedError(f"source file {self.uri}/{path} was rewritten after it was listed (ETag "
                                         f"{version} no longer matches); log files must not be rewritten") from None
            raise _source_error(f"cannot read {self.uri}/{path}", exc) from exc

    def stat(self, path: str) -> FileInfo | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(path))
        except Exception as exc:
            if is_missing(exc):
                return None
            raise _source_error(f"cannot stat {self.uri}/{path}", exc) from exc
        return FileInfo(path, int(head["ContentLength"]), head.get("ETag", "").strip('"'),
                        _timestamp(head.get("LastModified")))

    def write(self, path: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data)


def _source_error(what: str, exc: BaseException) -> VolleyError:
    """An S3 outage is retried (``SourceUnavailableError``); any other answer is the
    source's own (``SourceError``: a denied access, a missing bucket)."""
    if is_transient(exc):
        return SourceUnavailableError(f"{what}: S3 is unreachable or overloaded ({type(exc).__name__}: {exc}); "
                                      "the epoch is retried with backoff")
    return SourceError(f"{what}: {exc}")


def storage_for(uri: str | os.PathLike[str], options: dict[str, Any] | None = None) -> Storage:
    text = str(uri)
    if text.startswith(("s3://", "s3a://")):
        return S3Storage(text, options)
    if "://" in text and not text.startswith("file://"):
        raise ConfigError(f"unsupported source URI {text!r}: use a local path or s3://bucket/prefix")
    return LocalStorage(text.removeprefix("file://"))
