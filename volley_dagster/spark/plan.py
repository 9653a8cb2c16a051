"""Planning one epoch on the driver: read the recorded range, apply the user's
transforms, key the rows and resolve the stateful operator against their schema.
Nothing runs until the stage (``spark/stage.py``) asks for results."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.dimensions.base import EnrichmentRead, TablePin
from volley_dagster.errors import ConfigError
from volley_dagster.operators.base import PreStep, SparkOperator, StatefulOperator
from volley_dagster.operators.dedup import Deduplicated, Deduplication, UniqueRecords
from volley_dagster.operators.event_time import EventTime
from volley_dagster.pipeline import Pipeline
from volley_dagster.sources.base import ColumnStatistics, NativeParquetFile
from volley_dagster.sources.offsets import EpochRange, Segment
from volley_dagster.spark.dedup import ProbeDuplicates
from volley_dagster.spark.enrich import EnrichmentRun, EpochJoins
from volley_dagster.spark.read import read_range


@dataclass
class PlannedEpoch:
    """The epoch's DataFrames, before anything runs."""

    raw: DataFrame  # the read (``EpochRead.raw``): error and raw text columns only when ``may_have_bad_records``
    keyed: DataFrame
    operator: SparkOperator
    key_kind: str
    may_have_bad_records: bool = True  # False: a native Parquet read, every record parsed
    enrichments: list[EnrichmentRun] = field(default_factory=list)
    dedup: Deduplication | None = None  # before an aggregate or window: ``keyed`` then has ``DEDUP_KEY``
    dedup_kind: str = "int"  # and its kind ("int" | "str")
    # per segment, what its file's footer says of the rows it touches, when they bound
    # ``keyed``'s columns: read natively and only filtered before the key (else empty:
    # ``spark/side_outputs.py``); ``files_as_read``: each segment and its file, when
    # ``keyed``'s rows are theirs as read (no transform), so their latest event time is
    # the epoch's
    footers: tuple[Mapping[str, ColumnStatistics], ...] = ()
    files_as_read: tuple[tuple[Segment, NativeParquetFile], ...] = ()

    @property
    def state_operator(self) -> StatefulOperator:
        """What the shard tasks run: the operator, after a deduplication also remembering its keys."""
        return self.operator if self.dedup is None else Deduplicated(self.operator, self.dedup, self.dedup_kind)

    @cached_property
    def pre_step(self) -> PreStep | None:
        """What runs between the valid rows and the operator, in a job of its own (a
        deduplication's probe, unless ``probes_in_stage``)."""
        return ProbeDuplicates(self.dedup) if self.dedup is not None and not self.probes_in_stage else None

    @property
    def probes_in_stage(self) -> bool:
        """A deduplication's probe runs in the state stage's own job (``spark/dedup.py``),
        its kept records going on to the operator: when nothing before the shard tasks
        needs W[N], which they learn from the probes (the operator after it has no event
        time), and the dropped records are not written out (``write_duplicates``)."""
        return self.dedup is not None and self.operator.event_time is None and not self.dedup.write_duplicates

    def enrichment_reads(self, ran: bool) -> dict[str, EnrichmentRead]:
        """Per enrichment: the version read and the records without a match (after the
        epoch's job; ``ran=False``: no job ran, nothing was read)."""
        return {run.enrichment.name: run.read(ran) for run in self.enrichments}

    @property
    def single_job(self) -> bool:
        """One Spark job does the epoch: nothing has to be known before the state stage
        (no parse errors to look for, no watermark to advance). Null keys are counted
        by the shard tasks, and only then looked up, in a second job."""
        return not self.may_have_bad_records and self.event_time is None

    @property
    def event_time(self) -> EventTime | None:
        """The event time the epoch advances a watermark on: the operator's, else a
        deduplication's before it (both on one column: ``Pipeline.validate``)."""
        if self.operator.event_time is not None:
            return self.operator.event_time
        return self.dedup.event_time if self.dedup is not None else None


def plan_epoch(spark: SparkSession, pipeline: Pipeline, rng: EpochRange, pins: dict[str, TablePin] | None = None,
               verified: frozenset[str] = frozenset()) -> PlannedEpoch:
    """``pins``: the version of each dimension table the epoch reads (None: as they are
    now, for a plan that never runs); ``verified``: tables whose pin was checked already."""
    source = pipeline.source_log
    schema = source.schema()
    reserved = [n for n in schema.names if n.startswith("_volley_") and n != columns.SOURCE]
    if reserved:
        raise ConfigError(f"source columns {reserved} use the engine's reserved prefix _volley_")
    read = read_range(spark, source, rng, schema)
    raw, parsed = read.raw, read.parsed
    if pins is None:  # planned to resolve the operator, never run: no key check either
        pins = {e.name: e.table.pin() for e in pipeline.enrichments}
        verified = frozenset(pins)
    joins = EpochJoins(spark, pins, verified, rng.epoch)
    transformed = pipeline.apply_transforms(parsed, joins)
    if pipeline.only_deduplicates:  # the key is the deduplication's
        assert pipeline.dedup is not None
        key, kind = pipeline.dedup.key_expr(transformed.schema)
        keyed = transformed.withColumn(columns.KEY, key)
        unique = UniqueRecords(pipeline.dedup).resolve(keyed.schema)
        return PlannedEpoch(raw, keyed, unique, kind, read.may_have_bad_records, joins.runs)
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
    dedup_kind = "int"
    if pipeline.dedup is not None:
        dedup_key, dedup_kind = pipeline.dedup.key_expr(keyed.schema)
        keyed = keyed.withColumn(columns.DEDUP_KEY, dedup_key)
    return PlannedEpoch(raw, keyed, operator, kind, read.may_have_bad_records, joins.runs, pipeline.dedup, dedup_kind,
                        read.footers if pipeline.only_filters else (), () if pipeline.transforms else read.files)
