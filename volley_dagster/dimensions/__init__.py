"""Dimension tables an enrichment joins, each read at the version its epoch pinned."""

from volley_dagster.dimensions.base import DimensionTable, Enrichment, PinnedFile, TablePin
from volley_dagster.dimensions.delta import DeltaDimension
from volley_dagster.dimensions.iceberg import IcebergDimension
from volley_dagster.dimensions.parquet import ParquetDimension

__all__ = ["DeltaDimension", "DimensionTable", "Enrichment", "IcebergDimension", "ParquetDimension", "PinnedFile",
           "TablePin"]
