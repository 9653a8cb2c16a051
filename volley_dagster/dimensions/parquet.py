"""A directory of Parquet files as a dimension: pinned by its listing (each file's
size and version), so files added later are not read by a retry and a file rewritten
or deleted since is an error, never another result."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster.dimensions.base import DimensionTable, PinnedFile, TablePin
from volley_dagster.errors import DimensionTableError, DimensionVersionLostError, SourceError
from volley_dagster.io.paths import table_uri
from volley_dagster.sources.storage import LocalStorage, storage_for

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def _data_file(path: str) -> bool:
    """What Spark's reader reads too: no ``_``/``.`` names (``_SUCCESS``, ``_temporary/``, ``.crc``)."""
    return path.endswith(".parquet") and not any(part.startswith(("_", ".")) for part in path.split("/"))


class ParquetDimension(DimensionTable):
    kind = "parquet"

    def __init__(self, uri: str | os.PathLike[str], name: str | None = None,
                 storage_options: dict[str, Any] | None = None) -> None:
        self.uri = table_uri(uri)
        self.name = name or Path(self.uri.rstrip("/")).name
        self.storage = storage_for(self.uri, storage_options)

    def pin(self) -> TablePin:
        try:
            listing = self.storage.list().files
        except SourceError as exc:
            raise DimensionTableError(f"dimension table {self.name!r}: {exc}") from exc
        files = tuple(PinnedFile(f.path, f.size, f.version) for f in listing if _data_file(f.path))
        if not files:
            raise DimensionTableError(f"dimension table {self.name!r}: no .parquet files under {self.uri}")
        digest = hashlib.sha256("\n".join(f"{f.path}|{f.size}|{f.version}" for f in files).encode()).hexdigest()[:16]
        return TablePin(self.name, self.kind, digest, files)

    def verify(self, pin: TablePin) -> None:
        for f in pin.files:
            now = self.storage.stat(f.path)
            if now is None or (now.size, now.version) != (f.size, f.version):
                raise DimensionVersionLostError(
                    f"dimension table {self.name!r}: {self.uri}/{f.path} was "
                    f"{'deleted' if now is None else 'rewritten'} after an epoch pinned it, so the epoch cannot read "
                    "the rows it pinned; add new files to a Parquet dimension instead of changing them, or keep the "
                    "table in Delta or Iceberg"
                )

    def read(self, spark: SparkSession, pin: TablePin, columns: list[str]) -> DataFrame:
        self.verify(pin)
        if isinstance(self.storage, LocalStorage):  # checked again after the job read them
            paths = [str(Path(self.uri) / f.path) for f in pin.files]
            return self._read_files(spark, pin, paths, pa.unify_schemas([pq.read_schema(p) for p in paths]), columns)
        tables = []
        for f in pin.files:
            data = pq.read_table(io.BytesIO(self.storage.read(f.path, f.version)))
            self._lacks(pin, columns, data.column_names)
            tables.append(data.select(columns))
        return spark.createDataFrame(pa.concat_tables(tables, promote_options="default"))
