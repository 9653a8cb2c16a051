"""Test helpers: pipelines over generated logs, and the reference each result is
checked against, computed straight from the source records with pyarrow/pandas."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster import (
    DeltaSink,
    DeltaTableSource,
    FileLog,
    ParquetSink,
    Pipeline,
    Source,
    count,
    first,
    last,
    max_,
    mean,
    min_,
    sum_,
)
from volley_dagster.demo.events import EVENT_SCHEMA, events_for_file


def log_records(files: int, records_per_file: int, keys: int, seed: int = 7, first_file: int = 0) -> pa.Table:
    """Exactly the records ``generate(...)`` writes, in log order."""
    return pa.concat_tables(
        events_for_file(i, records_per_file, keys, seed) for i in range(first_file, first_file + files)
    )


def payments(
    events: Path, output: Path, shards: int = 3, name: str = "payments", tables: Path | None = None, fmt: str = "parquet",
    on_foreign_lineage: str = "fail", source: Source | None = None, string_keys: bool = False,
) -> Pipeline:
    """Every accumulator kind over the payment events; with ``tables``, also a Delta
    table (upsert: the current state) and an Iceberg table (append: every epoch's output).
    ``fmt="json"`` reads a JSON-lines log (through the Python segment reader); ``source``
    replaces the log at ``events`` (a Kafka topic). ``string_keys``: merchant 12 is
    keyed as ``m-000012``."""
    pipeline = Pipeline(name).source(source or FileLog(events, format=fmt, schema=EVENT_SCHEMA if fmt == "json" else None))
    if string_keys:
        pipeline = pipeline.with_column("merchant_id", "format_string('m-%06d', merchant_id)")
    pipeline = (
        pipeline
        .where("status = 'active'")
        .key_by("merchant_id")
        .aggregate(
            total=sum_("amount"),
            events=count(),
            avg_amount=mean("amount"),
            smallest=min_("amount"),
            largest=max_("amount"),
            first_event=first("event_id"),
            last_seen=last("event_time"),
        )
        .sink(ParquetSink(output, on_foreign_lineage=on_foreign_lineage))
        .with_shards(shards)
    )
    return with_tables(pipeline, tables, delta_mode="upsert", iceberg_table="volley.payments",
                       on_foreign_lineage=on_foreign_lineage)


def channels(base: Path, shards: int = 3) -> Pipeline:
    """Two logs of payment events, ``web`` and ``store``, read as one stream."""
    return (
        Pipeline("channels")
        .sources({"web": FileLog(base / "web"), "store": FileLog(base / "store")}, source_column="channel")
        .where("status = 'active'")
        .key_by("merchant_id")
        .aggregate(total=sum_("amount"), events=count(), largest=max_("amount"))
        .sink(ParquetSink(base / "out", on_foreign_lineage="fail"))
        .with_shards(shards)
    )


def with_tables(pipeline: Pipeline, tables: Path | None, delta_mode: str, iceberg_table: str,
                on_foreign_lineage: str = "fail", iceberg_mode: str = "append") -> Pipeline:
    """``pipeline`` plus a Delta table (``delta_mode``) and an Iceberg table
    (``iceberg_mode``) under ``tables``; unchanged when ``tables`` is None."""
    if tables is None:
        return pipeline
    from volley_dagster.sinks.delta import DeltaSink
    from volley_dagster.sinks.iceberg import IcebergSink

    return pipeline.sink(DeltaSink(tables / "delta", mode=delta_mode, on_foreign_lineage=on_foreign_lineage)).sink(
        IcebergSink(iceberg_table, path=tables / "iceberg", mode=iceberg_mode, on_foreign_lineage=on_foreign_lineage)
    )


def velocity_pipeline(events: Path, output: Path | None = None, tables: Path | None = None,
                      processor: object | None = None, name: str = "velocity") -> Pipeline:
    """A team's own processor (``tests/processors.VelocityAlert``: three payments of a
    card within 10 s) over the demo's payments, cards = merchant_id % 17; with
    ``tables``, a Delta and an Iceberg append of its alerts (the kill -9 tests)."""
    from volley_dagster.demo.velocity import VelocityAlert
    from volley_dagster.sinks.delta import DeltaSink

    pipeline = (Pipeline(name).source(FileLog(events, format="parquet"))
                .with_column("card", "merchant_id % 17")
                .key_by("card")
                .process(processor or VelocityAlert(10_000, 3), output_schema=VelocityAlert.OUTPUT,
                         time_mode="EventTime", event_time="event_time", max_out_of_orderness="5 seconds",
                         input_columns=list(VELOCITY_INPUTS))
                .with_shards(3))
    if tables is None:
        assert output is not None
        return pipeline.sink(DeltaSink(str(output), name="alerts", mode="append"))
    return with_tables(pipeline, tables, delta_mode="append", iceberg_table="volley.alerts")


VELOCITY_INPUTS = ("card", "event_time", "amount")


def velocity_reference(files: list[Path], end_of_stream: bool = False) -> tuple[Any, list[tuple[Any, ...]], int]:
    """``velocity_pipeline``'s processor run record by record over ``files``, one epoch
    each (``tests/process_reference.py``): the reference, its rows (key first) and the late records."""
    from tests.process_reference import ProcessReference
    from volley_dagster.demo.velocity import VelocityAlert

    reference = ProcessReference(VelocityAlert(10_000, 3), "card", "event_time", ["alert_at_ms", "payments", "total"],
                                 5_000_000)
    rows: list[tuple[Any, ...]] = []
    late = 0
    for number, path in enumerate(files, start=1):
        out, late_records = reference.run(
            [{"card": r["merchant_id"] % 17, "amount": r["amount"],
              "event_time": int(r["event_time"].timestamp() * 1_000_000)} for r in pq.read_table(path).to_pylist()],
            end_of_stream=end_of_stream and number == len(files))
        rows += [(key, *(v.item() if hasattr(v, "item") else v for v in row)) for key, row in out]
        late += len(late_records)
    return reference, rows, late


def alert_rows(table: pa.Table) -> list[tuple[Any, ...]]:
    """A velocity sink's rows, sorted, as ``velocity_reference`` gives them."""
    return sorted(zip(*(table.column(c).to_pylist() for c in ("card", "alert_at_ms", "payments", "total")),
                      strict=True))


def merchants_table(keys: int, version: int) -> pa.Table:
    """A merchants dimension: every 7th merchant missing; version 1 doubles the fee
    rates and moves merchants to other regions."""
    ids = [m for m in range(keys) if m % 7 != 3]
    return pa.table({
        "merchant_id": pa.array(ids, pa.int64()),
        "fee_rate": pa.array([(m % 5 + 1) / 100 * (1 + version) for m in ids], pa.float64()),
        "region": pa.array([(m + version) % 4 for m in ids], pa.int64()),
    })


def enriched_payments(events: Path, output: Path, tables: Path | None = None, how: str = "inner",
                      dimension: object | None = None, shards: int = 3) -> Pipeline:
    """Payments enriched with the merchants Delta table at ``<events>/../merchants``: the
    fees per merchant (amount * fee_rate) and its latest region."""
    from volley_dagster import DeltaDimension

    pipeline = (
        Pipeline("payments_enriched")
        .source(FileLog(events, format="parquet"))
        .where("status = 'active'")
        .enrich(dimension or DeltaDimension(events.parent / "merchants", name="merchants"), on="merchant_id",
                columns=["fee_rate", "region"], how=how)
        .with_column("fee", "amount * fee_rate")
        .key_by("merchant_id")
        .aggregate(fees=sum_("fee"), events=count(), region=last("region"))
        .sink(ParquetSink(output))
        .with_shards(shards)
    )
    return with_tables(pipeline, tables, delta_mode="upsert", iceberg_table="volley.payments_enriched")


def reference_enriched(records: pa.Table, merchants: pa.Table, how: str = "inner") -> pd.DataFrame:
    """``enriched_payments``'s state over ``records`` joined with one ``merchants`` version."""
    df = records.to_pandas()
    df = df[df["status"] == "active"].merge(merchants.to_pandas(), on="merchant_id", how=how)
    df["fee"] = df["amount"] * df["fee_rate"]
    g = df.groupby("merchant_id", sort=True)
    return pd.DataFrame({"fees": g["fee"].sum(min_count=1), "events": g["amount"].size().astype("int64"),
                         "region": g["region"].last()}).reset_index()


def reference_state(records: pa.Table) -> pd.DataFrame:
    """The running aggregate of ``payments`` over ``records`` (in log order)."""
    df = records.to_pandas()
    df = df[df["status"] == "active"]
    g = df.groupby("merchant_id", sort=True)
    out = pd.DataFrame(
        {
            "total": g["amount"].sum(),
            "events": g["amount"].size().astype("int64"),
            "avg_amount": g["amount"].mean(),
            "smallest": g["amount"].min(),
            "largest": g["amount"].max(),
            "first_event": g["event_id"].first(),
            "last_seen": g["event_time"].last(),
        }
    ).reset_index()
    return out


def assert_state_equal(actual: pa.Table, expected: pd.DataFrame) -> None:
    got = actual.to_pandas().sort_values("merchant_id").reset_index(drop=True)
    exp = expected.sort_values("merchant_id").reset_index(drop=True)
    assert list(got.columns) == list(exp.columns)
    assert len(got) == len(exp), f"{len(got)} keys in state, {len(exp)} in the reference"
    pd.testing.assert_frame_equal(got, exp, check_dtype=False, check_exact=False, rtol=1e-9)


def tree_digest(root: Path) -> dict[str, str]:
    """SHA-256 of every file under ``root``, by relative path; a checkpoint root's
    ``compacted/`` aside: the background compactor writes its copies there after a
    commit, on its own time (``state/compacted.py``), and nothing names them."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        if Path(dirpath) == root and (root / "snapshots").is_dir() and "compacted" in dirs:
            dirs.remove("compacted")
        for name in files:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def read_sink(output: Path, pipeline: str = "payments") -> pd.DataFrame:
    tables = []
    for p in sorted((output / pipeline).glob("epoch-*.parquet")):
        t = pq.read_table(p)
        epoch = int(p.stem.split("-")[1])
        tables.append(t.to_pandas().assign(epoch=epoch))
    return pd.concat(tables, ignore_index=True)


def assert_epoch_outputs(outputs: pd.DataFrame, records: pa.Table, records_in: dict[int, int]) -> None:
    """Each epoch's sink output holds exactly its touched keys' state as of its end,
    once: no epoch missing, none duplicated."""
    assert sorted(outputs["epoch"].unique()) == sorted(records_in)
    consumed = 0
    for epoch in sorted(records_in):
        n = records_in[epoch]
        epoch_records = records.slice(consumed, n).to_pandas()
        touched = set(epoch_records[epoch_records["status"] == "active"]["merchant_id"])
        expected = reference_state(records.slice(0, consumed + n))
        expected = expected[expected["merchant_id"].isin(touched)].reset_index(drop=True)
        got = outputs[outputs["epoch"] == epoch].drop(columns="epoch").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, expected, check_dtype=False, rtol=1e-9)
        consumed += n


def payments_on_kafka(events: Path, output: Path, tables: Path | None = None, *, bootstrap_servers: str,
                      topic: str) -> Pipeline:
    """``payments`` reading the topic ``topic`` and also writing its output to the topic
    ``<topic>-totals`` (``KafkaSink``), beside the Parquet, Delta and Iceberg sinks."""
    from volley_dagster.sinks.kafka import KafkaSink
    from volley_dagster.sources.kafka import KafkaSource

    source = KafkaSource(topic, bootstrap_servers, EVENT_SCHEMA)
    return payments(events, output, tables=tables, source=source).sink(KafkaSink(f"{topic}-totals", bootstrap_servers))


# Spark's accumulators folded one value at a time (the references' rules): a null is
# skipped, a sum or a min/max is null until a key has seen a value, a sum with NaN is NaN,
# and Spark orders NaN above every number (a max is NaN when any value is, a min only
# when every one is).

def spark_sum(total: float | None, value: float | None) -> float | None:
    if value is None:
        return total
    return value if total is None else total + value


def spark_min(low: float | None, value: float | None) -> float | None:
    if value is None or (low is not None and (math.isnan(value) or value >= low)):
        return low
    return value


def spark_max(high: float | None, value: float | None) -> float | None:
    if value is None or (high is not None and (math.isnan(high) or value <= high)):
        return high
    return value


def same_value(got: Any, expected: Any) -> bool:
    """One value of the engine's output against the reference's: a null only equals a
    null, NaN only NaN, floats to a relative 1e-9 (sums folded in another order)."""
    if got is None or expected is None:
        return got is None and expected is None
    if isinstance(got, float) or isinstance(expected, float):
        got_f, expected_f = float(got), float(expected)
        if math.isnan(got_f) or math.isnan(expected_f):
            return math.isnan(got_f) and math.isnan(expected_f)
        return math.isclose(got_f, expected_f, rel_tol=1e-9, abs_tol=1e-8)
    return got == expected


def minute_totals(table: str | Path, output: Path) -> Pipeline:
    """A pipeline fed by another: each merchant's running totals over the rows the
    merchant-minutes windows appended to their Delta ``table``, upserted into Delta at ``output``."""
    return (Pipeline("minute_totals").source(DeltaTableSource(table)).key_by("merchant_id")
            .aggregate(minutes=count(), events=sum_("events"), largest=max_("largest"))
            .sink(DeltaSink(output, name="totals", mode="upsert")).with_shards(3))


def minute_totals_reference(table: str | Path) -> pd.DataFrame:
    """Those totals straight from the table's rows."""
    from deltalake import DeltaTable

    rows = pd.DataFrame(DeltaTable(str(table)).to_pyarrow_table().to_pydict())
    totals = rows.groupby("merchant_id").agg(minutes=("events", "size"), events=("events", "sum"),
                                             largest=("largest", "max"))
    return totals.reset_index().sort_values("merchant_id").reset_index(drop=True)
