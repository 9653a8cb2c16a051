"""One epoch's Spark work, planned on the driver.

read range (mapInArrow) -> cache -> bad records out -> user transforms -> key
-> partial aggregate per key (native groupBy) -> key group and shard (Spark
expressions) -> one applyInArrow call per shard (state merge + snapshot).
"""

from __future__ import annotations

import json
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.errors import PythonException
from pyspark.sql.pandas.types import from_arrow_schema

from volley_dagster import columns, errors
from volley_dagster.errors import ConfigError
from volley_dagster.operators.aggregate import ResolvedAggregate
from volley_dagster.pipeline import Pipeline
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.tasks import SegmentReader, ShardMerge

_META = [
    pa.field(columns.POS, pa.int64()),
    pa.field(columns.ERROR, pa.string()),
    pa.field(columns.RAW, pa.string()),
]
DEAD_LETTER_SCHEMA = pa.schema(
    [
        pa.field("partition", pa.string()),
        pa.field("file", pa.string()),
        pa.field("offset", pa.int64()),
        pa.field("reason", pa.string()),
        pa.field("raw", pa.string()),
    ]
)


@dataclass
class PlannedEpoch:
    """The epoch's DataFrames, before anything runs."""

    raw: DataFrame
    keyed: DataFrame
    aggregate: ResolvedAggregate
    key_kind: str


@dataclass
class StageResult:
    output: pa.Table
    dead_letters: pa.Table
    shards: dict[int, dict[str, Any]]
    read_transform_s: float
    state_stage_s: float


def plan_epoch(spark: SparkSession, pipeline: Pipeline, rng: EpochRange) -> PlannedEpoch:
    source = pipeline.source_log
    schema = source.schema()
    reserved = [n for n in schema.names if n.startswith("_volley_")]
    if reserved:
        raise ConfigError(f"source columns {reserved} use the engine's reserved prefix _volley_")
    read_schema = pa.schema(list(schema) + _META)
    n = len(rng.segments)
    raw = spark.range(0, n, 1, max(1, n)).mapInArrow(
        SegmentReader(source, rng.segments, schema, rng.epoch, os.getpid()), from_arrow_schema(read_schema)
    )
    parsed = raw.where(F.col(columns.ERROR).isNull()).drop(columns.ERROR, columns.RAW)
    transformed = pipeline.apply_transforms(parsed)
    if pipeline.key_column not in transformed.columns:
        raise ConfigError(
            f"pipeline {pipeline.name!r}: key column {pipeline.key_column!r} is not among the columns "
            f"after the transforms: {transformed.columns}"
        )
    key_type = transformed.schema[pipeline.key_column].dataType
    if isinstance(key_type, T.IntegralType):
        kind, key = "int", pipeline.key_expr().cast("long")
    elif isinstance(key_type, T.StringType):
        kind, key = "str", pipeline.key_expr()
    else:
        raise ConfigError(
            f"pipeline {pipeline.name!r}: key column {pipeline.key_column!r} is {key_type.simpleString()}; "
            "keys must be integers or strings"
        )
    keyed = transformed.withColumn(columns.KEY, key)
    aggregate = pipeline.operator.resolve(keyed.schema)
    clash = [name for name, _ in aggregate.output_fields() if name == pipeline.key_column]
    if clash:
        raise ConfigError(f"aggregate output {clash[0]!r} has the same name as the key column")
    return PlannedEpoch(raw, keyed, aggregate, kind)


def _dead_letter_frame(plan: PlannedEpoch, pipeline: Pipeline) -> DataFrame:
    parse_errors = plan.raw.where(F.col(columns.ERROR).isNotNull()).select(
        F.col(columns.POS), F.col(columns.ERROR).alias("reason"), F.col(columns.RAW).alias("raw")
    )
    user_cols = [c for c in plan.keyed.columns if not c.startswith("_volley_")]
    pos = F.col(columns.POS) if columns.POS in plan.keyed.columns else F.lit(None).cast("long")
    null_keys = plan.keyed.where(F.col(columns.KEY).isNull()).select(
        pos.alias(columns.POS),
        F.lit(f"null key: {pipeline.key_column!r} is null").alias("reason"),
        F.to_json(F.struct(*user_cols)).alias("raw"),
    )
    return parse_errors.unionByName(null_keys)


def _resolve_dead_letters(table: pa.Table, rng: EpochRange) -> pa.Table:
    """Turn event positions back into partition, file and record offset."""
    table = table.sort_by(columns.POS)
    parts, files, offsets = [], [], []
    for pos in table.column(columns.POS).to_pylist():  # dead letters only: few by nature
        if pos is None:
            parts.append(None), files.append(None), offsets.append(None)
            continue
        seg, offset = rng.segment_of(pos)
        parts.append(seg.partition), files.append(seg.file), offsets.append(offset)
    return pa.table(
        [pa.array(parts, pa.string()), pa.array(files, pa.string()), pa.array(offsets, pa.int64()),
         table.column("reason"), table.column("raw")],
        schema=DEAD_LETTER_SCHEMA,
    )


_TASK_ERROR = re.compile(r"volley_dagster\.errors\.(\w+): (.*)")


@contextmanager
def _engine_errors() -> Iterator[None]:
    """Re-raise an engine error thrown inside a Spark task as itself, not as a
    Python-worker traceback wrapped in a JVM exception."""
    try:
        yield
    except PythonException as exc:
        match = _TASK_ERROR.search(str(exc))
        cls = getattr(errors, match.group(1), None) if match else None
        if isinstance(cls, type) and issubclass(cls, errors.VolleyError):
            raise cls(match.group(2)) from exc
        raise


def run_stage(
    spark: SparkSession,
    pipeline: Pipeline,
    rng: EpochRange,
    plan: PlannedEpoch,
    merge: ShardMerge,
) -> StageResult:
    layout = pipeline.layout
    plan.raw.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        t0 = time.perf_counter()
        with _engine_errors():
            dead = _resolve_dead_letters(_dead_letter_frame(plan, pipeline).toArrow(), rng)
        t1 = time.perf_counter()
        if dead.num_rows and pipeline.bad_records == "fail":
            return StageResult(pa.table({}), dead, {}, t1 - t0, 0.0)

        partials = (
            plan.keyed.where(F.col(columns.KEY).isNotNull())
            .groupBy(columns.KEY)
            .agg(*plan.aggregate.partial_exprs())
            .withColumn(columns.KEY_GROUP, F.pmod(F.xxhash64(columns.KEY), F.lit(layout.num_key_groups)).cast("int"))
            .withColumn(
                columns.SHARD,
                F.expr(f"cast(({columns.KEY_GROUP} * {layout.num_shards}) div {layout.num_key_groups} as int)"),
            )
        )
        every_shard = spark.range(layout.num_shards).select(F.col("id").cast("int").alias(columns.SHARD))
        key_type = plan.keyed.schema[columns.KEY].dataType.simpleString()
        out_schema = ", ".join(
            [f"`{pipeline.key_column}` {key_type}"] + plan.aggregate.output_ddl() + [f"`{columns.STATS}` string"]
        )
        with _engine_errors():
            out = (
                partials.unionByName(every_shard, allowMissingColumns=True)
                .groupBy(columns.SHARD)
                .applyInArrow(lambda table: merge(table), out_schema)  # Spark counts a callable's self
                .toArrow()
            )
        t2 = time.perf_counter()
    finally:
        plan.raw.unpersist()
    is_stats = pc.is_valid(out.column(columns.STATS))
    shards = {
        s["shard"]: s for s in (json.loads(v) for v in out.filter(is_stats).column(columns.STATS).to_pylist())
    }
    output = out.filter(pc.invert(is_stats)).drop_columns([columns.STATS]).sort_by(pipeline.key_column)
    return StageResult(output, dead, shards, t1 - t0, t2 - t1)
