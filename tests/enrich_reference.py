"""The enrichment join's reference: ``Pipeline.enrich``'s rule
(``volley_dagster/spark/enrich.py``) applied in plain Python, record by record in log
order, then the plain running aggregate (``TtlReference``) of what the join kept.

The rule: each record is joined with the dimension version its epoch pinned on the
join key; a null key matches nothing (nor a row of the table with a null key); a
record without a match keeps nulls in the table's columns (``how="left"``) or is
dropped (``"inner"``); both count it as unmatched, ``inner`` also as dropped."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tests.ttl_reference import KEY, TtlReference, value_accumulators
from volley_dagster import DeltaDimension, FileLog, Pipeline, last

DIMENSION = "merchants"
COLUMNS = ["fee_rate", "region"]  # what the join adds


def enrich_pipeline(events: Path, dimension: Path, how: str, name: str = "enriched") -> Pipeline:
    """The log enriched with the Delta table ``dimension`` on ``merchant_id``: the
    amount becomes the merchant's fee (``amount * fee_rate``), aggregated as
    ``value_accumulators``, and the merchant's latest region."""
    return (
        Pipeline(name)
        .source(FileLog(events, format="parquet"))
        .enrich(DeltaDimension(dimension, name=DIMENSION), on=KEY, columns=COLUMNS, how=how)
        .with_column("amount", "amount * fee_rate")
        .key_by(KEY)
        .aggregate(**value_accumulators("amount"), region=last("region"))
        .with_shards(2)
    )


def lookup(dimension: pa.Table) -> dict[object, dict[str, Any]]:
    """One version of the table by key; its rows with a null key match nothing."""
    return {row[KEY]: row for row in dimension.to_pylist() if row[KEY] is not None}


def fee(amount: float | None, fee_rate: float | None) -> float | None:
    """``amount * fee_rate`` as Spark computes it: null when either is (NaN and
    infinities as IEEE doubles: inf * 0 is NaN)."""
    return None if amount is None or fee_rate is None else amount * fee_rate


@dataclass
class EnrichReference:
    """``enrich_pipeline``'s reference: ``run_rows`` per epoch, with the version it pinned."""

    how: str
    aggregate: TtlReference = field(default_factory=TtlReference)
    regions: dict[object, Any] = field(default_factory=dict)  # key -> last non-null region

    def run_rows(self, records: pa.Table, dimension: pa.Table) -> tuple[dict[object, dict[str, Any]], dict[str, int]]:
        """One epoch: its output rows by key (``VALUES`` and ``region``), and the
        enrichment's figures (records, unmatched, dropped). The epoch's dead letters
        (rows of ``records``) are ``self.dead_letters[-1]``."""
        table = lookup(dimension)
        kept: list[int] = []
        amounts: list[float | None] = []
        unmatched = 0
        for row, (key, amount) in enumerate(zip(records.column(KEY).to_pylist(),
                                                records.column("amount").to_pylist(), strict=True)):
            match = table.get(key) if key is not None else None
            unmatched += match is None
            if match is None and self.how == "inner":
                continue
            kept.append(row)
            amounts.append(fee(amount, None if match is None else match["fee_rate"]))
            if key is not None and match is not None and match["region"] is not None:
                self.regions[key] = match["region"]
        joined = records.take(pa.array(kept, pa.int64()))
        joined = joined.set_column(joined.schema.get_field_index("amount"), "amount", pa.array(amounts, pa.float64()))
        rows = self.aggregate.run_rows(joined)
        self.aggregate.dead_letters[-1] = [kept[i] for i in self.aggregate.dead_letters[-1]]
        figures = {"records": records.num_rows, "unmatched": unmatched,
                   "dropped": unmatched if self.how == "inner" else 0}
        return {key: {**values, "region": self.regions.get(key)} for key, values in rows.items()}, figures

    @property
    def dead_letters(self) -> list[list[int]]:
        """Per epoch: the rows of its records that were bad records (a null key the join kept)."""
        return self.aggregate.dead_letters

    @property
    def state(self) -> dict[object, dict[str, Any]]:
        """Every key's aggregates after the epochs so far."""
        return {key: {**values, "region": self.regions.get(key)} for key, values in self.aggregate.state.items()}
