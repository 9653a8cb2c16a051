"""Dimension tables an enrichment joins, and the version of each an epoch reads.

Spark's stream-static join reads whatever version is current when a batch runs, so a
replayed batch can join other rows. Here the version is *pinned*: recorded in the
epoch's directory (``EpochLog.record_dimension_pin``) when the epoch is cut, or by
its first attempt if the pipeline gained the enrichment later, and every attempt
reads exactly that version. The next epoch pins the table's newest version.

A table says how to name its current version without Spark (the sensor cuts epochs)
and how to read one pinned version into Spark (``spark/enrich.py`` joins it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_schema

from volley_dagster.errors import ConfigError, DimensionPinRejectedError
from volley_dagster.json_records import JsonObject

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

How = Literal["left", "inner"]


@dataclass(frozen=True)
class PinnedFile:
    path: str
    size: int
    version: str  # the file's write (mtime and inode, or ETag)


@dataclass(frozen=True)
class TablePin:
    """What one epoch reads of one dimension table: a Delta version, an Iceberg
    snapshot id, or a Parquet directory's files as they were."""

    table: str  # the enrichment's name
    kind: str  # "delta" | "iceberg" | "parquet"
    version: str
    files: tuple[PinnedFile, ...] = ()  # Parquet only

    def to_dict(self) -> JsonObject:
        return {"table": self.table, "kind": self.kind, "version": self.version,
                "files": [asdict(f) for f in self.files]}

    @classmethod
    def from_dict(cls, d: JsonObject) -> TablePin:
        return cls(d["table"], d["kind"], str(d["version"]), tuple(PinnedFile(**f) for f in d.get("files", [])))


@dataclass(frozen=True)
class EnrichmentRead:
    """What one epoch's enrichment read of its table: the pinned version, how it joined,
    its records, those without a match, and those an inner join dropped."""

    kind: str
    version: str
    how: str
    on: tuple[str, ...]
    records: int = 0
    unmatched: int = 0
    dropped: int = 0

    def same_pin(self, pin: TablePin, on: tuple[str, ...]) -> bool:
        """Read at ``pin`` on the key ``on``: a table's keys checked unique there still are."""
        return (self.version, self.kind, self.on) == (pin.version, pin.kind, tuple(on))

    def to_dict(self) -> JsonObject:
        return {**asdict(self), "on": list(self.on)}

    @classmethod
    def from_dict(cls, d: JsonObject) -> EnrichmentRead:
        return cls(d["kind"], str(d["version"]), d.get("how", "left"), tuple(d.get("on", ())), d.get("records", 0),
                   d.get("unmatched", 0), d.get("dropped", 0))


class DimensionTable(ABC):
    """A table whose rows enrich records by key. Pickled into nothing: only the driver
    pins and reads it (Spark reads its files where it can)."""

    name: str
    kind: str
    uri: str

    @abstractmethod
    def pin(self) -> TablePin:
        """The table's current version (no Spark): what the next epoch reads."""

    @abstractmethod
    def read(self, spark: SparkSession, pin: TablePin, columns: list[str]) -> DataFrame:
        """Exactly the pinned version's ``columns``; ``DimensionVersionLostError`` when it
        is gone, ``DimensionPinRejectedError`` when it lacks a column."""

    def verify(self, pin: TablePin) -> None:
        """After the epoch's job read it (lazily): still the pinned version. Delta and
        Iceberg versions never change; a Parquet file can be rewritten in place."""
        return None

    def _read_files(self, spark: SparkSession, pin: TablePin, paths: list[str], schema: pa.Schema,
                    columns: list[str]) -> DataFrame:
        """Spark reads the version's local Parquet files itself, in parallel, with the
        version's schema (a file written before a column was added reads it as null)."""
        self._lacks(pin, columns, schema.names)
        wanted = pa.schema([schema.field(c) for c in columns])
        return spark.read.schema(from_arrow_schema(wanted)).parquet(*paths)

    def _lacks(self, pin: TablePin, columns: list[str], present: list[str]) -> None:
        missing = [c for c in columns if c not in present]
        if missing:
            raise DimensionPinRejectedError(
                f"dimension table {self.name!r} ({self.uri}) version {pin.version} has no column {missing} (it has "
                f"{present}). Nothing was committed and the pin is set aside: add the column to the table (or fix "
                "enrich(columns=...)), and the next attempt reads its version then",
                self.name, pin.version,
            )

    def describe(self) -> JsonObject:
        return {"kind": self.kind, "uri": self.uri}


@dataclass(frozen=True)
class Enrichment:
    """``Pipeline.enrich(table, on=..., columns=[...], how=...)``: one step among the
    pipeline's transforms. ``how="inner"`` drops a record whose key the table lacks;
    ``"left"`` keeps it with null columns. Both are counted per epoch."""

    table: DimensionTable
    on: tuple[str, ...]
    columns: tuple[str, ...]
    how: How = "left"
    broadcast: bool | None = field(default=None)  # None: Spark decides by the table's size

    def __post_init__(self) -> None:
        if self.how not in ("left", "inner"):
            raise ConfigError(f"enrich(..., how={self.how!r}): use 'left' or 'inner'")
        if not self.on:
            raise ConfigError(f"enrich({self.table.name!r}): name the join key with on=")
        if not self.columns:
            raise ConfigError(f"enrich({self.table.name!r}): name the table's columns to add with columns=[...]")
        if set(self.on) & set(self.columns):
            raise ConfigError(f"enrich({self.table.name!r}): the join key {list(self.on)} is not a column to add")

    @property
    def name(self) -> str:
        return self.table.name
