"""What a stateful operator is to the engine: Spark-side partials, then one call per
shard task that folds them into the shard's state through its transaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.compute as pc

from volley_dagster import columns
from volley_dagster.json_records import JsonObject
from volley_dagster.state.keys import ShardLayout
from volley_dagster.state.resident import ResidentRecords
from volley_dagster.state.transaction import ShardTransaction

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from volley_dagster.operators.aggregate import ResolvedAggregate
    from volley_dagster.operators.event_time import EventTime
    from volley_dagster.sources.base import ColumnStatistics
    from volley_dagster.sources.offsets import EpochRange
    from volley_dagster.spark.partitioning import ShardRoute
    from volley_dagster.spark.tasks import ShardMerge


@dataclass(frozen=True)
class StateNamespaces:
    """The RocksDB namespaces (``state/keys.py`` prefixes) an operator's state uses, so
    rescaling and state reads ask the operator instead of knowing its layout."""

    keyed: tuple[int, ...]  # ns | key group | key: the first holds the state ``decode_state`` reads
    pending: int | None = None  # ns | end | state key (key group inside the state key)
    meta: int | None = None  # per-shard pending-window index
    shown: tuple[int, ...] | None = None  # the keyed namespaces ``decode_state`` reads (None: the first)

    @property
    def state(self) -> int:
        return self.keyed[0]

    @property
    def meta_ns(self) -> int:
        assert self.meta is not None, "the operator keeps no pending-window index"
        return self.meta

    @property
    def pending_ns(self) -> int:
        assert self.pending is not None, "the operator keeps no pending-window index"
        return self.pending

    @property
    def state_shown(self) -> tuple[int, ...]:
        return self.shown or (self.state,)

    def all(self) -> set[int]:
        return set(self.keyed) | {ns for ns in (self.pending, self.meta) if ns is not None}


@dataclass(frozen=True)
class OperatorStats:
    """What an operator did in one shard: keys it read and wrote, keys it saw for the
    first time, and its own figures (windows: fired, opened, pending entries)."""

    keys_touched: int = 0
    new_keys: int = 0
    figures: dict[str, int] = field(default_factory=dict)
    records: int = 0  # the epoch's records folded into state (a deduplication's dropped copies are none)


PROCESSING_CLOCK = "processing_clock_us"  # an epoch's figure: its processing time (``ShardStep.processing_time``)
TIMERS_DUE_FROM = "timers_due_from_us"  # an epoch's figure: its earliest timer left due (``ShardStep.due_from``)
LATEST_EVENT = "latest_event_us"  # a shard's figure: the latest event time of its records (microseconds)


def latest_event(shards: Sequence[OperatorStats]) -> int | None:
    """The latest event time the shard tasks saw (``LATEST_EVENT``; None: none said)."""
    return max((s.figures[LATEST_EVENT] for s in shards if LATEST_EVENT in s.figures), default=None)


def partial_records(data: pa.Table) -> int:
    """The records a shard's partial rows stand for (each row counts its ``ROWS``)."""
    return int(pc.sum(data.column(columns.ROWS)).as_py() or 0)


@dataclass(frozen=True)
class ShardStep:
    """What a shard task knows about the epoch beyond its own rows."""

    epoch: int
    key_kind: str  # "int" | "str": how state keys encode the key
    fire_limit: int | None = None  # windows ending at or before this fire (microseconds)
    expire_limit: int | None = None  # event-time TTL: keys whose deadline is at or before this expire
    watermark_before: int | None = None  # event time: the watermark the epoch starts from
    watermark: int | None = None  # and the one after it
    layout: ShardLayout | None = None  # the epoch's shards, and the one this task is (set per task)
    shard: int | None = None
    # processing time (microseconds): the wall clock of the epoch's cut, recorded with its range so a
    # retry sees the same, never before the previous epoch's (``PROCESSING_CLOCK``); and that previous one
    processing_time: int | None = None
    processing_time_before: int | None = None
    due_from: int | None = None  # timers a handler registered at or before an epoch's limit wait from here (µs)


class StatefulOperator(Protocol):
    @property
    def resident_records(self) -> ResidentRecords | None:
        """A shard's state as fixed-width records, when it can stay resident between
        epochs (``state/resident.py``); None: RocksDB only."""

    def layout(self) -> JsonObject:
        """What must not change between epochs of one checkpoint root."""

    @property
    def namespaces(self) -> StateNamespaces:
        """Where its state lives."""

    def decode_state(self, keys: list[bytes], values: list[bytes], key_kind: str, key_name: str,
                     key_group: str | None = None) -> pa.Table:
        """The rows users read (key first) of records scanned from ``namespaces.state``;
        with ``key_group``, each row's key group follows the key under that name."""

    def output_ddl(self) -> list[str]:
        """Spark DDL of the output columns after the key."""

    def output_names(self) -> list[str]:
        """Names of the output columns after the key."""

    def apply(self, txn: ShardTransaction, data: pa.Table, step: ShardStep) -> tuple[list[pa.Array], OperatorStats]:
        """Fold one shard's partials (key, key group and partial columns) into state;
        returns the output columns (key first) and statistics for the manifest."""

    def epoch_figures(self, shards: Sequence[OperatorStats]) -> dict[str, int]:
        """The operator's figures of the epoch, from its shards' (the epoch result and
        its manifest record them, Dagster shows each as a number)."""


def summed(shards: Sequence[OperatorStats], names: Sequence[str]) -> dict[str, int]:
    """``names``' figures added up over the shards (an absent one counts 0)."""
    return {name: sum(s.figures.get(name, 0) for s in shards) for name in names}


@dataclass(frozen=True)
class StageClock:
    """What the stage knows of event time when an operator routes the epoch's rows."""

    watermark_before: int | None = None  # the watermark the epoch starts from
    watermark: int | None = None  # and the one after it
    end_of_stream: bool = False


class SparkOperator(StatefulOperator, Protocol):
    """What a resolved operator does in the epoch's Spark stage (``spark/stage.py``),
    which composes these steps in order and never asks which operator it has:
    ``assign`` -> side outputs (``late``) -> ``shard_input`` -> the epoch's one
    exchange (``spark/partitioning.route_to_shards``) -> ``partials`` -> the shard
    tasks (``apply``) -> ``sink_output``."""

    @property
    def event_time(self) -> EventTime | None:
        """The clock the epoch advances a watermark on (None: the operator has none)."""

    @property
    def runs_without_records(self) -> bool:
        """Whether an epoch without records must still run the shard tasks (keys may
        expire, windows may fire); else its snapshots are N-1's, carried forward."""

    @property
    def rows_are_sink_rows(self) -> bool:
        """Whether ``sink_output`` passes the shard tasks' rows through unchanged, so that
        the tasks may write them straight into the sinks' folders (``ShardMerge.staging``)."""

    @property
    def one_row_per_key(self) -> bool:
        """Whether each shard task's rows hold each of its keys (the pipeline's key) at
        most once, so that an upsert by that key is each task's own files rewritten
        (``sinks/shard_files.py``)."""

    def null_key_reason(self, key_column: str) -> str:
        """Why a record whose key is null is a dead letter."""

    def unfit_records(self) -> list[tuple[Column, str]]:
        """Further conditions that make a record a bad record for this operator (a value
        its state cannot carry), each with its reason: checked with the others."""

    def fit_by_footer(self, source: str | None, footer: Mapping[str, ColumnStatistics]) -> bool:
        """Whether a file's ``footer`` shows that none of its records is one of
        ``unfit_records`` (``source``: the records' source in a pipeline of several,
        else None), so that no job need look for them (``spark/side_outputs.py``)."""

    def output_schema(self, key_ddl: str) -> list[str]:
        """Spark DDL of every column the shard tasks return, the key's (``key_ddl``) first."""

    def input_columns(self) -> tuple[str, ...] | None:
        """The columns of its input rows that the steps below read (None: all of them).
        A step before it that hands the rows through Python (a deduplication's probe in
        the state stage's job) passes on only these, as Spark cannot prune through it."""

    def assign(self, rows: DataFrame) -> DataFrame:
        """The rows the operator folds (windows: one per record and window)."""

    def late(self, assigned: DataFrame, watermark: int | None) -> DataFrame | None:
        """The assigned rows too late for ``watermark``, for the late-records side output
        (``POS``, ``reason``, ``KEY``, ``_volley_time`` and the operator's own columns);
        None: the operator has no late rows."""

    def late_bound(self, watermark: int | None) -> int | None:
        """The event time (microseconds) from which on no record is late at ``watermark``:
        only an earlier one can have a late row (None: none can). It lets the epoch skip
        looking for late rows when every record is later (``spark/side_outputs.py``)."""

    def acts_from(self, earliest_us: int, next_due: int | None) -> int | None:
        """The least watermark W[N] at which the shard tasks may act on it, when the epoch's
        records are none earlier than ``earliest_us`` and the shards' earliest deadline is
        ``next_due`` (the previous epoch's ``expiry_next``); None: any W[N] may change what
        they do. Below it they do the same whatever W[N] is, so the stage may learn W[N]
        from them (``LATEST_EVENT``) instead of from a job before them."""

    def shard_input(self, assigned: DataFrame, clock: StageClock, step: ShardStep) -> tuple[DataFrame, ShardStep]:
        """The assigned rows the stage routes to the shards (windows: the pairs on time),
        and the shard step with what the tasks must know of ``clock``."""

    def partials(self, route: ShardRoute) -> DataFrame:
        """What the shard tasks get, from the routed rows: pre-aggregated in the JVM by
        ``route.grouping`` and the operator's own keys, so that Spark plans no second
        exchange (or the rows as they are)."""

    def sink_output(self, output: pa.Table, rng: EpochRange) -> tuple[pa.Table, pa.Table | None]:
        """The shard tasks' rows as the sinks take them, and the records they dropped,
        for the duplicates side output (None: none kept)."""


class KeyedRows:
    """The steps of an operator over the pipeline's key whose state can hold any value
    a record carries: a null key is the only bad record it adds, and its output is the
    key, then its own columns."""

    def output_ddl(self) -> list[str]:
        raise NotImplementedError

    def null_key_reason(self, key_column: str) -> str:
        return f"null key: {key_column!r} is null"

    def unfit_records(self) -> list[tuple[Column, str]]:
        return []

    def fit_by_footer(self, source: str | None, footer: Mapping[str, ColumnStatistics]) -> bool:
        return True

    def output_schema(self, key_ddl: str) -> list[str]:
        return [key_ddl] + self.output_ddl()


class PreStepRun(Protocol):
    """A pre-step's result in one epoch, held (cached) until the stage has read it."""

    @property
    def figures(self) -> dict[str, int]:
        """Its figures of the epoch (a deduplication's: duplicates, late)."""

    def remaining(self, rows: DataFrame) -> DataFrame:
        """``rows`` without the records the pre-step dropped."""

    def routed(self) -> DataFrame | None:
        """Rows routed to the shard tasks with the operator's (``route_to_shards``' ``kept``)."""

    def dropped(self, rng: EpochRange) -> pa.Table | None:
        """The dropped records, for the operator's side output (None: not kept)."""

    def release(self) -> None:
        """Free what the run cached."""


class PreStep(Protocol):
    """A step between the valid rows and the operator that drops records against epoch
    N-1's state, in a job of its own (a deduplication's probe, when the shard tasks need
    W[N] before they start or the dropped records are written out: ``spark/dedup.py``)."""

    def run(self, rows: DataFrame, layout: ShardLayout, watermark: int | None, merge: ShardMerge) -> PreStepRun:
        """Run over the epoch's valid ``rows``, reading them all in a job before it returns:
        the side outputs observe the epoch's latest event time and its bad records on
        them (``EpochSideOutputs.observed_rows``). ``watermark``: the one the epoch starts from."""


# ``fill(out, rows, aggregate)``: a migration sets each accumulator's fields of the new
# records ``out`` from the old records ``rows`` (``checkpoint/migrate.py``)
FillRecords = Callable[[Any, Any, "ResolvedAggregate"], None]


@runtime_checkable
class MigratableOperator(Protocol):
    """An operator whose stored records a migration can rewrite (accumulators added,
    removed or renamed): each knows how its records wrap the aggregate's."""

    def migrate_records(self, old: StatefulOperator, values: list[bytes], fill: FillRecords) -> list[bytes]:
        """``values`` stored by ``old`` (the same kind of operator), as this one stores them."""
