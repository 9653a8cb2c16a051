"""Where an epoch's output is committed, once per epoch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from volley_dagster.lazy_exports import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "volley_dagster.io.s3": ("S3Endpoint",),
    "volley_dagster.sinks.base": ("CommitContext", "Sink", "SinkCommitResult"),
    "volley_dagster.sinks.delta": ("DeltaSink",),
    "volley_dagster.sinks.iceberg": ("IcebergSink", "sqlite_catalog"),
    "volley_dagster.sinks.memory": ("MemorySink",),
    "volley_dagster.sinks.parquet": ("ParquetSink",),
})

if TYPE_CHECKING:
    from volley_dagster.io.s3 import S3Endpoint
    from volley_dagster.sinks.base import CommitContext, Sink, SinkCommitResult
    from volley_dagster.sinks.delta import DeltaSink
    from volley_dagster.sinks.iceberg import IcebergSink, sqlite_catalog
    from volley_dagster.sinks.memory import MemorySink
    from volley_dagster.sinks.parquet import ParquetSink

__all__ = ["CommitContext", "SinkCommitResult", "DeltaSink", "IcebergSink", "MemorySink", "ParquetSink", "S3Endpoint", "Sink",
           "sqlite_catalog"]
