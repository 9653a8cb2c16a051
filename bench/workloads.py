"""The side-by-side benchmark's workloads: their event logs, our pipelines for them,
and references computed straight from the files, so a fast wrong answer cannot pass.

A  running total and count per merchant of active events, upserted to Delta
As A over the same events with the merchant stored as a string (``m-000123``)
B  1-minute tumbling windows per merchant over all events, 30 s watermark, appended to Delta
C  state-size scaling: a state of N keys built by one epoch, then epochs that each
   touch 100k keys (changed rows appended to Delta); run for a large and a small N
D  the floor: a stateless Spark batch groupBy over the same epoch's files
DB B's floor: a stateless Spark groupBy(merchant, window) of the same epoch's file
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from volley_dagster import DeltaSink, FileLog, Pipeline, count, max_, sum_, tumbling
from volley_dagster.demo.events import EVENT_SCHEMA, START_US, generate, write_events
from volley_dagster.sources.storage import storage_for

WINDOW_US = 60_000_000
WATERMARK_DELAY_US = 30_000_000


@dataclass(frozen=True)
class Workload:
    name: str
    events: Path  # the log: one file per epoch
    files: tuple[str, ...]
    shards: int

    def records(self, index: int) -> int:
        """Records in file ``index`` (one epoch), from the Parquet footer."""
        return pq.ParquetFile(self.events / self.files[index]).metadata.num_rows

    def pipeline(self, tables: Path) -> Pipeline:
        """Our engine's pipeline for this workload, its one sink under ``tables``."""
        base = Pipeline(f"bench_{self.name.lower()}").source(FileLog(self.events, format="parquet"))
        if self.name == "B":
            return (
                base.key_by("merchant_id")
                .window(tumbling("1 minute"), on="event_time", max_out_of_orderness="30 seconds")
                .aggregate(events=count(), total=sum_("amount"), largest=max_("amount"))
                .sink(DeltaSink(tables / "delta", mode="append"))
                .with_shards(self.shards)
            )
        mode = "append" if self.name == "C" else "upsert"  # C: the changed keys, so the sink follows them too
        return (
            base.where("status = 'active'")
            .key_by("merchant_id")
            .aggregate(total=sum_("amount"), events=count())
            .sink(DeltaSink(tables / "delta", mode=mode))
            .with_shards(self.shards)
        )


def event_log(events: Path, epochs: int, records: int, keys: int, zipf: float | None) -> tuple[str, ...]:
    """A and B (and D): the demo generator's seeded log, one file per epoch."""
    if events.exists():
        return tuple(sorted(p.name for p in events.glob("*.parquet")))
    return tuple(generate(events, epochs, records // epochs, keys, zipf=zipf))


def string_key_log(events: Path, ints: Path, files: tuple[str, ...]) -> tuple[str, ...]:
    """As: the events of ``ints``, each file rewritten with merchant 123 as ``"m-000123"``."""
    events.mkdir(parents=True, exist_ok=True)
    for name in files:
        if not (events / name).exists():
            table = pq.read_table(ints / name)
            digits = pc.utf8_lpad(pc.cast(table.column("merchant_id"), pa.string()), 6, "0")
            keyed = pc.binary_join_element_wise(pa.scalar("m-"), digits, pa.scalar(""))
            pq.write_table(table.set_column(table.schema.get_field_index("merchant_id"), "merchant_id", keyed),
                           events / name)
    return files


def scaling_log(events: Path, state_keys: int, touched: int, epochs: int, seed: int = 11) -> tuple[str, ...]:
    """C: file 0 holds one active event for each of ``state_keys`` keys; each later file
    touches ``touched`` distinct keys drawn from them."""
    if events.exists():
        return tuple(sorted(p.name for p in events.glob("*.parquet")))
    storage = storage_for(events)
    rng = np.random.default_rng(seed)
    names, first_id = [], 0
    for i in range(epochs + 1):
        keys = np.arange(state_keys, dtype=np.int64) if i == 0 else np.sort(
            rng.choice(state_keys, touched, replace=False)).astype(np.int64)
        n = len(keys)
        ids = first_id + np.arange(n, dtype=np.int64)
        first_id += n
        table = pa.table([
            pa.array(ids), pa.array(keys), pa.array(np.round(rng.uniform(1, 500, n), 2)),
            pa.array(np.full(n, "active")),
            pa.array(START_US + i * 1_000_000 + np.arange(n, dtype=np.int64), pa.int64()).cast(
                pa.timestamp("us", tz="UTC")),
        ], schema=EVENT_SCHEMA)
        name = f"events-{i:06d}.parquet"
        write_events(storage, name, table)
        names.append(name)
    return tuple(names)


def _read(events: Path, files: tuple[str, ...], active_only: bool) -> pa.Table:
    table = pa.concat_tables(pq.read_table(events / f, columns=["merchant_id", "amount", "status", "event_time"])
                             for f in files)
    return table.filter(pc.equal(table.column("status"), "active")) if active_only else table


def reference_totals(events: Path, files: tuple[str, ...]) -> pa.Table:
    """A and C: (merchant_id, total, events) over every active event."""
    grouped = _read(events, files, active_only=True).group_by("merchant_id").aggregate([("amount", "sum"), ("amount", "count")])
    return grouped.rename_columns(["merchant_id", "total", "events"]).sort_by("merchant_id")


def reference_windows(events: Path, files: tuple[str, ...]) -> pa.Table:
    """B: every window that ends at or before the final watermark (latest event time
    - 30 s), from all its records: (merchant_id, window_start µs, events, total, largest).
    The generator's disorder equals the watermark delay, so no record is late."""
    active = _read(events, files, active_only=False)
    t = active.column("event_time").cast(pa.int64()).to_numpy()
    watermark = int(t.max()) - WATERMARK_DELAY_US
    start = t - t % WINDOW_US
    table = pa.table({"merchant_id": active.column("merchant_id"), "window_start": start,
                      "amount": active.column("amount")})
    grouped = table.group_by(["merchant_id", "window_start"]).aggregate(
        [("amount", "count"), ("amount", "sum"), ("amount", "max")])
    grouped = grouped.filter(pc.less_equal(pc.add(grouped.column("window_start"), WINDOW_US), watermark))
    return grouped.rename_columns(["merchant_id", "window_start", "events", "total", "largest"]).sort_by(
        [("merchant_id", "ascending"), ("window_start", "ascending")])


def check_table(workload: str, got: pa.Table, expected: pa.Table) -> str:
    """``"ok"`` or what differs. ``got`` is an engine's Delta table."""
    if workload == "B":
        got = got.select(["merchant_id", "window_start", "events", "total", "largest"])
        got = got.set_column(1, "window_start", got.column("window_start").cast(pa.int64()))
        keys = ["merchant_id", "window_start"]
    elif workload == "C":  # an append changelog: a key's latest row has its highest count
        got = got.select(["merchant_id", "total", "events"])
        got = got.take(_latest_per_key(got.column("merchant_id").to_numpy(), got.column("events").to_numpy()))
        keys = ["merchant_id"]
    else:
        got, keys = got.select(["merchant_id", "total", "events"]), ["merchant_id"]
        if workload == "As":
            got = got.set_column(0, "merchant_id", pc.cast(pc.utf8_slice_codeunits(got.column(0), 2), pa.int64()))
    got = got.sort_by([(k, "ascending") for k in keys])
    if got.num_rows != expected.num_rows:
        return f"{got.num_rows:,} rows, expected {expected.num_rows:,}"
    for name in expected.column_names:
        a = got.column(name).to_numpy().astype(np.float64)
        b = expected.column(name).to_numpy().astype(np.float64)
        bad = ~np.isclose(a, b, rtol=1e-9, atol=1e-6)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            return f"{int(bad.sum()):,} rows differ in {name!r}, e.g. row {i}: {a[i]} != {b[i]}"
    return "ok"


def _latest_per_key(keys: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Row indices of each key's row with the highest count (counts only grow)."""
    order = np.lexsort((counts, keys))
    last = np.ones(len(keys), dtype=bool)
    last[:-1] = keys[order][1:] != keys[order][:-1]
    return order[last]
