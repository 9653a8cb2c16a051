"""The user-facing pipeline: source -> stateless Spark transforms -> key -> stateful operator -> sinks.

Pipelines are immutable; each builder call returns a new one, so a base
pipeline can be shared and specialised without surprises.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, TypeVar

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from volley_dagster import columns
from volley_dagster.dimensions.base import DimensionTable, Enrichment, How
from volley_dagster.errors import ConfigError
from volley_dagster.operators.accumulators import Accumulator
from volley_dagster.operators.aggregate import Aggregate
from volley_dagster.operators.dedup import Deduplication, UniqueRecords
from volley_dagster.operators.event_time import DEFAULT_MAX_EVENT_TIME_SKEW, Duration, EventTime, duration_us, skew_us
from volley_dagster.operators.join import IntervalJoin, JoinHow, signed_duration_us
from volley_dagster.operators.process import OutputMode, Processing, TimeMode
from volley_dagster.operators.ttl import DEFAULT_MAX_RESIDENT_ENTRIES, EXPIRED, StateTtl
from volley_dagster.operators.window import WindowedAggregate, Windowing, Windows
from volley_dagster.sinks.base import Sink
from volley_dagster.sources.base import Source
from volley_dagster.sources.multi import MultiSource
from volley_dagster.state.keys import DEFAULT_KEY_GROUPS, ShardLayout

Transform = Callable[[DataFrame], DataFrame]
BadRecordPolicy = Literal["fail", "dead_letter"]
T = TypeVar("T")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


@dataclass(frozen=True)
class Pipeline:
    name: str
    source_given: Source | None = None
    transforms: tuple[Transform | Enrichment, ...] = ()  # in order; an Enrichment joins a pinned table
    key_given: str | None = None
    operator_given: Aggregate | None = None
    windowing: Windowing | None = None
    dedup: Deduplication | None = None
    joining: IntervalJoin | None = None
    sinks: tuple[Sink, ...] = ()
    bad_records: BadRecordPolicy = "fail"
    quote_bad_records: bool = True
    layout: ShardLayout = field(default_factory=ShardLayout)
    processing: Processing | None = None  # ``process(...)``: last, so the fields before keep their places
    # a chain's stage before this one (``chain.py``): its output rows are this stage's records
    upstream: Pipeline | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"pipeline name {self.name!r}: use letters, digits, '_', '-' or '.' (max 100)")

    # The builder fills these in any order; a pipeline that runs has all of them (``validate``).
    @property
    def source_log(self) -> Source:
        """The log the pipeline reads: in a chain, its first stage's (what an epoch is cut from)."""
        if self.upstream is not None:
            return self.upstream.source_log
        return self._required(self.source_given, "source(...)")

    @property
    def has_operator(self) -> bool:
        """Whether this stage's stateful operator is complete, so that a step after it
        starts the chain's next stage, which reads its output (``window`` waits for its
        ``aggregate``; a ``deduplicate`` may still be followed by the operator it feeds)."""
        return self.operator_given is not None or self.joining is not None or self.processing is not None

    def stages(self) -> list[Pipeline]:
        """The chain's stages, first to last, each without the link to the one before."""
        before = self.upstream.stages() if self.upstream is not None else []
        return [*before, replace(self, upstream=None)]

    def _next(self) -> Pipeline:
        """The pipeline a step that reads rows (``key_by``, a transform, ``enrich``)
        applies to: this one, or after a stateful operator the chain's next stage, which
        reads that operator's output rows. A stateful step called on a stage directly
        (``aggregate``, ``window``, ``deduplicate``, ``process``) configures that stage,
        as it always did: ``pipeline.aggregate(...)`` changes its accumulators. The sinks
        given so far go on with the next stage, and stay marked on the stage they were
        given to: a stage of stateless steps alone is folded back before its operator
        (``settled``), and a sink given before a later operator is refused (``validate``)."""
        if not self.has_operator:
            return self
        return Pipeline(self.name, upstream=self, sinks=self.sinks, bad_records=self.bad_records,
                        quote_bad_records=self.quote_bad_records, layout=self.layout)

    @property
    def key_column(self) -> str:
        """The key users see: ``key_by``'s column; a pipeline that only deduplicates: the first ``on`` column."""
        if self.only_deduplicates:
            assert self.dedup is not None
            return self.dedup.on[0]
        return self._required(self.key_given, "key_by(...)")

    @property
    def only_deduplicates(self) -> bool:
        """``deduplicate(...)`` with no key_by, aggregate or window after it: its sinks get the kept records."""
        return (self.dedup is not None and self.key_given is None and self.operator_given is None
                and self.windowing is None and self.joining is None and self.processing is None)

    @property
    def operator(self) -> Aggregate:
        return self._required(self.operator_given, "aggregate(...)")

    def _required(self, value: T | None, step: str) -> T:
        if value is None:
            raise ConfigError(f"pipeline {self.name!r} is incomplete: add {step}")
        return value

    def source(self, log: Source) -> Pipeline:
        """The log the pipeline reads: ``FileLog(...)``, or any ``sources.base.Source``
        (in a chain, its first stage's, wherever it is given)."""
        if self.upstream is not None:
            return replace(self, upstream=self.upstream.source(log))
        return replace(self, source_given=log)

    def sources(self, named: Mapping[str, Source], *, source_column: str | None = None) -> Pipeline:
        """Two or more logs read as one stream, e.g. ``{"orders": FileLog(...), "refunds":
        KafkaSource(...)}``: each epoch records a range of every one before its first
        attempt, and every attempt reads exactly those (``sources/multi.py``). Their
        records share columns by name; ``source_column`` names a column that says which
        source a record came from."""
        return self.source(MultiSource(named, source_column))

    def transform(self, fn: Transform) -> Pipeline:
        """Any DataFrame -> DataFrame function; keep the ``_volley_*`` columns. After a
        stateful operator it applies to that operator's output rows, in the chain's
        next stage (``docs/pipelines.md``)."""
        stage = self._next()
        return replace(stage, transforms=stage.transforms + (fn,))

    def where(self, condition: Column | str | Callable[[], Column]) -> Pipeline:
        """A Spark SQL predicate: a string (``"status = 'active'"``), a Column, or a
        function returning a Column (so the pipeline can be defined before Spark starts)."""
        return self.transform(RowFilter(condition))

    def with_column(self, name: str, expr: Column | str | Callable[[], Column]) -> Pipeline:
        return self.transform(lambda df: df.withColumn(name, _column(expr)))

    def enrich(self, table: DimensionTable, *, on: str | list[str], columns: list[str], how: How = "left",
               broadcast: bool | None = None) -> Pipeline:
        """Join each record with ``table`` (``DeltaDimension``, ``IcebergDimension``,
        ``ParquetDimension``) on ``on``, adding ``columns``. Each epoch reads the version
        pinned when it was cut, on every attempt; the next epoch reads the newest. The
        table must hold one row per key. ``how="inner"`` drops records whose key it
        lacks, ``"left"`` keeps them with nulls; both are counted per epoch.
        ``broadcast``: force (True) or forbid (False) a broadcast join; None lets Spark
        choose by the table's size (a shuffle join past ``autoBroadcastJoinThreshold``)."""
        keys = (on,) if isinstance(on, str) else tuple(on)
        step = Enrichment(table, keys, tuple(columns), how, broadcast)
        if any(e.name == step.name for stage in self.stages() for e in stage.enrichments):
            raise ConfigError(f"pipeline {self.name!r} already enriches with a table named {step.name!r}; "
                              "give the table another name=")
        stage = self._next()
        return replace(stage, transforms=stage.transforms + (step,))

    @property
    def enrichments(self) -> list[Enrichment]:
        return [t for t in self.transforms if isinstance(t, Enrichment)]

    def deduplicate(self, *, on: str | list[str], within: Duration, event_time: str,
                    write_duplicates: bool = False, max_event_time_skew: Duration | None = DEFAULT_MAX_EVENT_TIME_SKEW) -> Pipeline:
        """Drop a record whose ``on`` columns repeat a record kept earlier, while that
        one's key is remembered: until the watermark passes its ``event_time`` plus
        ``within``; and drop as late a record whose own ``event_time`` plus ``within``
        is at or before the watermark its epoch starts from (Spark's
        ``dropDuplicatesWithinWatermark``), so a re-send is never kept twice. It
        applies to the records after the transforms, before the aggregate or window; the first
        record of a key in the log is the one kept. The watermark is the pipeline's
        one (a window's or an event-time TTL's, on the same column), else the latest
        event time. With no ``key_by``/``aggregate`` after it, the sinks get the kept
        records themselves (an upsert sink keys them by ``on``). Duplicates and late
        records are counted per epoch (``duplicates``, ``dedup_late``);
        ``write_duplicates`` also writes them, with where they are and why, to the
        epoch's side output.
        ``max_event_time_skew`` (default one day; None believes any event time): a
        record dated further than this past the wall clock of its epoch's cut is a bad
        record, as for ``window``: one record stamped 2099
        would otherwise move the watermark past every key's deadline. The rules:
        ``volley_dagster.operators.dedup``."""
        columns_on = (on,) if isinstance(on, str) else tuple(on)
        skew = skew_us(max_event_time_skew)
        dedup = Deduplication(columns_on, duration_us(within, "deduplicate(within=...)"), EventTime(event_time, 0, skew),
                              write_duplicates)
        return replace(self, dedup=dedup)

    def key_by(self, column: str) -> Pipeline:
        return replace(self._next(), key_given=column)

    def aggregate(
        self,
        *,
        ttl: Duration | None = None,
        ttl_epochs: int | None = None,
        event_time: str | None = None,
        max_out_of_orderness: Duration = "0 seconds",
        max_event_time_skew: Duration | None = DEFAULT_MAX_EVENT_TIME_SKEW,
        max_expiry_entries: int | None = DEFAULT_MAX_RESIDENT_ENTRIES,
        **accumulators: Accumulator,
    ) -> Pipeline:
        """A running aggregate per key; after ``window(...)``, one per key and window.

        State TTL (running aggregates): ``ttl_epochs=100`` expires a key once 100 epochs
        pass without an update; ``ttl="30 days", event_time="ts"`` once the watermark
        (the latest event time less ``max_out_of_orderness``) passes the key's latest
        event time plus 30 days. An expired key leaves state and is emitted once with
        ``expired = true`` (upsert sinks delete its row). ``max_event_time_skew`` and
        the bad-record rules for event times are those of ``window``;
        ``max_expiry_entries`` bounds the in-memory expiry index per shard (the rest
        is evicted to RocksDB). The rules: ``volley_dagster.operators.ttl``."""
        state_ttl = None
        if event_time is not None and ttl is None:
            raise ConfigError("aggregate(event_time=...) names the clock of ttl=...; give ttl= with it "
                              "(ttl_epochs= counts epochs and needs no event time)")
        if ttl is not None or ttl_epochs is not None:
            clock = None if event_time is None else EventTime(
                event_time, duration_us(max_out_of_orderness, "max_out_of_orderness"),
                skew_us(max_event_time_skew))
            state_ttl = StateTtl(ttl_epochs, None if ttl is None else duration_us(ttl, "ttl"), clock, max_expiry_entries)
        return replace(self, operator_given=Aggregate(tuple(accumulators.items()), ttl=state_ttl))

    def window(
        self,
        windows: Windows,
        *,
        on: str,
        max_out_of_orderness: Duration = "0 seconds",
        allowed_lateness: Duration = "0 seconds",
        max_pending_windows: int | None = None,
        max_event_time_skew: Duration | None = DEFAULT_MAX_EVENT_TIME_SKEW,
    ) -> Pipeline:
        """Aggregate per event-time window (``tumbling``, ``sliding`` or ``session``) over
        the timestamp column ``on``; fired windows are emitted once, in append mode.
        The watermark trails the latest event time by ``max_out_of_orderness``; a window
        fires once the watermark passes its end plus ``allowed_lateness``.
        ``max_pending_windows`` bounds the in-memory pending-window index per shard
        (the rest is evicted to RocksDB). ``max_event_time_skew`` (default one day; None
        believes any event time): a record whose event time lies further than this past the wall clock when its epoch was cut is a bad
        record (dead letter, or the epoch fails, per
        ``on_bad_records``) instead of moving the watermark. The rules:
        ``volley_dagster.operators.window``."""
        windowing = Windowing(
            windows,
            on,
            duration_us(max_out_of_orderness, "max_out_of_orderness"),
            duration_us(allowed_lateness, "allowed_lateness"),
            max_pending_windows,
            skew_us(max_event_time_skew),
        )
        return replace(self, windowing=windowing)

    def join(
        self,
        *,
        left: str,
        right: str,
        on: str,
        left_time: str,
        right_time: str,
        between: tuple[Duration, Duration],
        how: JoinHow = "inner",
        max_out_of_orderness: Duration = "0 seconds",
        max_event_time_skew: Duration | None = DEFAULT_MAX_EVENT_TIME_SKEW,
        left_columns: list[str] | None = None,
        right_columns: list[str] | None = None,
        max_state_rows: int | None = None,
        sides_from: str | None = None,
    ) -> Pipeline:
        """Join two of the pipeline's sources (``sources({...})``) on ``on``, by event
        time: a ``left`` row at ``left_time`` tl and a ``right`` row at ``right_time`` tr
        match when ``tl + between[0] <= tr <= tl + between[1]``, e.g.
        ``between=("-10 minutes", "+30 minutes")``. Each pair is emitted once;
        ``how="left"`` (``"right"``, ``"full"``) also emits each row of that side that
        never matched, with nulls, in the epoch N whose watermark W[N] reaches the row's bound
        (``bound <= W[N]``; the bound is ``tl + between[1]`` for a left row and ``tr -
        between[0]`` for a right row, the last time a row could match it). Each side's
        watermark trails its own latest event time by ``max_out_of_orderness``; the
        join's is the lesser of the two. Rows wait in state until then; a record whose
        bound is already at or before the watermark its epoch ends with matches that
        epoch's rows, then leaves in the same epoch (emitted then if it matched nothing
        and its side is outer). Records at or before the watermark the epoch starts from
        are late (counted, written to the epoch's late records). Each side carries its own
        source's columns but ``on`` (``left_columns=``/``right_columns=`` choose); a
        name both carry is prefixed with its source's name and ``_``
        (``payments_amount``). ``max_state_rows``: per shard, the epoch fails instead of
        holding more rows. ``sides_from``: in a chain's later stage (after a
        ``deduplicate(...)`` of both sources, say), whose records come from the stage
        before, the column that says each record's side (``sources(...,
        source_column=...)``'s, carried on): ``left`` and ``right`` are its values, and
        each side carries ``left_columns``/``right_columns``, which it then needs. The
        rules: ``volley_dagster.operators.join``."""
        lower, upper = (signed_duration_us(b, "join(between=...)") for b in between)
        clock = (duration_us(max_out_of_orderness, "max_out_of_orderness"), skew_us(max_event_time_skew))
        carried = (None if left_columns is None else tuple(left_columns),
                   None if right_columns is None else tuple(right_columns))
        stage = Pipeline(self.name, upstream=self, sinks=self.sinks, bad_records=self.bad_records,
                         quote_bad_records=self.quote_bad_records, layout=self.layout) \
            if self.only_deduplicates else self._next()
        if stage.upstream is not None:
            if sides_from is None or None in carried:
                raise ConfigError(
                    f"pipeline {self.name!r}: join(...) after {stage.upstream.operator_name} reads that operator's "
                    "rows, one stream: give sides_from= (the column that says each row's source, as "
                    "sources(..., source_column=...) names it), left_columns= and right_columns=")
            joining = IntervalJoin(left, right, on, left_time, right_time, lower, upper, how, sides_from, *clock,
                                   *carried, max_state_rows)
            return replace(stage, key_given=on, joining=joining)
        if sides_from is not None:
            raise ConfigError(f"pipeline {self.name!r}: join(sides_from={sides_from!r}) is for a chain's later stage; "
                              "a first join tells its sides by the pipeline's sources")
        sources = self.source_given
        if not isinstance(sources, MultiSource):
            raise ConfigError(f"pipeline {self.name!r}: join(...) joins two of the pipeline's sources; read them with "
                              "sources({...}) first, e.g. sources({'orders': FileLog(...), 'payments': FileLog(...)})")
        unknown = [name for name in (left, right) if name not in sources.sources]
        if unknown or len(sources.sources) != 2:
            raise ConfigError(f"pipeline {self.name!r}: join(left={left!r}, right={right!r}) must name the pipeline's "
                              f"two sources; it reads {sorted(sources.sources)}")
        if sources.source_column is None:  # the join must know each record's side
            sources = MultiSource(sources.sources, columns.SOURCE)
        joining = IntervalJoin(left, right, on, left_time, right_time, lower, upper, how,
                               sources.source_column or columns.SOURCE, *clock, *carried, max_state_rows, sources)
        return replace(self, source_given=sources, key_given=on, joining=joining)

    def process(
        self,
        processor: object,
        *,
        output_schema: str,
        output_mode: OutputMode = "append",
        output_keys: list[str] | None = None,
        time_mode: TimeMode = "None",
        event_time: str | None = None,
        max_out_of_orderness: Duration = "0 seconds",
        max_event_time_skew: Duration | None = DEFAULT_MAX_EVENT_TIME_SKEW,
        input_columns: list[str] | None = None,
        name: str | None = None,
    ) -> Pipeline:
        """Run a team's own keyed logic: a ``StatefulProcessor`` (Spark 4's shape, as
        for ``transformWithStateInPandas``) with value, list and map state declared in
        ``init`` and timers, over each key of ``key_by(...)``. Each key's records of the
        epoch reach ``handleInputRows`` as one pandas frame, in log order; the timers
        due fire after them; the rows the handlers yield (``output_schema``, Spark DDL;
        the key is added first when it lacks it) go to the sinks: every row
        (``output_mode="append"``), or the last row the epoch emits per key and
        ``output_keys`` (Spark's ``"update"``; what an upsert sink matches on).
        ``time_mode="EventTime"``: ``event_time`` is the pipeline's clock, the watermark
        trails the latest event time by ``max_out_of_orderness``, a record at or before
        the watermark its epoch starts from is late (counted, never processed), and
        every timer fires at the stream's end. ``time_mode="ProcessingTime"``: timers on
        the wall clock recorded when the epoch was cut (a retry fires the same).
        ``input_columns`` narrows what the frames carry. The rules:
        ``volley_dagster.operators.process``."""
        clock = None if event_time is None else EventTime(
            event_time, duration_us(max_out_of_orderness, "max_out_of_orderness"), skew_us(max_event_time_skew))
        stage = self
        key = stage._required(stage.key_given, "key_by(...) before process(...)")
        processing = Processing(processor, output_schema, key, time_mode, clock,
                                None if input_columns is None else tuple(input_columns), name or "",
                                output_mode=output_mode, output_keys=tuple(output_keys or ()))
        return replace(stage, processing=processing)

    def stateful_operator(self) -> Aggregate | WindowedAggregate | UniqueRecords | IntervalJoin | Processing:
        if self.processing is not None:
            if self.operator_given is not None or self.windowing is not None or self.joining is not None \
                    or self.dedup is not None:
                raise ConfigError(f"pipeline {self.name!r}: process(...) shares its stage with {self._others()}: "
                                  "a stage has one stateful operator; give key_by(...) (or a transform) between "
                                  "them, and the step after it reads its rows in the chain's next stage")
            upserts = [s.name for s in self.sinks if getattr(s, "mode", None) == "upsert"]
            if upserts and self.processing.output_mode == "append":
                raise ConfigError(f"pipeline {self.name!r}: sink {upserts[0]!r} upserts, but process(...) appends "
                                  "every row it emits; give process(output_mode='update', output_keys=[...]) (the "
                                  "last row per key and output keys wins) or an append sink")
            return replace(self.processing, quote_keys=self.quote_bad_records)
        if self.joining is not None:
            if self.operator_given is not None or self.windowing is not None or self.dedup is not None:
                raise ConfigError(f"pipeline {self.name!r}: join(...) shares its stage with {self._others()}: a "
                                  "stage has one stateful operator; give key_by(...) (or a transform) after the join, "
                                  "and the step after it reads its pairs in the chain's next stage (a deduplication "
                                  "before the join: deduplicate(...) first, then join(..., sides_from=...))")
            return self.joining
        if self.only_deduplicates:
            assert self.dedup is not None
            return UniqueRecords(self.dedup)
        self._check_clock()
        if self.windowing is None:
            return self.operator
        if self.operator.ttl is not None:
            raise ConfigError(f"pipeline {self.name!r}: a state TTL is for running aggregates; a window's state "
                              "already ends when it fires")
        return WindowedAggregate(self.windowing, self.operator)

    def _others(self) -> str:
        """The stateful steps configured on this stage besides ``process``/``join``, as errors name them."""
        steps = [name for name, given in (("aggregate()", self.operator_given), ("window()", self.windowing),
                                          ("deduplicate()", self.dedup), ("join()", self.joining))
                 if given is not None]
        return ", ".join(steps) if self.processing is not None else ", ".join(s for s in steps if s != "join()")

    def _check_clock(self) -> None:
        """One watermark per pipeline: a deduplication dates keys on the window's or TTL's event time."""
        if self.dedup is None:
            return
        ttl = self.operator.ttl
        clock = self.windowing.event_time if self.windowing is not None else ttl.event_time if ttl is not None else None
        if clock is not None and clock.time_column != self.dedup.event_time.time_column:
            raise ConfigError(
                f"pipeline {self.name!r}: deduplicate(event_time={self.dedup.event_time.time_column!r}) and the "
                f"{'window' if self.windowing is not None else 'state TTL'} (on {clock.time_column!r}) must share "
                "one event time: the pipeline has one watermark")
        skew = self.dedup.event_time.max_skew_us
        if clock is not None and skew not in (None, skew_us(DEFAULT_MAX_EVENT_TIME_SKEW), clock.max_skew_us):
            raise ConfigError(
                f"pipeline {self.name!r}: deduplicate(max_event_time_skew=...) differs from the "
                f"{'window' if self.windowing is not None else 'state TTL'}'s: the pipeline has one event-time clock; "
                "give max_event_time_skew to the window or aggregate only")

    def expiry_column(self) -> str | None:
        """The output column that marks a key's expiry (with a state TTL): upsert sinks delete its row."""
        return EXPIRED if self.operator_given is not None and self.operator_given.ttl is not None else None

    def output_keys(self) -> tuple[str, ...]:
        """The columns that identify one output row (what an upsert sink matches on)."""
        if self.only_deduplicates:
            assert self.dedup is not None
            return self.dedup.on
        if self.joining is not None:
            return (self.key_column, *self.joining.row_ids)
        if self.processing is not None:
            return (self.key_column, *self.processing.output_keys)
        return (self.key_column, "window_start") if self.windowing is not None else (self.key_column,)

    def state_keys(self) -> tuple[str, ...] | None:
        """The columns that identify one row of ``read_state`` (None: its first column, a
        deduplication's remembered key)."""
        if self.only_deduplicates:
            return None
        if self.processing is not None:
            return (self.key_column, "variable", "entry")
        return (self.key_column, "source", "row") if self.joining is not None else self.output_keys()

    def sink(self, sink: Sink) -> Pipeline:
        if any(s.name == sink.name for s in self.sinks):
            raise ConfigError(f"pipeline {self.name!r} already has a sink named {sink.name!r}")
        return replace(self, sinks=self.sinks + (sink,))

    def on_bad_records(self, policy: BadRecordPolicy, *, quote_records: bool = True) -> Pipeline:
        """``"fail"`` (default): the epoch fails naming file, offset and reason.
        ``"dead_letter"``: such records go to the epoch's dead-letter output, counted.
        ``quote_records=False``: errors, which reach logs and the Dagster UI, give each
        reason's kind only (never a value from the record); the file and offset stay."""
        if policy not in ("fail", "dead_letter"):
            raise ConfigError(f"bad-record policy must be 'fail' or 'dead_letter', got {policy!r}")
        upstream = None if self.upstream is None else self.upstream.on_bad_records(policy, quote_records=quote_records)
        return replace(self, bad_records=policy, quote_bad_records=quote_records, upstream=upstream)

    def with_shards(self, num_shards: int, num_key_groups: int = DEFAULT_KEY_GROUPS) -> Pipeline:
        """The shards of the stage being built (in a chain, each stage has its own; a
        stage starts with the one before's)."""
        return replace(self, layout=ShardLayout(num_shards, num_key_groups))

    def validate(self) -> None:
        if self.upstream is not None:
            self.upstream.validate()
        self._validate_stage(len(self.stages()) - 1)

    def _validate_stage(self, index: int) -> None:
        where = f"pipeline {self.name!r}" if index == 0 else f"pipeline {self.name!r}, stage {index + 1},"
        required: list[tuple[str, object]] = [("source(...)", self.source_given)] if index == 0 else []
        if self.processing is not None:
            required += [("key_by(...)", self.key_given)]
        elif self.joining is None and not self.only_deduplicates:
            required += [("key_by(...)", self.key_given), ("aggregate(...)", self.operator_given)]
        missing = [what for what, value in required if value is None]
        if missing:
            raise ConfigError(f"{where} is incomplete: add {', '.join(missing)}")
        given = [sink.name for stage in (self.stages()[:-1] if self.upstream is not None else []) for sink in stage.sinks]
        if given:
            raise ConfigError(
                f"pipeline {self.name!r}: sink {given[0]!r} is given before a later stateful operator; a chain's sinks "
                "take its last stage's rows: give the sinks after the last stateful operator (a table of the rows "
                "in between is a pipeline of its own: docs/pipelines.md, 'Pipelines that feed pipelines')")
        if self.upstream is not None and not self.upstream.emits_appends:
            raise ConfigError(
                f"{where} reads the output of {self.upstream.operator_name}, which updates a key's row every epoch "
                "it changes: a later operator would take each update as a new record (Spark refuses an operator "
                "after an update-mode one too). Put a window(...) or a join first, give process(...) "
                "output_mode='append', or make it the pipeline's last stateful step")
        if self.upstream is not None and self.clock is not None:
            self.upstream.handed_delay_us(self.clock.time_column)

    def settled(self) -> Pipeline:
        """The pipeline as it runs, validated. Stateless steps (transforms, ``key_by``)
        after the last stateful operator, with no operator after them, apply to its
        input, as they always did (a deploy derives a changed pipeline so:
        ``pipeline.with_column(...)``); only a stateful operator after them makes them a
        stage of the chain, reading its output."""
        pipeline = self
        if self.upstream is not None and not self.has_operator and self.dedup is None and self.windowing is None:
            before = self.upstream
            pipeline = replace(before, transforms=before.transforms + self.transforms, sinks=self.sinks,
                               layout=self.layout, key_given=self.key_given or before.key_given,
                               source_given=before.source_given or self.source_given)
        pipeline.validate()
        return pipeline

    @property
    def clock(self) -> EventTime | None:
        """The stage's event-time clock, if its operator has one (one per stage: ``_check_clock``)."""
        if self.processing is not None:
            return self.processing.event_time
        if self.joining is not None:
            return self.joining.event_time
        if self.windowing is not None:
            return self.windowing.event_time
        ttl = self.operator_given.ttl if self.operator_given is not None else None
        if ttl is not None and ttl.event_time is not None:
            return ttl.event_time
        return self.dedup.event_time if self.dedup is not None else None

    def with_watermark_handed(self, given_us: int | None) -> Pipeline:
        """This stage with every clock it has handed ``given_us`` (None: none yet) by the
        stage before, for one epoch (``chain.py``)."""
        windowing, dedup, operator, processing = self.windowing, self.dedup, self.operator_given, self.processing
        if windowing is not None:
            windowing = replace(windowing, clock=windowing.event_time.handed_on(given_us))
        if dedup is not None:
            dedup = replace(dedup, event_time=dedup.event_time.handed_on(given_us))
        if operator is not None and operator.ttl is not None and operator.ttl.event_time is not None:
            operator = replace(operator, ttl=replace(operator.ttl, event_time=operator.ttl.event_time.handed_on(given_us)))
        if processing is not None and processing.event_time is not None:
            processing = replace(processing, event_time=processing.event_time.handed_on(given_us))
        joining = self.joining
        if joining is not None:
            joining = replace(joining, clock=joining.event_time.handed_on(given_us))
        return replace(self, windowing=windowing, dedup=dedup, operator_given=operator, processing=processing,
                       joining=joining)

    def handed_delay_us(self, column: str) -> int:
        """How far behind the stage's W[N] the event times (on ``column`` of its output)
        of the rows it emits after epoch N may lie: the next stage is handed W[N] less
        this, so none of them is late there (Spark 4 lowers a join's output watermark so).
        A join: a pair or an outer row leaves once the watermark passes its bound, so its
        times trail by at most the interval's width on either side; windows: fired after
        the watermark passed their end plus the lateness (and their start by the size); a
        deduplication: a record is kept until ``within`` behind; ``process``: none."""
        if self.joining is not None:
            return max(self.joining.upper_us, -self.joining.lower_us, 0)
        if self.windowing is not None:
            windowing = self.windowing
            if column == "window_end":
                return windowing.lateness_us
            if windowing.windows.kind == "session":
                raise ConfigError(
                    f"pipeline {self.name!r}: the step after the session windows keeps time on {column!r}; a session "
                    "may start any time before it ends, so only 'window_end' can carry the watermark on: use it")
            return windowing.lateness_us + windowing.windows.size_us
        if self.processing is not None:
            return 0
        return self.dedup.within_us if self.dedup is not None else 0

    @property
    def emits_appends(self) -> bool:
        """Whether every row the stage's operator emits is new (windows, a join, a
        deduplication, ``process`` appending): what a later stage can take as records."""
        if self.processing is not None:
            return self.processing.output_mode == "append"
        return self.joining is not None or self.windowing is not None or self.only_deduplicates

    @property
    def operator_name(self) -> str:
        """How errors name the stage's stateful operator."""
        if self.processing is not None:
            return "process(...)"
        if self.joining is not None:
            return "join(...)"
        if self.windowing is not None:
            return "window(...).aggregate(...)"
        return "aggregate(...)" if self.operator_given is not None else "deduplicate(...)"

    def apply_transforms(self, df: DataFrame, join: Callable[[DataFrame, Enrichment], DataFrame]) -> DataFrame:
        """The transforms in order; ``join`` applies an enrichment (``spark/enrich.py``)."""
        for fn in self.transforms:
            df = join(df, fn) if isinstance(fn, Enrichment) else fn(df)
            if not isinstance(df, DataFrame):
                raise ConfigError(f"pipeline {self.name!r}: transform {fn!r} returned {type(df).__name__}, not a DataFrame")
        return df

    def key_expr(self) -> Column:
        return F.col(self.key_column)

    @property
    def only_filters(self) -> bool:
        """Whether every transform only drops records (``where``), so that what holds of
        every record read holds of every record after them."""
        return all(isinstance(t, RowFilter) for t in self.transforms)


@dataclass(frozen=True, eq=False)
class RowFilter:
    """``Pipeline.where``: a transform the plan knows keeps columns as they are."""

    condition: Column | str | Callable[[], Column]

    def __call__(self, df: DataFrame) -> DataFrame:
        return df.where(_column(self.condition))


def _column(expr: Column | str | Callable[[], Column]) -> Column:
    if isinstance(expr, str):
        return F.expr(expr)
    if callable(expr) and not isinstance(expr, Column):
        return expr()
    return expr
