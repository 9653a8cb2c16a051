"""An Iceberg table as a dimension: pinned by its snapshot id, read at exactly that snapshot."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pyiceberg.exceptions import NoSuchTableError

from volley_dagster.dimensions.base import DimensionTable, TablePin
from volley_dagster.errors import DimensionTableError, DimensionVersionLostError
from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.sinks.iceberg import catalog_properties, open_catalog, split_identifier

if TYPE_CHECKING:
    from pyiceberg.table import Table
    from pyspark.sql import DataFrame, SparkSession


class IcebergDimension(DimensionTable):
    """``table`` is ``"namespace.table"`` in the catalog ``catalog`` (properties), or in
    the local SQLite catalog under ``path``. Read through pyiceberg (delete files and
    schema evolution included) and handed to Spark as Arrow."""

    kind = "iceberg"

    def __init__(self, table: str, catalog: dict[str, str] | None = None, path: str | os.PathLike[str] | None = None,
                 name: str | None = None, s3: S3Endpoint | None = None, catalog_name: str = "volley") -> None:
        self.identifier = table
        self.name = name or split_identifier(table)[1]
        self.catalog_properties = catalog_properties(catalog, path, s3, "IcebergDimension")
        self.catalog_name = catalog_name
        self.uri = f"iceberg:{table}"

    def _load(self) -> Table:
        try:
            return open_catalog(self.catalog_name, self.catalog_properties).load_table(self.identifier)
        except NoSuchTableError as exc:
            raise DimensionTableError(f"dimension table {self.name!r}: no Iceberg table {self.identifier}") from exc

    def pin(self) -> TablePin:
        snapshot = self._load().current_snapshot()
        return TablePin(self.name, self.kind, str(snapshot.snapshot_id) if snapshot else "empty")

    def read(self, spark: SparkSession, pin: TablePin, columns: list[str]) -> DataFrame:
        table = self._load()
        if pin.version == "empty":
            self._lacks(pin, columns, [f.name for f in table.schema().fields])
            return spark.createDataFrame(table.scan(selected_fields=tuple(columns), limit=0).to_arrow())
        snapshot = table.snapshot_by_id(int(pin.version))
        if snapshot is None:
            raise DimensionVersionLostError(
                f"dimension table {self.name!r} ({self.identifier}): snapshot {pin.version}, which this epoch "
                "pinned, has expired. The epoch cannot be reproduced: keep snapshots longer than epochs wait to run"
            )
        schemas, current = table.schemas(), table.schema()  # the snapshot's own schema, when it names one
        schema = current if snapshot.schema_id is None else schemas.get(snapshot.schema_id, current)
        self._lacks(pin, columns, [f.name for f in schema.fields])
        return spark.createDataFrame(table.scan(selected_fields=tuple(columns), snapshot_id=snapshot.snapshot_id).to_arrow())
