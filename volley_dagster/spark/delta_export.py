"""A DataFrame (the state at an epoch, a change feed) written as a new Delta table:
each Spark task writes its rows as one Parquet file under the table, and the driver
commits the files' add actions, with their statistics (``sinks/staged_files.py``), in
the table's first version. No row passes through the driver, and a failed export
leaves no table (files without a log are no table).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake import Schema as DeltaSchema
from deltalake.transaction import CommitProperties, create_table_with_add_actions
from pyspark.sql import DataFrame
from pyspark.sql.pandas.types import to_arrow_schema

from volley_dagster.errors import ConfigError
from volley_dagster.sinks.staged_files import StagedFile, delta_stats

_WRITTEN = "path string, size long, rows long, stats string"


@dataclass(frozen=True)
class DeltaExport:
    uri: str
    rows: int
    files: int
    version: int


@dataclass(frozen=True)
class ParquetPartWriter:
    """``mapInArrow``: this task's rows as one Parquet file in the table's folder."""

    uri: str
    schema: pa.Schema
    export_id: str

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        name = f"part-{context.partitionId() if context else 0:05d}-{self.export_id}.parquet"
        fs, folder = pafs.FileSystem.from_uri(self.uri)
        writer, rows = None, 0
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                if writer is None:
                    fs.create_dir(folder, recursive=True)
                    writer = pq.ParquetWriter(fs.open_output_stream(f"{folder}/{name}"), self.schema)
                writer.write_table(pa.Table.from_batches([batch]).cast(self.schema))
                rows += batch.num_rows
        finally:
            if writer is not None:
                writer.close()
        if writer is not None:
            size = fs.get_file_info(f"{folder}/{name}").size
            written = StagedFile(name, size, rows, delta_stats(writer.writer.metadata))
            yield pa.RecordBatch.from_pylist([written.to_dict()], schema=pa.schema(
                [("path", pa.string()), ("size", pa.int64()), ("rows", pa.int64()), ("stats", pa.string())]))


def export_to_delta(df: DataFrame, uri: str, description: str) -> DeltaExport:
    """Write ``df`` as a new Delta table at ``uri`` (a folder or ``s3://``): one export,
    one table; an existing table there is refused, never appended to or replaced."""
    uri = _absolute(uri)
    if DeltaTable.is_deltatable(uri):
        raise ConfigError(f"a Delta table already exists at {uri}: each export writes a new table; choose another "
                          "location or remove that table first")
    schema = to_arrow_schema(df.schema, timezone="UTC")
    export_id = uuid.uuid4().hex[:12]
    written = [StagedFile.from_dict(w) for w in
               df.mapInArrow(ParquetPartWriter(uri, schema, export_id), _WRITTEN).toArrow().to_pylist()]
    actions = [w.add_action() for w in written]
    properties = CommitProperties(custom_metadata={"volley.export": description})
    create_table_with_add_actions(uri, DeltaSchema.from_arrow(schema), actions, mode="error",
                                  description=description, commit_properties=properties)
    return DeltaExport(uri, sum(w.rows for w in written), len(written), DeltaTable(uri).version())


def _absolute(uri: str) -> str:
    return uri if "://" in uri else str(Path(uri).resolve())
