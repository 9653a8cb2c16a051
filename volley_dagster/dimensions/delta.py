"""A Delta table as a dimension: pinned by its version, read at exactly that version."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError, TableNotFoundError

from volley_dagster.dimensions.base import DimensionTable, TablePin
from volley_dagster.errors import DimensionTableError, DimensionVersionLostError
from volley_dagster.io.paths import table_uri
from volley_dagster.io.s3 import S3Endpoint

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

# What Spark's own Parquet reader cannot see in a Delta table's data files.
_NOT_PLAIN_PARQUET = {"deletionVectors", "columnMapping"}


class DeltaDimension(DimensionTable):
    kind = "delta"

    def __init__(self, uri: str | os.PathLike[str], name: str | None = None, s3: S3Endpoint | None = None,
                 storage_options: dict[str, str] | None = None) -> None:
        self.uri = table_uri(uri)
        self.name = name or Path(self.uri.rstrip("/")).name
        self.storage_options = {**(s3.delta_storage_options() if s3 else {}), **(storage_options or {})}

    def _open(self, version: int | None = None) -> DeltaTable:
        try:
            return DeltaTable(self.uri, version=version, storage_options=self.storage_options or None)
        except TableNotFoundError as exc:
            raise DimensionTableError(f"dimension table {self.name!r}: no Delta table at {self.uri}") from exc

    def pin(self) -> TablePin:
        return TablePin(self.name, self.kind, str(self._open().version()))

    def read(self, spark: SparkSession, pin: TablePin, columns: list[str]) -> DataFrame:
        try:
            table = self._open(int(pin.version))
        except DeltaError as exc:  # the version's log entries were cleaned up
            raise DimensionVersionLostError(
                f"dimension table {self.name!r} ({self.uri}): version {pin.version}, which this epoch pinned, "
                f"can no longer be loaded ({exc}). The epoch cannot be reproduced: keep the table's log longer "
                "than epochs wait to run (delta.logRetentionDuration)"
            ) from exc
        schema = pa.schema(table.schema().to_arrow())
        self._lacks(pin, columns, schema.names)
        uris = table.file_uris()
        missing = [u for u in uris if u.startswith("/") and not Path(u).exists()]
        if missing:
            raise DimensionVersionLostError(
                f"dimension table {self.name!r} ({self.uri}): version {pin.version}, which this epoch pinned, lost "
                f"{len(missing)} data file(s) to VACUUM, e.g. {missing[0]}. The epoch cannot be reproduced: keep "
                "files longer than epochs wait to run (VACUUM's retention)"
            )
        features = set(table.protocol().reader_features or ())
        plain = (not features & _NOT_PLAIN_PARQUET and not table.metadata().partition_columns
                 and uris and all(u.startswith("/") for u in uris))
        if plain:
            return self._read_files(spark, pin, uris, schema, columns)
        return spark.createDataFrame(table.to_pyarrow_table(columns=columns))
