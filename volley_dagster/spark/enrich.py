"""Joining an epoch's records with the dimension tables it pinned (``dimensions/``).

One left join per enrichment, observed in the epoch's own Spark job (``Observation``:
no extra job) to count the records without a match; ``how="inner"`` then drops them.
A table must hold one row per key, or a join would repeat records: each pinned
version is checked once, by the first epoch that reads it (one small Spark job).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from pyspark.sql import DataFrame, Observation, SparkSession
from pyspark.sql import functions as F

from volley_dagster.dimensions.base import Enrichment, EnrichmentRead, TablePin
from volley_dagster.errors import ConfigError, DuplicateDimensionKeyError

MATCHED = "_volley_matched"


@dataclass
class EnrichmentRun:
    """One enrichment in one epoch's plan: the version it reads and what it counted."""

    enrichment: Enrichment
    pin: TablePin
    observation: Observation

    def read(self, ran: bool) -> EnrichmentRead:
        """After the epoch's Spark job (``ran``; an epoch without a job read nothing)."""
        seen = self.observation.get if ran else {}
        records, unmatched = int(seen.get("records") or 0), int(seen.get("unmatched") or 0)
        return EnrichmentRead(self.pin.kind, self.pin.version, self.enrichment.how, tuple(self.enrichment.on),
                              records, unmatched, unmatched if self.enrichment.how == "inner" else 0)


class EpochJoins:
    """``Pipeline.apply_transforms``'s ``join``: each enrichment at its pinned version.
    ``verified``: tables whose pin a committed epoch already read (their keys were checked)."""

    def __init__(self, spark: SparkSession, pins: dict[str, TablePin], verified: frozenset[str], epoch: int) -> None:
        self.spark, self.pins, self.verified, self.epoch = spark, pins, verified, epoch
        self.runs: list[EnrichmentRun] = []

    def __call__(self, df: DataFrame, step: Enrichment) -> DataFrame:
        pin = self.pins[step.name]
        missing = [c for c in step.on if c not in df.columns]
        if missing:
            raise ConfigError(f"enrich({step.name!r}): join key {missing} is not among the record's columns {df.columns}")
        clash = [c for c in step.columns if c in df.columns]
        if clash:
            raise ConfigError(f"enrich({step.name!r}): the records already have columns {clash}; rename them first")
        dim = step.table.read(self.spark, pin, list(step.on) + list(step.columns))
        if step.name not in self.verified:
            self._check_unique(dim, step, pin)
        dim = dim.withColumn(MATCHED, F.lit(True))
        if step.broadcast is True:
            dim = F.broadcast(dim)
        elif step.broadcast is False:
            dim = dim.hint("shuffle_hash")
        observation = Observation(f"volley_enrich_{uuid.uuid4().hex[:8]}")
        joined = df.join(dim, on=list(step.on), how="left").observe(
            observation,
            F.count(F.lit(1)).alias("records"),
            F.sum(F.when(F.col(MATCHED).isNull(), 1).otherwise(0)).alias("unmatched"),
        )
        if step.how == "inner":
            joined = joined.where(F.col(MATCHED).isNotNull())
        self.runs.append(EnrichmentRun(step, pin, observation))
        return joined.drop(MATCHED)

    def _check_unique(self, dim: DataFrame, step: Enrichment, pin: TablePin) -> None:
        keyed = dim.where(" AND ".join(f"`{c}` IS NOT NULL" for c in step.on))  # a null key never matches
        repeated = keyed.groupBy(*step.on).count().where(F.col("count") > 1).limit(5).collect()
        if repeated:
            shown = [tuple(r[c] for c in step.on) for r in repeated]
            raise DuplicateDimensionKeyError(
                f"epoch {self.epoch}: dimension table {step.name!r} ({step.table.uri}) version {pin.version} holds "
                f"key(s) {list(step.on)} on several rows, e.g. {shown}, so a join would repeat records. Nothing was "
                "committed and the pin is set aside: make the key unique in the table, and the next attempt reads "
                "its version then",
                step.name, pin.version,
            )
