"""Dimension tables an enrichment joins, each read at the version its epoch pinned."""

from __future__ import annotations

from typing import TYPE_CHECKING

from volley_dagster.lazy_exports import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "volley_dagster.dimensions.base": ("DimensionTable", "Enrichment", "PinnedFile", "TablePin"),
    "volley_dagster.dimensions.delta": ("DeltaDimension",),
    "volley_dagster.dimensions.iceberg": ("IcebergDimension",),
    "volley_dagster.dimensions.parquet": ("ParquetDimension",),
})

if TYPE_CHECKING:
    from volley_dagster.dimensions.base import DimensionTable, Enrichment, PinnedFile, TablePin
    from volley_dagster.dimensions.delta import DeltaDimension
    from volley_dagster.dimensions.iceberg import IcebergDimension
    from volley_dagster.dimensions.parquet import ParquetDimension

__all__ = ["DeltaDimension", "DimensionTable", "Enrichment", "IcebergDimension", "ParquetDimension", "PinnedFile",
           "TablePin"]
