"""volley-dagster: exactly-once, stateful stream processing as checkpoint epochs on PySpark.

The engine is importable and testable without Dagster; the Dagster integration
(``volley_dagster.dagster``, which this package never imports) is a thin layer over it,
and this repository's code location (``assets/``, ``resources/``, ``sensors/``) the demo
built on that.

The public names below load when first used (``lazy_exports``); ``__version__`` is the
installed distribution's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from volley_dagster.errors import (
    AggregateOverflowError,
    ConfigError,
    DimensionPinRejectedError,
    DimensionTableError,
    DimensionVersionLostError,
    DuplicateDimensionKeyError,
    EpochNotCutError,
    EpochOrderError,
    EpochTooLargeError,
    FencedError,
    LeaseLapsedError,
    MalformedRecordError,
    PipelineBusyError,
    ProcessorError,
    SinkCommitError,
    SinkLineageError,
    SinkOutcomeUnknownError,
    SnapshotError,
    SnapshotStorageError,
    SourceChangedError,
    SourceDataLostError,
    SourceError,
    SourceUnavailableError,
    StateLayoutError,
    StorageFullError,
    VolleyError,
)
from volley_dagster.lazy_exports import lazy_exports


def _version() -> str:
    """The installed distribution's version; in a checkout that is not installed, pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("volley-dagster")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M) if pyproject.exists() else None
        return found.group(1) if found else "0+unknown"


_LAZY: dict[str, tuple[str, ...]] = {
    "volley_dagster.checkpoint.s3_snapshots": ("S3SnapshotStore",),
    "volley_dagster.dimensions": ("DeltaDimension", "IcebergDimension", "ParquetDimension"),
    "volley_dagster.operators.accumulators": ("count", "first", "last", "max_", "mean", "min_", "sum_"),
    "volley_dagster.operators.process_api": ("ExpiredTimerInfo", "StatefulProcessor", "StatefulProcessorHandle",
                                             "TimerValues"),
    "volley_dagster.operators.window": ("session", "sliding", "tumbling"),
    "volley_dagster.pipeline": ("Pipeline",),
    "volley_dagster.result": ("EpochResult",),
    "volley_dagster.runner": ("EpochRunner",),
    "volley_dagster.settings": ("RunSettings",),
    "volley_dagster.sinks": ("DeltaSink", "IcebergSink", "MemorySink", "ParquetSink", "S3Endpoint", "Sink"),
    "volley_dagster.sources.base": ("Source",),
    "volley_dagster.sources.delta_table": ("DeltaTableSource",),
    "volley_dagster.sources.file_log": ("FileLog",),
    "volley_dagster.sources.iceberg_table": ("IcebergTableSource",),
    "volley_dagster.sources.multi": ("MultiSource",),
    "volley_dagster.spark.session": ("get_or_create_spark",),
}
_lazy = lazy_exports(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    """``__version__`` (read once, when first asked for: a Spark worker never pays for
    ``importlib.metadata``), then the lazy public names."""
    if name == "__version__":
        globals()["__version__"] = value = _version()
        return value
    return _lazy(name)


if TYPE_CHECKING:
    __version__: str
    from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
    from volley_dagster.dimensions import DeltaDimension, IcebergDimension, ParquetDimension
    from volley_dagster.operators.accumulators import count, first, last, max_, mean, min_, sum_
    from volley_dagster.operators.process_api import (
        ExpiredTimerInfo,
        StatefulProcessor,
        StatefulProcessorHandle,
        TimerValues,
    )
    from volley_dagster.operators.window import session, sliding, tumbling
    from volley_dagster.pipeline import Pipeline
    from volley_dagster.result import EpochResult
    from volley_dagster.runner import EpochRunner
    from volley_dagster.settings import RunSettings
    from volley_dagster.sinks import DeltaSink, IcebergSink, MemorySink, ParquetSink, S3Endpoint, Sink
    from volley_dagster.sources.base import Source
    from volley_dagster.sources.delta_table import DeltaTableSource
    from volley_dagster.sources.file_log import FileLog
    from volley_dagster.sources.iceberg_table import IcebergTableSource
    from volley_dagster.sources.multi import MultiSource
    from volley_dagster.spark.session import get_or_create_spark


__all__ = [
    "AggregateOverflowError",
    "ConfigError",
    "DeltaDimension",
    "DeltaSink",
    "DimensionPinRejectedError",
    "DimensionTableError",
    "DimensionVersionLostError",
    "DuplicateDimensionKeyError",
    "IcebergDimension",
    "ParquetDimension",
    "IcebergSink",
    "S3Endpoint",
    "S3SnapshotStore",
    "EpochNotCutError",
    "EpochOrderError",
    "EpochTooLargeError",
    "EpochResult",
    "EpochRunner",
    "RunSettings",
    "FencedError",
    "LeaseLapsedError",
    "FileLog",
    "DeltaTableSource",
    "IcebergTableSource",
    "MultiSource",
    "Source",
    "MalformedRecordError",
    "MemorySink",
    "ParquetSink",
    "Pipeline",
    "PipelineBusyError",
    "ProcessorError",
    "StatefulProcessor",
    "StatefulProcessorHandle",
    "TimerValues",
    "ExpiredTimerInfo",
    "Sink",
    "SinkCommitError",
    "SinkOutcomeUnknownError",
    "SinkLineageError",
    "SnapshotError",
    "SnapshotStorageError",
    "SourceChangedError",
    "SourceDataLostError",
    "SourceUnavailableError",
    "SourceError",
    "StateLayoutError",
    "StorageFullError",
    "VolleyError",
    "count",
    "first",
    "get_or_create_spark",
    "last",
    "max_",
    "mean",
    "min_",
    "session",
    "sliding",
    "sum_",
    "tumbling",
]
