from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.sinks.base import CommitContext, Sink, SinkCommitResult
from volley_dagster.sinks.delta import DeltaSink
from volley_dagster.sinks.iceberg import IcebergSink, sqlite_catalog
from volley_dagster.sinks.memory import MemorySink
from volley_dagster.sinks.parquet import ParquetSink

__all__ = ["CommitContext", "SinkCommitResult", "DeltaSink", "IcebergSink", "MemorySink", "ParquetSink", "S3Endpoint", "Sink", "sqlite_catalog"]
