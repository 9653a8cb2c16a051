from volley_dagster.sinks.base import CommitContext, Sink
from volley_dagster.sinks.memory import MemorySink
from volley_dagster.sinks.parquet import ParquetSink

__all__ = ["CommitContext", "MemorySink", "ParquetSink", "Sink"]
