"""One epoch's Spark work, planned on the driver.

read range (mapInArrow) -> cache -> user transforms -> key -> side outputs
(bad records, late records, the epoch's latest event time: one job) ->
[windows: assign, drop late] -> partial aggregate per key (or key and window)
in the JVM -> key group and shard (Spark expressions) -> one applyInArrow
call per shard (state merge, firing, snapshot).
"""

from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.errors import PythonException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from volley_dagster import columns, errors
from volley_dagster.columns import POS_OFFSET_BITS
from volley_dagster.errors import ConfigError
from volley_dagster.operators.aggregate import ResolvedAggregate
from volley_dagster.operators.window import ResolvedWindowAggregate, describe_event_time
from volley_dagster.pipeline import Pipeline
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.partitioning import ROUTING_COLUMNS, to_shards
from volley_dagster.spark.read import read_range
from volley_dagster.spark.tasks import ShardMerge, attempt_id, shard_stats, snapshot_name, upload_stats
from volley_dagster.state.keys import ShardLayout
from volley_dagster.state.store import SnapshotInfo, carry_forward

_WHERE = [pa.field("partition", pa.string()), pa.field("file", pa.string()), pa.field("offset", pa.int64())]
DEAD_LETTER_SCHEMA = pa.schema(_WHERE + [pa.field("reason", pa.string()), pa.field("raw", pa.string())])
_SIDE = "_volley_side"  # which side output a row of the side-output job belongs to
_MAX_EVENT = "_volley_max_event"
LATE_REASON = "window closed: window end + allowed lateness <= watermark"


@dataclass
class PlannedEpoch:
    """The epoch's DataFrames, before anything runs."""

    raw: DataFrame
    keyed: DataFrame
    operator: ResolvedAggregate | ResolvedWindowAggregate
    key_kind: str
    may_have_bad_records: bool = True  # False: a native Parquet read, every record parsed

    @property
    def single_job(self) -> bool:
        """One Spark job does the epoch: nothing has to be known before the state stage
        (no parse errors to look for, no watermark to advance). Null keys are counted
        by the shard tasks, and only then looked up, in a second job."""
        return not self.may_have_bad_records and self.windowed is None

    @property
    def windowed(self) -> ResolvedWindowAggregate | None:
        return self.operator if isinstance(self.operator, ResolvedWindowAggregate) else None

    @property
    def running(self) -> ResolvedAggregate:
        """The running aggregate (a plan without windows)."""
        assert isinstance(self.operator, ResolvedAggregate), "a windowed plan has no running aggregate"
        return self.operator


@dataclass
class StageResult:
    output: pa.Table
    dead_letters: pa.Table
    shards: dict[int, dict[str, Any]]
    read_transform_s: float
    state_stage_s: float
    late: pa.Table | None = None  # windows: (record, window) pairs that came too late
    watermark: int | None = None  # windows: after this epoch, microseconds


def plan_epoch(spark: SparkSession, pipeline: Pipeline, rng: EpochRange) -> PlannedEpoch:
    source = pipeline.source_log
    schema = source.schema()
    reserved = [n for n in schema.names if n.startswith("_volley_")]
    if reserved:
        raise ConfigError(f"source columns {reserved} use the engine's reserved prefix _volley_")
    read = read_range(spark, source, rng, schema)
    raw = read.raw
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
    operator = pipeline.stateful_operator().resolve(keyed.schema)
    if pipeline.key_column in operator.output_names():
        raise ConfigError(f"output column {pipeline.key_column!r} has the same name as the key column")
    return PlannedEpoch(raw, keyed, operator, kind, read.may_have_bad_records)


def _dead_letter_frame(plan: PlannedEpoch, pipeline: Pipeline, bound: int | None = None) -> DataFrame:
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
    bad = parse_errors.unionByName(null_keys)
    window = plan.windowed
    if window is not None:
        column = window.windowing.time_column
        null_times = plan.keyed.where(F.col(columns.KEY).isNotNull() & F.col(column).isNull()).select(
            pos.alias(columns.POS),
            F.lit(f"null event time: {column!r} is null").alias("reason"),
            F.to_json(F.struct(*user_cols)).alias("raw"),
        )
        bad = bad.unionByName(null_times)
        if bound is not None:
            skewed = plan.keyed.where(F.col(columns.KEY).isNotNull() & (window.event_us() > F.lit(bound))).select(
                pos.alias(columns.POS),
                F.lit(f"event time beyond max_event_time_skew: {column!r} is later than "
                      f"{describe_event_time(bound)} (the watermark or the epoch's cut time plus the skew)").alias("reason"),
                F.to_json(F.struct(*user_cols)).alias("raw"),
            )
            bad = bad.unionByName(skewed)
    return bad


def _valid(plan: PlannedEpoch, bound: int | None = None) -> DataFrame:
    """The rows state sees: keyed and, for windows, with a believable event time."""
    valid = plan.keyed.where(F.col(columns.KEY).isNotNull())
    if plan.windowed is not None:
        valid = valid.where(F.col(plan.windowed.windowing.time_column).isNotNull())
        if bound is not None:
            valid = valid.where(plan.windowed.event_us() <= F.lit(bound))
    return valid


def _side_outputs(plan: PlannedEpoch, pipeline: Pipeline, assigned: DataFrame | None, watermark: int | None,
                  bound: int | None) -> DataFrame:
    """Bad records, and for windows the late pairs and the latest event time: one Spark job."""
    side = _dead_letter_frame(plan, pipeline, bound).withColumn(_SIDE, F.lit("dead"))
    window = plan.windowed
    if window is None or assigned is None:
        return side
    late = assigned.where(window.is_late(watermark)).select(
        F.col(columns.POS), F.lit(LATE_REASON).alias("reason"), F.col(columns.KEY),
        F.col(window.windowing.time_column).cast("timestamp").alias("_volley_time"),
        F.col(columns.WINDOW_START), F.col(columns.WINDOW_END), F.lit("late").alias(_SIDE),
    )
    latest = _valid(plan, bound).agg(F.max(window.event_us()).alias(_MAX_EVENT)).withColumn(_SIDE, F.lit("max"))
    return side.unionByName(late, allowMissingColumns=True).unionByName(latest, allowMissingColumns=True)


def _positions(table: pa.Table, rng: EpochRange) -> list[pa.Array]:
    """Event positions back as partition, file and record offset, in bulk (late records
    can be many): segment = position >> 40, offset = the low 40 bits."""
    pos = table.column(columns.POS).combine_chunks().cast(pa.int64())
    segment = pc.shift_right(pos, POS_OFFSET_BITS)
    by_segment = [pa.array([getattr(s, a) for s in rng.segments], pa.string()) for a in ("partition", "file")]
    return [pc.take(values, segment) for values in by_segment] + [pc.bit_wise_and(pos, (1 << POS_OFFSET_BITS) - 1)]


def _resolve_dead_letters(table: pa.Table, rng: EpochRange) -> pa.Table:
    table = table.sort_by(columns.POS)
    return pa.table(_positions(table, rng) + [table.column("reason"), table.column("raw")], schema=DEAD_LETTER_SCHEMA)


def _resolve_late(table: pa.Table, rng: EpochRange, pipeline: Pipeline, window: ResolvedWindowAggregate, watermark: int | None) -> pa.Table:
    table = table.sort_by([(columns.POS, "ascending"), (columns.WINDOW_START, "ascending")])
    ts = pa.timestamp("us", tz="UTC")
    n = table.num_rows
    cols = _positions(table, rng) + [
        table.column(columns.KEY),
        table.column("_volley_time").cast(ts),
        table.column(columns.WINDOW_START).cast(ts),
        table.column(columns.WINDOW_END).cast(ts),
        pa.array([watermark] * n, pa.int64()).cast(ts),
        table.column("reason"),
    ]
    names = [f.name for f in _WHERE] + [pipeline.key_column, window.windowing.time_column, "window_start", "window_end", "watermark", "reason"]
    return pa.table(cols, names=names)


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
        if match and isinstance(cls, type) and issubclass(cls, errors.VolleyError):
            raise cls(match.group(2)) from exc
        raise


def _shard_partials(rows: DataFrame, partial_exprs: list, layout: ShardLayout) -> DataFrame:
    """The running aggregate's partials per key, already in their shard's partition:
    one shuffle of the epoch's rows (``spark/partitioning.py``); windows do the same."""
    return to_shards(rows, layout).groupBy(*ROUTING_COLUMNS, columns.KEY).agg(*partial_exprs)


@contextmanager
def _source_unchanged(pipeline: Pipeline, rng: EpochRange, plan: PlannedEpoch) -> Iterator[None]:
    """Spark's own Parquet scan cannot check, as the Python reader does, that a file
    is the one the epoch was cut from; so the driver checks after the read (and when
    the read failed, whether a changed file is why)."""
    if plan.may_have_bad_records:  # the Python reader checks each segment itself
        yield
        return
    try:
        yield
    except Exception:
        pipeline.source_log.verify(rng)
        raise
    pipeline.source_log.verify(rng)


def run_stage(
    spark: SparkSession,
    pipeline: Pipeline,
    rng: EpochRange,
    plan: PlannedEpoch,
    merge: ShardMerge,
    watermark: int | None = None,
    end_of_stream: bool = False,
) -> StageResult:
    """``watermark``: the one the epoch starts from (windows only)."""
    layout, window = pipeline.layout, plan.windowed
    if not rng.segments and window is None and len(merge.previous) == layout.num_shards:
        return _carry_forward_stage(spark, pipeline, plan, merge)
    # A Python-decoded read is cached for the side-output job and the state stage to
    # share; a native Parquet scan is cheaper to run twice (each job reads only the
    # columns it needs) than to cache whole.
    cached = plan.may_have_bad_records
    if cached:
        plan.raw.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        t0 = time.perf_counter()
        late, new_watermark, dead = None, watermark, None
        if plan.single_job:  # null keys ride along: they fold into one partial row, counted per shard
            partials = _shard_partials(plan.keyed, plan.running.partial_exprs(), layout)
        else:
            bound = window.windowing.event_time_bound(watermark, rng.cut_at_us) if window is not None else None
            assigned = window.assign(_valid(plan, bound)) if window is not None else None
            with _engine_errors():
                side = _side_outputs(plan, pipeline, assigned, watermark, bound).toArrow()
            kind = side.column(_SIDE)
            dead = _resolve_dead_letters(side.filter(pc.equal(kind, "dead")).select([columns.POS, "reason", "raw"]), rng)
            if dead.num_rows and pipeline.bad_records == "fail":
                return StageResult(pa.table({}), dead, {}, time.perf_counter() - t0, 0.0)
            if window is not None:
                late = _resolve_late(side.filter(pc.equal(kind, "late")), rng, pipeline, window, watermark)
                new_watermark = window.windowing.advance(watermark, side.filter(pc.equal(kind, "max")).column(_MAX_EVENT)[0].as_py())
                limit = window.windowing.fire_limit(new_watermark, end_of_stream)
                merge = replace(merge, step=replace(merge.step, fire_limit=limit))
                assert assigned is not None
                partials = window.partials(to_shards(assigned.where(~window.is_late(watermark)), layout), ROUTING_COLUMNS)
            else:
                partials = _shard_partials(_valid(plan), plan.running.partial_exprs(), layout)
        t1 = time.perf_counter()
        out_schema = ", ".join(_output_ddl(pipeline, plan) + [f"`{columns.STATS}` string"])
        with _engine_errors(), _source_unchanged(pipeline, rng, plan):
            out = (
                partials.groupBy(columns.PARTITION)
                .applyInArrow(lambda table: merge(table), out_schema)  # Spark counts a callable's self
                .toArrow()
            )
        t2 = time.perf_counter()
        is_stats = pc.is_valid(out.column(columns.STATS))
        shards = {
            s["shard"]: s for s in (json.loads(v) for v in out.filter(is_stats).column(columns.STATS).to_pylist())
        }
        if dead is None:
            dead = _null_key_dead_letters(plan, pipeline, rng, shards)
    finally:
        if cached:
            plan.raw.unpersist()
    output = out.filter(pc.invert(is_stats)).drop_columns([columns.STATS])
    output = output.sort_by([(c, "ascending") for c in pipeline.output_keys()])
    return StageResult(output, dead, shards, t1 - t0, t2 - t1, late, new_watermark)


def _output_ddl(pipeline: Pipeline, plan: PlannedEpoch) -> list[str]:
    key_type = plan.keyed.schema[columns.KEY].dataType.simpleString()
    return [f"`{pipeline.key_column}` {key_type}"] + plan.operator.output_ddl()


def _carry_forward_stage(spark: SparkSession, pipeline: Pipeline, plan: PlannedEpoch, merge: ShardMerge) -> StageResult:
    """An epoch with no records (running aggregate): state is unchanged, so each shard's
    snapshot is the previous one, hardlinked, and on S3 a manifest naming the previous
    one's objects; no Spark job runs. Where the previous snapshot is only on S3 (the
    executors keep theirs on their own disks), only the S3 manifest is written. The
    output is empty, typed as a processed epoch's would be, so each sink still records
    the epoch."""
    t0 = time.perf_counter()
    shards: dict[int, dict[str, Any]] = {}
    for shard, prev in sorted(merge.previous.items()):
        t = time.perf_counter()
        attempt = attempt_id()
        where = f"epoch {merge.step.epoch} shard {shard}"
        merge.check_fence(f"{where}: carrying its snapshot forward")
        target = Path(merge.snapshot_root) / snapshot_name(shard, attempt)
        remote_copy = merge.remote is not None and prev.remote_epoch is not None
        if Path(prev.path).exists() or not remote_copy:
            snap = carry_forward(Path(prev.path), prev.files, target)
        else:
            snap = SnapshotInfo(target, dict(prev.files), sum(m["size"] for m in prev.files.values()), 0)
        remote: dict[str, Any] = {}
        if merge.remote is not None:
            upload = (merge.remote.carry_forward(prev.remote_epoch, shard, merge.step.epoch,
                                                 from_attempt=prev.remote_attempt, attempt=attempt)
                      if prev.remote_epoch is not None
                      else merge.remote.upload(merge.step.epoch, shard, snap.path, attempt=attempt))
            remote = upload_stats(upload)
        shards[shard] = shard_stats(shard, snap, attempt, read_mode="carried_forward",
                                    snapshot_s=time.perf_counter() - t, **remote)
    output = spark.createDataFrame([], ", ".join(_output_ddl(pipeline, plan))).toArrow()
    return StageResult(output, DEAD_LETTER_SCHEMA.empty_table(), shards, 0.0, time.perf_counter() - t0)


def _null_key_dead_letters(
    plan: PlannedEpoch, pipeline: Pipeline, rng: EpochRange, shards: dict[int, dict[str, Any]]
) -> pa.Table:
    """Single-job epochs: the shard tasks counted records with a null key; only when
    there are some, a second job finds which (file, offset) they are."""
    if not sum(s["null_key_records"] for s in shards.values()):
        return DEAD_LETTER_SCHEMA.empty_table()
    with _engine_errors():
        bad = _dead_letter_frame(plan, pipeline).toArrow()
    return _resolve_dead_letters(bad, rng)
