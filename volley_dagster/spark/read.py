"""An epoch's recorded range as a DataFrame: every record once, with its position.

Local Parquet files whose columns are the log's schema are read by Spark's own
Parquet scan, the record offset taken from ``_metadata.row_index``: no Python
in the read and no bad record possible, so the epoch needs no separate job to
look for them. Everything else (JSON lines, logs on S3, a Parquet file of
another schema) goes through ``SegmentReader`` in Python workers, which turns
each record that does not fit into a row carrying its reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import reduce

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema

from volley_dagster import columns
from volley_dagster.columns import sql_identifier
from volley_dagster.sources.base import Source
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.tasks import SegmentReader

META_FIELDS = [
    pa.field(columns.POS, pa.int64()),
    pa.field(columns.ERROR, pa.string()),
    pa.field(columns.RAW, pa.string()),
]


@dataclass(frozen=True)
class EpochRead:
    raw: DataFrame  # the schema's columns + position, error and raw text
    may_have_bad_records: bool  # False: every row parsed (error is always null)


def read_range(spark: SparkSession, source: Source, rng: EpochRange, schema: pa.Schema) -> EpochRead:
    paths = source.native_parquet_paths(rng, schema) if rng.segments else None
    if paths is not None:
        return EpochRead(_native_parquet(spark, rng, paths, schema), may_have_bad_records=False)
    n = len(rng.segments)
    raw = spark.range(0, n, 1, max(1, n)).mapInArrow(
        SegmentReader(source, rng.segments, schema, rng.epoch, os.getpid()),
        from_arrow_schema(pa.schema(list(schema) + META_FIELDS)),
    )
    return EpochRead(raw, may_have_bad_records=True)


def _native_parquet(spark: SparkSession, rng: EpochRange, paths: list[str], schema: pa.Schema) -> DataFrame:
    """One scan per segment, its bounds pushed into it. SQL text rather than ``F``
    calls: each of those is a round trip to the JVM, a few per column."""
    spark_schema = from_arrow_schema(schema)
    names = [sql_identifier(n) for n in schema.names]
    row = "_metadata.row_index"
    no_text = "CAST(NULL AS STRING)"
    frames = [
        spark.read.schema(spark_schema).parquet(path)
        .where(F.expr(f"{row} >= {seg.start} AND {row} < {seg.end}"))
        .selectExpr(*names, f"{seg.position_base()} + {row} AS {columns.POS}",
                    f"{no_text} AS {columns.ERROR}", f"{no_text} AS {columns.RAW}")
        for seg, path in zip(rng.segments, paths, strict=True)
    ]
    return reduce(DataFrame.unionByName, frames)
