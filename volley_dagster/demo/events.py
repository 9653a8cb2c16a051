"""A deterministic generator of payment events, appended to a file log.

File ``i`` depends only on (seed, i), so generating 10 files at once or one at
a time (as a live source would) gives the same records.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from volley_dagster.sources.storage import Storage, storage_for

EVENT_SCHEMA = pa.schema(
    [
        pa.field("event_id", pa.int64()),
        pa.field("merchant_id", pa.int64()),
        pa.field("amount", pa.float64()),
        pa.field("status", pa.string()),
        pa.field("event_time", pa.timestamp("us", tz="UTC")),
    ]
)
STATUSES = np.array(["active", "refunded", "failed"])
START_US = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z


def events_for_file(
    index: int,
    records: int,
    keys: int,
    seed: int = 7,
    zipf: float | None = None,
    disorder_s: float = 30.0,
    events_per_second: float = 1000.0,
) -> pa.Table:
    """Records of file ``index``: ids continue across files, event time grows with
    bounded out-of-orderness (``disorder_s``)."""
    rng = np.random.default_rng([seed, index])
    ids = index * records + np.arange(records, dtype=np.int64)
    if zipf:
        merchants = (rng.zipf(zipf, records) - 1) % keys
    else:
        merchants = rng.integers(0, keys, records)
    amount = np.round(rng.uniform(1, 500, records), 2)
    status = STATUSES[rng.choice(3, records, p=[0.8, 0.1, 0.1])]
    jitter = rng.uniform(0, disorder_s * 1e6, records).astype(np.int64)
    event_time = START_US + (ids * (1e6 / events_per_second)).astype(np.int64) - jitter
    return pa.table(
        [
            pa.array(ids),
            pa.array(merchants.astype(np.int64)),
            pa.array(amount),
            pa.array(status),
            pa.array(event_time, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        ],
        schema=EVENT_SCHEMA,
    )


def write_events(storage: Storage, name: str, table: pa.Table, fmt: str = "parquet") -> None:
    if fmt == "parquet":
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=128 * 1024)
        data = buf.getvalue()
    else:
        rows = table.to_pylist()  # demo/test data only
        data = "".join(
            json.dumps({**r, "event_time": r["event_time"].isoformat()}) + "\n" for r in rows
        ).encode()
    storage.write(name, data)


def generate(
    uri: str | Path,
    files: int,
    records_per_file: int,
    keys: int,
    *,
    first_file: int = 0,
    seed: int = 7,
    zipf: float | None = None,
    fmt: str = "parquet",
    partitions: int = 0,
    storage_options: dict | None = None,
    disorder_s: float = 30.0,
    events_per_second: float = 1000.0,
) -> list[str]:
    """Append ``files`` files to the log at ``uri`` (spread over ``partitions``
    sub-folders when > 0); returns their paths."""
    storage = storage_for(uri, storage_options)
    suffix = ".parquet" if fmt == "parquet" else ".jsonl"
    written = []
    for i in range(first_file, first_file + files):
        folder = f"p{i % partitions}/" if partitions else ""
        name = f"{folder}events-{i:06d}{suffix}"
        write_events(storage, name, events_for_file(i, records_per_file, keys, seed, zipf, disorder_s, events_per_second), fmt)
        written.append(name)
    return written
