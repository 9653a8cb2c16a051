"""An epoch's side outputs: records that do not reach state, each with its reason
and where it came from (partition, file, offset). Bad records (unparseable, null
key, null or unbelievable event time) become dead letters; the operator's late rows
(windows: the (record, window) pairs whose window had closed) become late records;
the records an operator dropped (a deduplication's) become its side output. The
stage gathers them in one ``EpochSideOutputs`` and resolves them together at its end.
One Spark job finds the bad and the late ones before the state stage, since the
epoch's latest event time, seen in the same pass, moves the watermark the shard tasks
fire by: one pass over the parsed rows, one over the operator's late rows, and for a
Python-decoded read one over its cached raw rows for the parse errors. A pre-step
whose own job reads every valid record (a deduplication's probe) observes the latest
event time and counts the bad records on the way (``observed_rows``); then, when the
operator has no late rows, the side-output job runs only if there were bad records.
When the epoch is local Parquet files, only filtered (``Pipeline.where``) before the
key, and their footers (of the row groups its segments touch) show no null key, no
null or unbelievable event time and none early enough to be late, there is nothing to
find (``_footers_show_clean``). The latest event time is then the footers' when the
segments are files read as they are (of a part of a file, its event times are read
exactly: the one column of the row groups it touches); learnt from the shard tasks when
they act alike at any watermark up to the footers' (``SparkOperator.acts_from``); else
one aggregate's."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.errors import PySparkAssertionError
from pyspark.sql import Column, DataFrame, Observation
from pyspark.sql import functions as F

from volley_dagster import columns
from volley_dagster.operators.dedup import EXACT_JSON
from volley_dagster.operators.event_time import describe_event_time
from volley_dagster.pipeline import Pipeline
from volley_dagster.sources.base import ColumnStatistics
from volley_dagster.sources.multi import SEPARATOR, MultiSource
from volley_dagster.sources.offsets import EpochRange
from volley_dagster.spark.plan import PlannedEpoch
from volley_dagster.spark.task_errors import engine_errors

_WHERE = [pa.field("partition", pa.string()), pa.field("file", pa.string()), pa.field("offset", pa.int64())]
DEAD_LETTER_SCHEMA = pa.schema(_WHERE + [pa.field("reason", pa.string()), pa.field("raw", pa.string())])
_SIDE = "_volley_side"  # which side output a row of the side-output job belongs to
_MAX_EVENT = "_volley_max_event"
_BAD = "_volley_bad_records"
_REASON = "_volley_reason"
_FOUND_SCHEMA = pa.schema([pa.field(columns.POS, pa.int64()), pa.field("reason", pa.string()),
                           pa.field("raw", pa.string()), pa.field(_SIDE, pa.string())])


@dataclass(frozen=True)
class SideOutputs:
    """An epoch's side outputs, each in log order with where its records are in the log."""

    dead_letters: pa.Table  # DEAD_LETTER_SCHEMA
    late: pa.Table | None = None  # windows: (record, window) pairs that came too late
    dropped: pa.Table | None = None  # records the operator dropped (a deduplication's), with its side output on

    @classmethod
    def empty(cls) -> SideOutputs:
        return cls(DEAD_LETTER_SCHEMA.empty_table())


class EpochSideOutputs:
    """What one epoch keeps out of state, gathered as the stage runs:
    ``valid_rows`` (what state sees) -> ``find`` (the one side-output job) -> ``resolve``
    (every side output where its records are in the log, together). ``watermark``: the
    one the epoch starts from; ``bound``: the latest event time believed
    (``EventTime.event_time_bound``)."""

    def __init__(self, plan: PlannedEpoch, pipeline: Pipeline, rng: EpochRange, watermark: int | None,
                 bound: int | None) -> None:
        self._plan, self._pipeline, self._rng = plan, pipeline, rng
        self._watermark, self._bound = watermark, bound
        self._found: pa.Table | None = None  # the job's rows, positions not yet resolved
        self._late_columns: list[str] = []
        self._observed: Observation | None = None  # ``observed_rows``: what the pre-step's job saw
        self.maxima: dict[str, int | None] = {}  # event time: the latest believable one of the epoch (per input)
        # none yet: the shard tasks act alike at any watermark the footers allow, and give it (``learn_maxima``)
        self.maxima_from_shards = False
        self.job_s = 0.0  # the side-output job's seconds (0: none ran)

    def valid_rows(self) -> DataFrame:
        """The rows state sees: none of ``_bad_records``. One filter per condition, which
        Spark pushes into a Parquet scan (``NOT isnull`` becomes ``isnotnull``)."""
        valid = self._plan.keyed
        for condition, _ in _bad_records(self._plan, self._pipeline, self._bound):
            valid = valid.where(~condition)
        return valid

    def observed_rows(self) -> DataFrame:
        """``valid_rows`` for a pre-step whose job reads them all (``PreStep.run``), observed
        on the way: the epoch's latest valid event time and how many records are bad (the
        observation sees every record, so its filter is not pushed into the scan: the probe
        reads every record anyway). A Python-decoded read's parse errors are not among
        these rows: it is not observed, and its side-output job runs as before."""
        plan = self._plan
        if plan.may_have_bad_records:
            return self.valid_rows()
        self._observed = Observation()
        tagged = _observing(plan.keyed.withColumn(_REASON, _bad_reason(plan, self._pipeline, self._bound)), plan,
                            self._observed)
        return tagged.where(F.col(_REASON).isNull()).drop(_REASON)

    def find(self, late: DataFrame | None, late_bound: int | None, next_due: int | None) -> None:
        """Find the bad and late records. ``late``: the operator's late rows
        (``SparkOperator.late``), which only records before ``late_bound`` can have
        (``SparkOperator.late_bound``); ``next_due``: the shards' earliest deadline
        (``SparkOperator.acts_from``). When the pre-step's job observed the records
        (``observed_rows``), the side-output job runs only for bad records or late rows;
        when the footers show there are none, it does not run."""
        plan = self._plan
        footers = _footers_show_clean(plan, self._pipeline, self._rng, self._bound, late_bound)
        if footers is not None:
            if plan.files_as_read:  # what they show of the event times is exact
                self.maxima = {name: times.latest_us for name, times in footers.items()}
            elif set(footers) == {""} and self._shards_act_alike(footers[""], next_due):
                # the tasks run at the watermark the epoch starts from (no maximum moves it),
                # never at a bound above the epoch's own: an index keeps what it passed as gone
                self.maxima, self.maxima_from_shards = {"": None}, True
            else:
                self.maxima = self._latest_kept()
            self._found = _FOUND_SCHEMA.empty_table()
            return
        self._late_columns = late.columns if late is not None else []
        seen = self._seen()
        if seen is not None:  # the pre-step's job saw the maxima: this job need not observe them again
            self._read_maxima(seen)
            if late is None and not seen[_BAD]:
                self._found = _FOUND_SCHEMA.empty_table()
                return
            self._run(_side_output_frame(plan, self._pipeline, late, self._bound, None))
            return
        latest = Observation() if plan.event_time is not None else None
        self._run(_side_output_frame(plan, self._pipeline, late, self._bound, latest))
        if latest is not None:
            self._read_maxima(latest.get)

    def _shards_act_alike(self, footers: ColumnStatistics, next_due: int | None) -> bool:
        """Whether the shard tasks do the same at every watermark the footers leave open
        (up to the one their latest event time would give), so that the epoch's own can
        come from the shard tasks, after them."""
        clock, operator = self._plan.event_time, self._plan.operator
        assert clock is not None and footers.earliest_us is not None
        acts = operator.acts_from(footers.earliest_us, next_due)
        highest = clock.advance(self._watermark, footers.latest_us)
        return acts is not None and highest is not None and highest < acts

    def learn_maxima(self, latest: int | None) -> None:
        """The epoch's latest event time, from the shard tasks (``maxima_from_shards``)."""
        assert self.maxima_from_shards
        self.maxima = {"": latest}

    def _latest_kept(self) -> dict[str, int | None]:
        """The latest event time of the epoch's records (those the filters kept), per
        input, which the footers only bound: one aggregate over the columns it needs, not
        the side-output job, which reads every column for the bad records' text (0.33 s
        against 0.56 s for a file of 1M records)."""
        clock = self._plan.event_time
        assert clock is not None
        t0 = time.perf_counter()
        maxima = clock.maxima(clock.event_us())
        with engine_errors():
            latest = self._plan.keyed.agg(*maxima.values()).first()
        self.job_s = time.perf_counter() - t0
        return {name: None if latest is None else latest[i] for i, name in enumerate(maxima)}

    def _seen(self) -> dict[str, int | None] | None:
        """What ``observed_rows`` observed, once the pre-step's job has run; None if nothing
        observed them, or a Spark Connect session did not send the figures back."""
        if self._observed is None:
            return None
        try:
            return self._observed.get
        except PySparkAssertionError:
            return None

    def _run(self, frame: DataFrame) -> None:
        t0 = time.perf_counter()
        with engine_errors():
            self._found = frame.toArrow()
        self.job_s = time.perf_counter() - t0

    def _read_maxima(self, observed: dict[str, int | None]) -> None:
        if self._plan.event_time is not None:
            self.maxima = {name: observed[f"{_MAX_EVENT}{name}"] for name in self._plan.event_time.inputs}

    @property
    def bad_records(self) -> int:
        """Dead letters ``find`` found."""
        return 0 if self._found is None else int(pc.sum(pc.equal(self._found.column(_SIDE), "dead")).as_py() or 0)

    def resolve(self, null_keys: int = 0, dropped: pa.Table | None = None) -> SideOutputs:
        """Every side output. ``null_keys``: records with a null key the shard tasks
        counted when ``find`` did not run (a single-job epoch): only when there are
        some, a second job finds which (file, offset) they are. ``dropped``: the
        operator's dropped records, resolved by it."""
        if self._found is None:
            if not null_keys:
                return SideOutputs(DEAD_LETTER_SCHEMA.empty_table(), None, dropped)
            with engine_errors():
                bad = _dead_letter_frame(self._plan, self._pipeline).toArrow()
            return SideOutputs(_resolve_dead_letters(bad, self._rng), None, dropped)
        kind = self._found.column(_SIDE)
        dead = _resolve_dead_letters(self._found.filter(pc.equal(kind, "dead")).select([columns.POS, "reason", "raw"]),
                                     self._rng)
        late = None
        if self._late_columns:
            assert self._plan.event_time is not None
            late = _resolve_late(self._found.filter(pc.equal(kind, "late")), self._late_columns, self._rng,
                                 self._pipeline.key_column, self._plan.event_time.time_column, self._watermark)
        return SideOutputs(dead, late, dropped)


def _bad_records(plan: PlannedEpoch, pipeline: Pipeline, bound: int | None) -> list[tuple[Column, str]]:
    """What makes a parsed record unfit for state, and the reason it is given, in the
    order checked: the one definition behind both the dead letters and ``EpochSideOutputs.valid_rows``."""
    bad = [(F.col(columns.KEY).isNull(), plan.operator.null_key_reason(pipeline.key_column)),
           *plan.operator.unfit_records()]
    if plan.dedup is not None:
        bad.append((F.col(columns.DEDUP_KEY).isNull(), plan.dedup.describe_null()))
    clock = plan.event_time
    if clock is not None:
        bad.append((clock.column().isNull(), f"null event time: {clock.shown} is null"))
        if bound is not None:
            bad.append((clock.event_us() > F.lit(bound),
                        f"event time beyond max_event_time_skew: {clock.shown} is later than {describe_event_time(bound)} "
                        "(the wall clock when the epoch was cut plus the skew)"))
    return bad


def _footers_show_clean(plan: PlannedEpoch, pipeline: Pipeline, rng: EpochRange, bound: int | None,
                        late_bound: int | None) -> dict[str, ColumnStatistics] | None:
    """What the footers say of the epoch's event times per input of its clock (their
    earliest and latest bound the records', exact for rows as read:
    ``PlannedEpoch.files_as_read``), when they show that none of ``_bad_records`` holds
    for any record and none is before ``late_bound``; None when they do not show it (a
    job must look). Only for an epoch whose columns reach the operator as they are, if
    filtered (``PlannedEpoch.footers``), keyed by a column of them, each segment's
    records feeding one input its source names (a join's side)."""
    clock = plan.event_time
    if not plan.footers or clock is None or plan.dedup is not None:
        return None
    sources = pipeline.source_log
    source_column = sources.source_column if isinstance(sources, MultiSource) else None  # a source names its records
    times: dict[str, ColumnStatistics] = {}
    for i, footer in enumerate(plan.footers):
        source = rng.segments[i].partition.partition(SEPARATOR)[0] if source_column is not None else None
        name = clock.input_of(source, source_column)
        key = footer.get(pipeline.key_column)
        if name is None or key is None or key.nulls != 0 or not plan.operator.fit_by_footer(source, footer):
            return None
        time = _segment_times(plan, i, footer, clock.time_column_of(name))
        if time is None or time.nulls != 0:
            return None
        if time.earliest_us is None or time.latest_us is None:
            return None
        if (bound is not None and time.latest_us > bound) or (late_bound is not None and time.earliest_us < late_bound):
            return None
        times[name] = times[name] | time if name in times else time
    return times


def _segment_times(plan: PlannedEpoch, i: int, footer: Mapping[str, ColumnStatistics],
                   time_column: str) -> ColumnStatistics | None:
    """What segment ``i``'s footer says of its event times; of rows as read that are part
    of a file, what they are exactly, read (a footer's row groups straddle the cut, so
    their earliest time is an earlier epoch's, their latest a later one's)."""
    time = footer.get(time_column)
    if time is None or not plan.files_as_read:
        return time
    seg, file = plan.files_as_read[i]
    return time if file.is_all_of(seg) else file.time_statistics(time_column, seg.start, seg.end)


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
    ``latest``: observes, in the same pass, the latest event time of the valid ones. A
    parsed record's ``raw`` is its columns' JSON, exact (``EXACT_JSON``: timestamps to the
    microsecond, in UTC, and null fields written as nulls); a parse error's is its text."""
    user_cols = [c for c in plan.keyed.columns if not c.startswith("_volley_")]
    pos = F.col(columns.POS) if columns.POS in plan.keyed.columns else F.lit(None).cast("long")
    tagged = plan.keyed.withColumn(_REASON, _bad_reason(plan, pipeline, bound))
    if latest is not None:
        tagged = _observing(tagged, plan, latest)
    bad = tagged.where(F.col(_REASON).isNotNull()).select(
        pos.alias(columns.POS), F.col(_REASON).alias("reason"),
        F.to_json(F.struct(*user_cols), options=EXACT_JSON).alias("raw"))  # to the microsecond, nulls shown
    if not plan.may_have_bad_records:  # a native Parquet read: every record parsed
        return bad
    parse_errors = plan.raw.where(F.col(columns.ERROR).isNotNull()).select(
        F.col(columns.POS), F.col(columns.ERROR).alias("reason"), F.col(columns.RAW).alias("raw")
    )
    return parse_errors.unionByName(bad)


def _observing(tagged: DataFrame, plan: PlannedEpoch, observation: Observation) -> DataFrame:
    """``tagged`` (with ``_REASON``), observing how many records are bad and the latest
    event time of the others (per input)."""
    figures = [F.count(F.col(_REASON)).alias(_BAD)]
    if plan.event_time is not None:
        valid_time = F.when(F.col(_REASON).isNull(), plan.event_time.event_us())
        figures += [m.alias(f"{_MAX_EVENT}{name}") for name, m in plan.event_time.maxima(valid_time).items()]
    return tagged.observe(observation, *figures)


def _side_output_frame(plan: PlannedEpoch, pipeline: Pipeline, late: DataFrame | None, bound: int | None,
                       latest: Observation | None) -> DataFrame:
    """Bad records (observing the latest event time as they are looked for), and the
    operator's late rows: one Spark job."""
    side = _dead_letter_frame(plan, pipeline, bound, latest).withColumn(_SIDE, F.lit("dead"))
    if late is None:
        return side
    return side.unionByName(late.withColumn(_SIDE, F.lit("late")), allowMissingColumns=True)


def _resolve_dead_letters(table: pa.Table, rng: EpochRange) -> pa.Table:
    table = table.sort_by(columns.POS)
    where = rng.where_in_log(table.column(columns.POS).combine_chunks())
    return pa.table(where + [table.column("reason"), table.column("raw")], schema=DEAD_LETTER_SCHEMA)


def _resolve_late(table: pa.Table, names: list[str], rng: EpochRange, key_column: str, time_column: str,
                  watermark: int | None) -> pa.Table:
    """Late rows (``SparkOperator.late``: position, reason, key, event time, then the
    operator's own columns, such as the window) where they are in the log, in log order."""
    own = [n for n in names if n not in (columns.POS, "reason", columns.KEY, columns.LATE_TIME)]
    table = table.sort_by([(columns.POS, "ascending")] + [(n, "ascending") for n in own])
    ts = pa.timestamp("us", tz="UTC")
    cols = rng.where_in_log(table.column(columns.POS).combine_chunks()) + [
        table.column(columns.KEY), table.column(columns.LATE_TIME).cast(ts), *[table.column(n) for n in own],
        pa.array([watermark] * table.num_rows, pa.int64()).cast(ts), table.column("reason"),
    ]
    return pa.table(cols, names=[f.name for f in _WHERE] + [key_column, time_column, *own, "watermark", "reason"])
