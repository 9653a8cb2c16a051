"""An epoch's side outputs: records that do not reach state, each with its reason
and where it came from (partition, file, offset). Bad records (unparseable, null
key, null or unbelievable event time) become dead letters; for windows, the (record,
window) pairs whose window had closed become late records, and the epoch's latest
event time moves the watermark. One Spark job computes them all, before the state stage:
one pass over the parsed rows (observing the latest event time as it looks for bad
ones), for windows a second over the assigned pairs, and for a Python-decoded read
one over its cached raw rows for the parse errors."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, Observation
from pyspark.sql import functions as F

from volley_dagster import columns
from volley_dagster.checkpoint.manifest import ShardEntry
from volley_dagster.columns import POS_OFFSET_BITS
from volley_dagster.operators.dedup import REASON_DUPLICATE, REASON_LATE, Deduplication, ResolvedUniqueRecords
from volley_dagster.operators.event_time import describe_event_time
from volley_dagster.operators.window import ResolvedWindowAggregate
from volley_dagster.pipeline import Pipeline
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.plan import PlannedEpoch
from volley_dagster.spark.task_errors import engine_errors

_WHERE = [pa.field("partition", pa.string()), pa.field("file", pa.string()), pa.field("offset", pa.int64())]
DEAD_LETTER_SCHEMA = pa.schema(_WHERE + [pa.field("reason", pa.string()), pa.field("raw", pa.string())])
_SIDE = "_volley_side"  # which side output a row of the side-output job belongs to
_MAX_EVENT = "_volley_max_event"
_REASON = "_volley_reason"
LATE_REASON = "window closed: window end + allowed lateness <= watermark"


@dataclass(frozen=True)
class SideOutputs:
    dead_letters: pa.Table  # DEAD_LETTER_SCHEMA
    late: pa.Table | None = None  # windows: (record, window) pairs that came too late
    max_event_us: int | None = None  # event time: the latest believable event time of the epoch


def collect_side_outputs(plan: PlannedEpoch, pipeline: Pipeline, rng: EpochRange, assigned: DataFrame | None,
                         watermark: int | None, bound: int | None) -> SideOutputs:
    """Run the side-output job. ``assigned``: the windowed rows with their windows;
    ``watermark``: the one the epoch starts from; ``bound``: the latest event time
    believed (``EventTime.event_time_bound``)."""
    latest = Observation() if plan.event_time is not None else None
    with engine_errors():
        side = _side_output_frame(plan, pipeline, assigned, watermark, bound, latest).toArrow()
    kind = side.column(_SIDE)
    dead = _resolve_dead_letters(side.filter(pc.equal(kind, "dead")).select([columns.POS, "reason", "raw"]), rng)
    if latest is None:
        return SideOutputs(dead)
    window = plan.windowed
    late = _resolve_late(side.filter(pc.equal(kind, "late")), rng, pipeline, window, watermark) if window else None
    return SideOutputs(dead, late, latest.get[_MAX_EVENT])


def _bad_records(plan: PlannedEpoch, pipeline: Pipeline, bound: int | None) -> list[tuple[Column, str]]:
    """What makes a parsed record unfit for state, and the reason it is given, in the
    order checked: the one definition behind both the dead letters and ``valid_rows``."""
    null_key = (plan.operator.dedup.describe_null() if isinstance(plan.operator, ResolvedUniqueRecords)
                else f"null key: {pipeline.key_column!r} is null")
    bad = [(F.col(columns.KEY).isNull(), null_key)]
    if plan.dedup is not None:
        bad.append((F.col(columns.DEDUP_KEY).isNull(), plan.dedup.describe_null()))
    clock = plan.event_time
    if clock is not None:
        column = clock.time_column
        bad.append((F.col(column).isNull(), f"null event time: {column!r} is null"))
        if bound is not None:
            bad.append((clock.event_us() > F.lit(bound),
                        f"event time beyond max_event_time_skew: {column!r} is later than {describe_event_time(bound)} "
                        "(the wall clock when the epoch was cut plus the skew)"))
    return bad


def _bad_reason(plan: PlannedEpoch, pipeline: Pipeline, bound: int | None) -> Column:
    """Why a parsed record cannot reach state, its first reason only (null: it can)."""
    (first, reason), *rest = _bad_records(plan, pipeline, bound)
    case = F.when(first, F.lit(reason))
    for condition, later in rest:
        case = case.when(condition, F.lit(later))
    return case


def _dead_letter_frame(plan: PlannedEpoch, pipeline: Pipeline, bound: int | None = None,
                       latest: Observation | None = None) -> DataFrame:
    """The epoch's bad records, in one pass over its parsed rows (plus its parse errors);
    ``latest``: observes, in the same pass, the latest event time of the valid ones."""
    user_cols = [c for c in plan.keyed.columns if not c.startswith("_volley_")]
    pos = F.col(columns.POS) if columns.POS in plan.keyed.columns else F.lit(None).cast("long")
    tagged = plan.keyed.withColumn(_REASON, _bad_reason(plan, pipeline, bound))
    if latest is not None:
        assert plan.event_time is not None
        valid_time = F.when(F.col(_REASON).isNull(), plan.event_time.event_us())
        tagged = tagged.observe(latest, F.max(valid_time).alias(_MAX_EVENT))
    bad = tagged.where(F.col(_REASON).isNotNull()).select(
        pos.alias(columns.POS), F.col(_REASON).alias("reason"), F.to_json(F.struct(*user_cols)).alias("raw"))
    if not plan.may_have_bad_records:  # a native Parquet read: every record parsed
        return bad
    parse_errors = plan.raw.where(F.col(columns.ERROR).isNotNull()).select(
        F.col(columns.POS), F.col(columns.ERROR).alias("reason"), F.col(columns.RAW).alias("raw")
    )
    return parse_errors.unionByName(bad)


def valid_rows(plan: PlannedEpoch, pipeline: Pipeline, bound: int | None = None) -> DataFrame:
    """The rows state sees: none of ``_bad_records``. One filter per condition, which
    Spark pushes into a Parquet scan (``NOT isnull`` becomes ``isnotnull``)."""
    valid = plan.keyed
    for condition, _ in _bad_records(plan, pipeline, bound):
        valid = valid.where(~condition)
    return valid


def _side_output_frame(plan: PlannedEpoch, pipeline: Pipeline, assigned: DataFrame | None, watermark: int | None,
                       bound: int | None, latest: Observation | None) -> DataFrame:
    """Bad records (observing the latest event time as they are looked for), and for
    windows the late pairs: one Spark job."""
    side = _dead_letter_frame(plan, pipeline, bound, latest).withColumn(_SIDE, F.lit("dead"))
    window = plan.windowed
    if window is None or assigned is None:
        return side
    late = assigned.where(window.is_late(watermark)).select(
        F.col(columns.POS), F.lit(LATE_REASON).alias("reason"), F.col(columns.KEY),
        F.col(window.windowing.time_column).cast("timestamp").alias("_volley_time"),
        F.col(columns.WINDOW_START), F.col(columns.WINDOW_END), F.lit("late").alias(_SIDE),
    )
    return side.unionByName(late, allowMissingColumns=True)


def _positions(table: pa.Table, rng: EpochRange) -> list[pa.Array]:
    """Event positions back as partition, file and record offset, in bulk (late records
    can be many): segment = position >> 40, offset = the segment's start + the low 40 bits."""
    pos = table.column(columns.POS).combine_chunks().cast(pa.int64())
    segment = pc.shift_right(pos, POS_OFFSET_BITS)
    by_segment = [pa.array([getattr(s, a) for s in rng.segments], pa.string()) for a in ("partition", "file")]
    starts = pa.array([s.start for s in rng.segments], pa.int64())
    offsets = pc.add(pc.take(starts, segment), pc.bit_wise_and(pos, (1 << POS_OFFSET_BITS) - 1))
    return [pc.take(values, segment) for values in by_segment] + [offsets]


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


def resolve_duplicates(dropped: pa.Table, rng: EpochRange, dedup: Deduplication) -> pa.Table:
    """The duplicates side output: where each dropped record is, its key and event time,
    and why (``duplicate``, or ``late``: event time + within at or before the watermark
    the epoch started from), in log order."""
    dropped = dropped.sort_by(columns.POS)
    reason = pc.if_else(dropped.column(columns.DEDUP_LATE), pa.scalar(REASON_LATE), pa.scalar(REASON_DUPLICATE))
    cols = _positions(dropped, rng) + [dropped.column(columns.DEDUP_KEY),
                                        dropped.column(columns.DEDUP_TIME).cast(pa.timestamp("us", tz="UTC")), reason]
    return pa.table(cols, names=[f.name for f in _WHERE] + [dedup.key_name, dedup.event_time.time_column, "reason"])


def null_key_dead_letters(
    plan: PlannedEpoch, pipeline: Pipeline, rng: EpochRange, shards: dict[int, ShardEntry]
) -> pa.Table:
    """Single-job epochs: the shard tasks counted records with a null key; only when
    there are some, a second job finds which (file, offset) they are."""
    if not sum(s.null_key_records for s in shards.values()):
        return DEAD_LETTER_SCHEMA.empty_table()
    with engine_errors():
        bad = _dead_letter_frame(plan, pipeline).toArrow()
    return _resolve_dead_letters(bad, rng)
