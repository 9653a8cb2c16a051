"""The reference of a pipeline fed by another: the refunds per merchant per hour
(``demo/merchant_refunds.py``) are the window reference (``tests/window_reference.py``)
fed exactly the rows each of its epochs recorded of the refunds join's Iceberg
changelog, read straight from the data files its ranges name; and those rows are
every row of the changelog, each once."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from tests.window_reference import reference_epochs
from volley_dagster import EpochRunner
from volley_dagster.demo.merchant_refunds import REFUND_CHANGES
from volley_dagster.deploy import TableSettings
from volley_dagster.operators.event_time import duration_us
from volley_dagster.operators.window import tumbling
from volley_dagster.sinks.iceberg import open_catalog

_AS_EVENTS = [("merchant_id", pa.int64()), ("event_time", pa.timestamp("us", "UTC")), ("amount", pa.float64()),
              ("event_id", pa.int64()), ("status", pa.string()), ("file", pa.string()), ("offset", pa.int64())]


def recorded_rows(runner: EpochRunner, epoch: int) -> pa.Table | None:
    """The rows epoch ``epoch`` recorded, in log order, read straight from the data
    files its segments name, with ``file`` and ``offset``."""
    parts = []
    for seg in runner.log.offsets(epoch).segments:
        rows = pq.read_table(seg.file.removeprefix("file://")).slice(seg.start, seg.records)
        parts.append(rows.append_column("file", pa.array([seg.file] * rows.num_rows))
                     .append_column("offset", pa.array(range(seg.start, seg.end), pa.int64())))
    return pa.concat_tables(parts, promote_options="default") if parts else None


def _as_events(rows: pa.Table | None) -> pa.Table:
    """Changelog rows as the window reference reads events: a refund at its time, a
    payment never refunded as a record the pipeline filters out."""
    if rows is None:
        return pa.table({name: pa.array([], kind) for name, kind in _AS_EVENTS})
    return pa.table({"merchant_id": rows.column("merchant_id"), "event_time": rows.column("refunded_at"),
                     "amount": rows.column("refund_amount"), "event_id": rows.column("payment_id"),
                     "status": pc.if_else(rows.column("refund_amount").is_null(), "failed", "ok"),
                     "file": rows.column("file"), "offset": rows.column("offset")})


def assert_hourly_refunds_equal_reference(downstream: EpochRunner, tables: TableSettings,
                                          end_of_stream: bool) -> int:
    """The checks above on every committed epoch; returns the hours compared."""
    epochs = [recorded_rows(downstream, e) for e in range(1, downstream.committed_epoch() + 1)]
    changelog = open_catalog("volley", tables.iceberg_catalog).load_table(REFUND_CHANGES).scan().to_arrow()
    read = pa.concat_tables([e for e in epochs if e is not None], promote_options="default")
    key = ["payment_id", "payments_row", "refunds_row"]
    assert sorted(zip(*(read.column(c).to_pylist() for c in key), strict=True)) == \
        sorted(zip(*(changelog.column(c).to_pylist() for c in key), strict=True)), "rows read twice or never"
    ref = reference_epochs([_as_events(e) for e in epochs], tumbling("1 hour"), duration_us("1 minute", "delay"), 0,
                           end_of_stream=end_of_stream)
    expected = sorted(row[:6] for rows in ref.fired.values() for row in rows)
    hours = DeltaTable(f"{tables.warehouse}/delta/merchant_refund_hours").to_pyarrow_table().to_pandas()
    got = sorted((r.merchant_id, int(r.window_start.value // 1000), int(r.window_end.value // 1000), r.refunds,
                  round(r.refunded, 6), r.largest) for r in hours.itertuples())
    assert got == expected
    return len(got)
