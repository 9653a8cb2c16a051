"""Two deterministic logs for the join demo: payments, and the refunds of some of them.

File ``i`` of each log covers the same 10 minutes of event time and depends only on
(seed, i), so writing 10 files at once or one at a time gives the same records:

- payments: ``per_file`` payments, ids ``i * per_file ...``, paid at times spread over
  the file's span with up to 30 s of disorder;
- refunds: a fifth of the payments of the last few files are refunded, 0-40 minutes
  after they were paid (those past 30 minutes match nothing under the demo's bound),
  in the file whose span holds the refund's time; plus a few refunds of payments that
  never existed, and a few dated two files back: late records when the join's
  watermark has passed them by the epoch that reads them (it does when files land
  one at a time; a backlog read at once lets them join).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from volley_dagster import FileLog, Pipeline
from volley_dagster.demo.events import START_US, write_events
from volley_dagster.demo.payments import demo_deployment
from volley_dagster.deploy import Deployment, TableSettings
from volley_dagster.operators.join import JoinHow
from volley_dagster.sinks import DeltaSink, IcebergSink
from volley_dagster.sources.storage import storage_for

PAYMENT_SCHEMA = pa.schema([pa.field("payment_id", pa.int64()), pa.field("merchant_id", pa.int64()),
                            pa.field("amount", pa.float64()), pa.field("paid_at", pa.timestamp("us", tz="UTC"))])
REFUND_SCHEMA = pa.schema([pa.field("payment_id", pa.int64()), pa.field("refund_amount", pa.float64()),
                           pa.field("refunded_at", pa.timestamp("us", tz="UTC"))])
FILE_SPAN_US = 10 * 60 * 1_000_000
_MAX_DELAY_US = 40 * 60 * 1_000_000
_LOOKBACK = _MAX_DELAY_US // FILE_SPAN_US + 1  # files whose payments may be refunded in a later file


def payments_file(index: int, per_file: int, merchants: int = 100, seed: int = 11) -> pa.Table:
    rng = np.random.default_rng([seed, index])
    paid = START_US + index * FILE_SPAN_US + np.sort(rng.integers(0, FILE_SPAN_US, per_file))
    paid -= rng.integers(0, 30_000_000, per_file) * (rng.random(per_file) < 0.1)  # a little disorder
    return pa.table([pa.array(index * per_file + np.arange(per_file, dtype=np.int64)),
                     pa.array(rng.integers(0, merchants, per_file).astype(np.int64)),
                     pa.array(np.round(rng.uniform(1, 500, per_file), 2)),
                     pa.array(paid).cast(PAYMENT_SCHEMA.field("paid_at").type)], schema=PAYMENT_SCHEMA)


def _refunds_of(index: int, per_file: int, merchants: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The refunds of file ``index``'s payments: payment id, amount, time (any file's)."""
    payments = payments_file(index, per_file, merchants, seed)
    rng = np.random.default_rng([seed, index, 1])
    chosen = np.flatnonzero(rng.random(per_file) < 0.2)
    paid = payments.column("paid_at").cast(pa.int64()).to_numpy()[chosen]
    amount = payments.column("amount").to_numpy()[chosen] * rng.uniform(0.1, 1.0, len(chosen))
    return (payments.column("payment_id").to_numpy()[chosen], np.round(amount, 2),
            paid + rng.integers(0, _MAX_DELAY_US, len(chosen)))


def refunds_file(index: int, per_file: int, merchants: int = 100, seed: int = 11) -> pa.Table:
    ids, amounts, times = [], [], []
    for source in range(max(0, index - _LOOKBACK), index + 1):
        pid, amount, at = _refunds_of(source, per_file, merchants, seed)
        here = (at - START_US) // FILE_SPAN_US == index
        ids.append(pid[here])
        amounts.append(amount[here])
        times.append(at[here])
    rng = np.random.default_rng([seed, index, 2])
    strays = max(1, per_file // 200)  # refunds of payments that never existed
    ids.append(-1 - index * per_file - np.arange(strays, dtype=np.int64))
    amounts.append(np.full(strays, 9.99))
    times.append(START_US + index * FILE_SPAN_US + rng.integers(0, FILE_SPAN_US, strays))
    if index >= 2:  # dated two files back: before the watermark by now, late
        late = max(1, per_file // 500)
        ids.append((index - 2) * per_file + np.arange(late, dtype=np.int64))
        amounts.append(np.full(late, 1.0))
        times.append(np.full(late, START_US + (index - 2) * FILE_SPAN_US))
    order = np.argsort(np.concatenate(times), kind="stable")
    return pa.table([pa.array(np.concatenate(ids)[order]), pa.array(np.concatenate(amounts)[order]),
                     pa.array(np.concatenate(times)[order]).cast(REFUND_SCHEMA.field("refunded_at").type)],
                    schema=REFUND_SCHEMA)


def write_refund_logs(root: str | Path, files: int, per_file: int, merchants: int = 100, first_file: int = 0,
                      seed: int = 11) -> None:
    """Files ``first_file ...`` of both logs, under ``root/payments`` and ``root/refunds``."""
    for name, make in (("payments", payments_file), ("refunds", refunds_file)):
        storage = storage_for(f"{str(root).rstrip('/')}/{name}")
        for index in range(first_file, first_file + files):
            write_events(storage, f"{name}-{index:06d}.parquet", make(index, per_file, merchants, seed))


def refunds_join(root: str | Path, how: JoinHow = "left", max_state_rows: int | None = None,
                 name: str = "refunds") -> Pipeline:
    """Each payment with its refunds within 30 minutes; with ``how="left"``, a payment
    never refunded in that time once, with null refund columns, once the watermark has
    passed it."""
    base = str(root).rstrip("/")
    return (
        Pipeline(name)
        .sources({"payments": FileLog(f"{base}/payments", format="parquet"),
                  "refunds": FileLog(f"{base}/refunds", format="parquet")})
        .join(left="payments", right="refunds", on="payment_id", left_time="paid_at", right_time="refunded_at",
              between=("0 seconds", "+30 minutes"), how=how, max_out_of_orderness="1 minute",
              max_state_rows=max_state_rows)
    )


def refunds_pipeline(root: str | Path, tables: TableSettings, shards: int = 4, how: JoinHow = "left",
                     max_state_rows: int | None = None) -> Pipeline:
    """The join (``refunds_join``) into two tables: the Delta table is upserted by
    payment and both row ids; the Iceberg table is the changelog, each epoch's rows
    appended."""
    return (
        refunds_join(root, how, max_state_rows)
        .sink(DeltaSink(f"{tables.warehouse}/delta/payment_refunds", name="refunds", mode="upsert",
                        storage_options=tables.delta_storage_options, on_foreign_lineage=tables.on_foreign_lineage))
        .sink(IcebergSink("payments.refund_changes", catalog=tables.iceberg_catalog, name="refund_changes",
                          mode="append", on_foreign_lineage=tables.on_foreign_lineage))
        .with_shards(shards)
    )


def refunds_deployment(root: str | Path) -> Deployment:
    return demo_deployment("refunds", lambda tables: refunds_pipeline(root, tables))
