"""A chain of two stateful steps, "each payment joined with its refunds, then refunds per
merchant per hour", ours (two pipelines, the second reading the first's Delta table; and
one pipeline holding both operators, ``volley_dagster/chain.py``) against one Spark
Structured Streaming query holding both operators, on the same files, in one run
(issue 79, point 5).

    ./dev bench chain [--events 400000] [--epochs 8] [--files-per-epoch 1] [--shards 4]
                      [--epoch-minutes 30] [--merchants 2000] [--refunded 0.2] [--outside 0.05]
                      [--disorder-s 20] [--engines ours,one,spark]

The logs are ``bench/join.py``'s (``generate_logs``: payments, and refunds of a
``--refunded`` share of them, mostly 0..30 minutes after the payment, an ``--outside``
share 30..90 minutes after; every record lands in a file up to ``--disorder-s`` after
its event time, less than the 1 minute both engines allow, so no record is late).
``--events`` counts the records of both logs; ``--epoch-minutes`` of event time per
epoch (30: eight epochs cover four hours, so hourly windows close during the run).

Ours, as a user writes them, one ``EpochRunner`` each, one SparkSession for both:

* A ``Pipeline("refunds").sources({"payments": FileLog, "refunds": FileLog}).join(
  left="payments", right="refunds", on="payment_id", left_time="paid_at",
  right_time="refunded_at", between=("0 seconds", "+30 minutes"), how="left",
  max_out_of_orderness="1 minute")`` -> ``DeltaSink(refund_log, mode="append")``;
* B ``Pipeline("refund_hours").source(DeltaTableSource(refund_log)).where("refund_amount
  IS NOT NULL").key_by("merchant_id").window(tumbling("1 hour"), on="refunded_at",
  max_out_of_orderness="1 minute").aggregate(refunds=count(), refunded=sum_(...),
  largest=max_(...))`` -> ``DeltaSink(refund_hours, mode="append")``.

Each epoch: epoch i's files are published into the logs (hardlinks), A runs its next
epoch, then B its next (B's cut takes the version A just committed). An epoch's seconds
are the wall clock of A's ``run_next`` plus B's (cut, lease, run, manifest: what a
scheduler waits for), both parts printed.

The peer: one query, ``bench/join.py``'s stream-stream left outer interval join
(watermarks of 1 minute on both sides, RocksDB state store with changelog
checkpointing), then ``where(refund_amount IS NOT NULL)``, then
``groupBy(window(refunded_at, "1 hour"), merchant_id).agg(count, sum, max)`` in append
mode, ``foreachBatch`` into Delta with delta-rs and the app transaction; the same files
with ``maxFilesPerTrigger`` = ``--files-per-epoch``, ``availableNow``. Spark 4 accepts the
chain as it is (``spark.sql.streaming.statefulOperator.allowMultiple``, true by default;
the aggregation's watermark is the join's output watermark, which Spark propagates,
held back by the join's 30-minute interval): no change to the left outer join was
needed. Its seconds are the batch's ``triggerExecution``.

Records/s = source records of both logs in the epoch / the epoch's seconds; medians of
epochs 2..; ours/Spark. State on disk after the run: ours the last epoch's snapshots of
both pipelines (and both checkpoint roots whole), Spark its checkpoint's ``state/`` (and
the whole checkpoint).

The check: the hourly windows of both engines' tables. Each engine emits each window
once; on the windows both emitted the rows are equal (count exact, sum and max to
1e-6); every window either emitted equals the reference computed from the files with
pandas (the pairs 0..30 minutes apart, per merchant and hour of ``refunded_at``); and
ours emitted exactly the reference's windows that end at or before B's last watermark.
Spark emits each hour later than ours: its aggregation fires with the join's
propagated watermark, the query's (itself one batch behind) less the join's 30-minute
interval, so at the defaults an hour ours fires in epoch N Spark fires in batch N+2,
and the last one in the no-data batch ``availableNow`` adds at the end. At the defaults
both end with the same hours; other sizes may leave Spark with fewer, which is why the
engines are compared on the windows both emitted. Any difference exits 1. Writes
bench/results/chain.json. The machine is shared and noisy: compare ratios within a run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from bench.common import finish  # noqa: E402
from bench.join import (  # noqa: E402
    BETWEEN_S,
    OUT_OF_ORDERNESS,
    PAYMENTS_SPARK,
    REFUNDS_SPARK,
    _figure,
    _n,
    _read_delta,
    generate_logs,
    machine,
)
from bench.peer_sss import (  # noqa: E402
    ENGINE,
    PEER_CONF,
    _delta_writer,
    _dir_bytes,
    _restore_confs,
    _set_confs,
    executed_batches,
    run_to_end,
)
from volley_dagster.demo.events import START_US  # noqa: E402
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402

HOUR_US = 3_600_000_000
MiB = 2**20
WINDOW_COLUMNS = ["merchant_id", "window_start", "window_end", "refunds", "refunded", "largest"]
KEY = ["merchant_id", "window_start"]


# ---------------------------------------------------------------- ours


def _publish(staged: tuple[Path, Path], logs: tuple[Path, Path], epoch: int, files_per_epoch: int) -> None:
    """Epoch ``epoch``'s files of both logs, hardlinked into the logs an engine reads."""
    for src, dst in zip(staged, logs, strict=True):
        for k in range(epoch * files_per_epoch, (epoch + 1) * files_per_epoch):
            os.link(src / f"events-{k:05d}.parquet", dst / f"events-{k:05d}.parquet")


def run_ours(spark: SparkSession, staged: tuple[Path, Path], work: Path, epochs: int, files_per_epoch: int,
             shards: int) -> dict[str, Any]:
    """Each epoch: publish its files (hardlinks), A's next epoch, B's next epoch."""
    from volley_dagster import (
        DeltaSink,
        DeltaTableSource,
        EpochRunner,
        FileLog,
        Pipeline,
        count,
        max_,
        sum_,
        tumbling,
    )

    logs = (work / "ours-log" / "payments", work / "ours-log" / "refunds")
    for d in logs:
        d.mkdir(parents=True)
    refund_log, refund_hours = work / "ours-refund-log", work / "ours-refund-hours"
    a = (Pipeline("refunds")
         .sources({"payments": FileLog(logs[0], format="parquet"), "refunds": FileLog(logs[1], format="parquet")})
         .join(left="payments", right="refunds", on="payment_id", left_time="paid_at", right_time="refunded_at",
               between=(f"{BETWEEN_S[0]} seconds", f"+{BETWEEN_S[1] // 60} minutes"), how="left",
               max_out_of_orderness=OUT_OF_ORDERNESS)
         .sink(DeltaSink(refund_log, name="refund_log", mode="append"))
         .with_shards(shards))
    b = (Pipeline("refund_hours")
         .source(DeltaTableSource(refund_log))
         .where("refund_amount IS NOT NULL")
         .key_by("merchant_id")
         .window(tumbling("1 hour"), on="refunded_at", max_out_of_orderness=OUT_OF_ORDERNESS)
         .aggregate(refunds=count(), refunded=sum_("refund_amount"), largest=max_("refund_amount"))
         .sink(DeltaSink(refund_hours, name="refund_hours", mode="append"))
         .with_shards(shards))
    settings = RunSettings(max_records_per_epoch=None)
    runner_a = EpochRunner(a, work / "ours-state-refunds", settings, spark=spark)
    runner_b = EpochRunner(b, work / "ours-state-refund-hours", settings, spark=spark)
    rows = []
    last: dict[str, Any] = {}
    t0 = time.perf_counter()
    for i in range(epochs):
        _publish(staged, logs, i, files_per_epoch)
        t = time.perf_counter()
        ra = runner_a.run_next()
        ta = time.perf_counter() - t
        assert ra is not None, f"epoch {i + 1}: nothing to run in A"
        t = time.perf_counter()
        rb = runner_b.run_next()  # None when A's epoch appended nothing
        tb = time.perf_counter() - t
        last["a"] = ra
        if rb is not None:
            last["b"] = rb
        rows.append({"epoch": i + 1, "records": ra.records_in, "seconds": ta + tb, "a_s": ta, "b_s": tb,
                     "a_engine_s": ra.durations["total"], "b_engine_s": rb.durations["total"] if rb else None,
                     "a_epoch": ra.epoch, "b_epoch": rb.epoch if rb else None,
                     "a_rows_out": ra.records_out, "b_records_in": rb.records_in if rb else 0,
                     "b_rows_out": rb.records_out if rb else 0,
                     "late": ra.late_records + (rb.late_records if rb else 0),
                     "join_rows": (_figure(ra, "join_left_rows") or 0) + (_figure(ra, "join_right_rows") or 0),
                     "pairs": _figure(ra, "join_pairs"), "unmatched": _figure(ra, "join_unmatched"),
                     "b_watermark": rb.watermark if rb else None,
                     "a_state_bytes": ra.state_bytes, "b_state_bytes": rb.state_bytes if rb else None})
    wall = time.perf_counter() - t0
    runner_a.wait_for_compactions()
    state = last["a"].state_bytes + (last["b"].state_bytes if "b" in last else 0)
    return {"engine": "volley", "epochs_detail": rows, "wall_s": wall, "state_bytes": state,
            "checkpoint_bytes": _dir_bytes(work / "ours-state-refunds") + _dir_bytes(work / "ours-state-refund-hours"),
            "last_watermark_us": last["b"].watermark if "b" in last else None,
            "refund_log_rows": _read_delta(refund_log).num_rows, "table": str(refund_hours)}


def run_ours_one(spark: SparkSession, staged: tuple[Path, Path], work: Path, epochs: int, files_per_epoch: int,
                 shards: int) -> dict[str, Any]:
    """The same chain as one pipeline of two stateful operators (``volley_dagster/chain.py``):
    the join, then the hourly window over its pairs, in one ``EpochRunner``; the window
    keeps time by the watermark the join hands on (its own less the 30-minute interval),
    so it fires each hour later than B, as Spark's query does."""
    from volley_dagster import DeltaSink, EpochRunner, FileLog, Pipeline, count, max_, sum_, tumbling

    logs = (work / "one-log" / "payments", work / "one-log" / "refunds")
    for d in logs:
        d.mkdir(parents=True)
    hours = work / "one-refund-hours"
    pipeline = (Pipeline("hourly_refunds")
                .sources({"payments": FileLog(logs[0], format="parquet"),
                          "refunds": FileLog(logs[1], format="parquet")})
                .join(left="payments", right="refunds", on="payment_id", left_time="paid_at",
                      right_time="refunded_at", between=(f"{BETWEEN_S[0]} seconds", f"+{BETWEEN_S[1] // 60} minutes"),
                      how="left", max_out_of_orderness=OUT_OF_ORDERNESS)
                .with_shards(shards)
                .where("refund_amount IS NOT NULL")
                .key_by("merchant_id")
                .window(tumbling("1 hour"), on="refunded_at")
                .aggregate(refunds=count(), refunded=sum_("refund_amount"), largest=max_("refund_amount"))
                .sink(DeltaSink(hours, name="refund_hours", mode="append"))
                .with_shards(shards))
    runner = EpochRunner(pipeline, work / "one-state", RunSettings(max_records_per_epoch=None), spark=spark)
    rows, last = [], None
    t0 = time.perf_counter()
    for i in range(epochs):
        _publish(staged, logs, i, files_per_epoch)
        t = time.perf_counter()
        last = runner.run_next()
        assert last is not None, f"epoch {i + 1}: nothing to run"
        f = last.figures
        rows.append({"epoch": i + 1, "records": last.records_in, "seconds": time.perf_counter() - t,
                     "join_rows": f.get("stage1_join_left_rows", 0) + f.get("stage1_join_right_rows", 0),
                     "pairs_in": f.get("stage1_records_out", 0), "rows_out": last.records_out,
                     "late": last.late_records + f.get("stage1_late_records", 0), "watermark": last.watermark,
                     "spark_jobs": f.get("chain_spark_jobs")})
    wall = time.perf_counter() - t0
    runner.wait_for_compactions()
    assert last is not None
    state = last.state_bytes + runner.stage_runners()[0].result(last.epoch).state_bytes
    return {"engine": "volley-one", "epochs_detail": rows, "wall_s": wall, "state_bytes": state,
            "checkpoint_bytes": _dir_bytes(work / "one-state"), "last_watermark_us": last.watermark,
            "table": str(hours)}


# ---------------------------------------------------------------- the peer


def _operators(progresses: list[dict]) -> dict[int, list[dict[str, Any]]]:
    """Per executed batch, each state operator's name, rows held, rows dropped as late."""
    return {p["batchId"]: [{"name": op.get("operatorName"), "rows": op.get("numRowsTotal"),
                            "dropped": op.get("numRowsDroppedByWatermark")} for op in p.get("stateOperators") or []]
            for p in progresses if "addBatch" in p.get("durationMs", {})}


def run_peer(spark: SparkSession, staged: tuple[Path, Path], work: Path, files_per_epoch: int, shards: int,
             batches_expected: int) -> dict[str, Any]:
    """The same files through one query: the left outer interval join, then the
    hourly aggregation, append mode, foreachBatch into Delta."""
    checkpoint = work / "peer-checkpoint"
    delta_uri = str((work / "peer-refund-hours").absolute())
    conf = {**PEER_CONF, "spark.sql.shuffle.partitions": str(shards),
            "spark.sql.streaming.numRecentProgressUpdates": str(max(100, 2 * batches_expected + 10))}
    previous = _set_confs(spark, conf)
    sink_stats: dict[int, dict[str, Any]] = {}
    try:
        def side(path: Path, schema: Any) -> Any:
            return (spark.readStream.format("parquet").schema(schema)
                    .option("maxFilesPerTrigger", files_per_epoch).load(str(path)))

        p = side(staged[0], PAYMENTS_SPARK).withWatermark("paid_at", OUT_OF_ORDERNESS).alias("p")
        r = side(staged[1], REFUNDS_SPARK).withWatermark("refunded_at", OUT_OF_ORDERNESS).alias("r")
        joined = p.join(r, F.expr("p.payment_id = r.payment_id AND r.refunded_at >= p.paid_at AND "
                                  f"r.refunded_at <= p.paid_at + interval {BETWEEN_S[1] // 60} minutes"), "leftOuter")
        hourly = (joined.select("p.merchant_id", "r.refund_amount", "r.refunded_at")
                  .where("refund_amount IS NOT NULL")
                  .groupBy(F.window("refunded_at", "1 hour"), "merchant_id")
                  .agg(F.count(F.lit(1)).alias("refunds"), F.sum("refund_amount").alias("refunded"),
                       F.max("refund_amount").alias("largest"))
                  .select("merchant_id", F.col("window.start").alias("window_start"),
                          F.col("window.end").alias("window_end"), "refunds", "refunded", "largest"))
        query = (hourly.writeStream.queryName(f"peer_chain_{os.getpid()}_{int(time.time())}")
                 .outputMode("append").option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True)
                 .foreachBatch(_delta_writer(delta_uri, "peer-chain", False, sink_stats)))
        progresses, wall = run_to_end(query)
    finally:
        _restore_confs(spark, previous)

    ops = _operators(progresses)
    rows = []
    for b in executed_batches(progresses, sink_stats):
        mine = ops.get(b["batch_id"], [])
        rows.append({"epoch": b["batch_id"] + 1, "records": b["records"], "seconds": b["seconds"],
                     "rows_out": (b["sink"] or {}).get("rows"), "operators": mine,
                     "join_rows": sum(o["rows"] or 0 for o in mine if "Join" in (o["name"] or "")),
                     "agg_rows": sum(o["rows"] or 0 for o in mine if "Join" not in (o["name"] or "")),
                     "late": sum(o["dropped"] or 0 for o in mine), "watermark": b["watermark"],
                     "phases": b["phases"]})
    return {"engine": ENGINE, "epochs_detail": [x for x in rows if x["records"] > 0],
            "no_data_batches": [x for x in rows if x["records"] == 0], "wall_s": wall,
            "state_bytes": _dir_bytes(checkpoint / "state"), "checkpoint_bytes": _dir_bytes(checkpoint),
            "table": delta_uri, "conf": conf}


# ---------------------------------------------------------------- the check


def windows_of(uri: str) -> pd.DataFrame:
    """An engine's hourly windows, window bounds as microseconds since the epoch (UTC)."""
    t = _read_delta(Path(uri))
    if t.num_rows == 0:
        return pd.DataFrame({c: pd.Series(dtype="int64" if c != "refunded" and c != "largest" else "float64")
                             for c in WINDOW_COLUMNS})
    cols = {}
    for c in WINDOW_COLUMNS:
        col = t[c]
        if pa.types.is_timestamp(col.type):
            col = col.cast(pa.timestamp("us", tz="UTC")).cast(pa.int64())
        cols[c] = col.cast(pa.float64() if c in ("refunded", "largest") else pa.int64())
    return pa.table(cols).to_pandas()


def reference_windows(pay_dir: Path, ref_dir: Path) -> pd.DataFrame:
    """From the files: pairs with 0 <= refunded_at - paid_at <= 30 minutes, per merchant
    and hour of refunded_at: count, sum and max of refund_amount."""
    pay = pq.read_table(pay_dir, columns=["payment_id", "merchant_id", "paid_at"]).to_pandas()
    ref = pq.read_table(ref_dir).to_pandas()
    m = pay.merge(ref, on="payment_id")
    paid = _us(m["paid_at"])
    refunded = _us(m["refunded_at"])
    d = refunded - paid
    m = m.assign(window_start=refunded // HOUR_US * HOUR_US)[(d >= BETWEEN_S[0] * 10**6) & (d <= BETWEEN_S[1] * 10**6)]
    g = (m.groupby(KEY).agg(refunds=("refund_amount", "size"), refunded=("refund_amount", "sum"),
                            largest=("refund_amount", "max")).reset_index())
    g["window_end"] = g["window_start"] + HOUR_US
    return g[WINDOW_COLUMNS]


def _us(s: pd.Series) -> pd.Series:
    """A timestamp column as microseconds since the epoch, whatever pandas' unit."""
    return pd.Series(pa.array(s).cast(pa.timestamp("us", tz="UTC")).cast(pa.int64()).to_numpy(), index=s.index)


def differing(a: pd.DataFrame, b: pd.DataFrame) -> tuple[int, pd.DataFrame]:
    """Windows in both (by merchant and start), and those whose rows differ."""
    m = a.merge(b, on=KEY, suffixes=("_a", "_b"))
    bad = ((m["window_end_a"] != m["window_end_b"]) | (m["refunds_a"] != m["refunds_b"])
           | ((m["refunded_a"] - m["refunded_b"]).abs() > 1e-6) | ((m["largest_a"] - m["largest_b"]).abs() > 1e-6))
    return len(m), m[bad]


def check(ours: pd.DataFrame | None, peer: pd.DataFrame | None, want: pd.DataFrame,
          ours_watermark: int | None, one: pd.DataFrame | None = None,
          one_watermark: int | None = None) -> tuple[dict[str, Any], list[str]]:
    problems: list[str] = []
    figures: dict[str, Any] = {"reference_windows": len(want)}
    tables = {k: v for k, v in (("ours", ours), ("spark", peer), ("one", one)) if v is not None}
    for label, t in tables.items():
        twice = int(t.duplicated(KEY).sum())
        if twice:
            problems.append(f"{label}: {twice} windows emitted more than once")
        common, bad = differing(t, want)
        figures[f"{label}_windows"] = len(t)
        figures[f"{label}_hours"] = sorted({int(x) // HOUR_US for x in t["window_start"]})
        figures[f"{label}_vs_reference_differ"] = len(bad)
        if common != len(t):
            problems.append(f"{label}: {len(t) - common} emitted windows the reference does not have")
        if len(bad):
            problems.append(f"{label}: {len(bad)} windows differ from the reference, first {bad.head(3).to_dict('records')}")
    for label, table, watermark in (("ours", ours, ours_watermark), ("one", one, one_watermark)):
        if table is not None and watermark is not None:
            due = want[want["window_end"] <= watermark]
            figures[f"reference_windows_due_{label}"] = len(due)
            if len(due) != len(table) or differing(table, due)[0] != len(due):
                problems.append(f"{label}: emitted {len(table)} windows, the reference has {len(due)} ending by its "
                                "last watermark")
    if "ours" in tables and "spark" in tables:
        common, bad = differing(tables["ours"], tables["spark"])
        figures["common_windows"] = common
        figures["common_windows_differ"] = len(bad)
        if len(bad):
            problems.append(f"ours and spark differ on {len(bad)} of {common} common windows, first "
                            f"{bad.head(3).to_dict('records')}")
    return figures, problems


# ---------------------------------------------------------------- main


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Medians of epochs 2.. (all when there is one)."""
    rows = run["epochs_detail"]
    warm = rows[1:] or rows
    out = {"median_s": statistics.median(r["seconds"] for r in warm),
           "median_records_per_s": statistics.median(r["records"] / r["seconds"] for r in warm if r["seconds"]),
           "records": sum(r["records"] for r in rows)}
    if "a_s" in rows[0]:
        out["median_a_s"] = statistics.median(r["a_s"] for r in warm)
        out["median_b_s"] = statistics.median(r["b_s"] for r in warm)
    return out


def _hours(us: int | None) -> str:
    return "-" if us is None else f"{(us - START_US) / HOUR_US:.2f} h"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=400_000, help="records of both logs together")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--files-per-epoch", type=int, default=1, help="files per side per epoch")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--epoch-minutes", type=float, default=30.0, help="event time one epoch covers")
    parser.add_argument("--merchants", type=int, default=2_000)
    parser.add_argument("--refunded", type=float, default=0.2, help="share of payments refunded")
    parser.add_argument("--outside", type=float, default=0.05, help="share of refunds 30..90 min after the payment")
    parser.add_argument("--disorder-s", type=float, default=20.0, help="how late a record may land in the files")
    parser.add_argument("--engines", default="ours,one,spark",
                        help="ours (two pipelines), one (one pipeline, both operators), spark (default all)")
    parser.add_argument("--workdir", default=None, help="keep the data and state here (default: a temp dir, removed)")
    args = parser.parse_args()
    engines = set(args.engines.split(","))

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-bench-chain-"))
    shutil.rmtree(work, ignore_errors=True)
    files = args.epochs * args.files_per_epoch
    staged = generate_logs(work / "staged", files, args.events, args.epoch_minutes, args.files_per_epoch,
                           args.refunded, args.outside, args.disorder_s, keys=args.merchants)
    sizes = [pq.read_metadata(d / f"events-{k:05d}.parquet").num_rows for d in staged for k in range(files)]
    want = reference_windows(*staged)
    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(args.shards)})
    spark.sparkContext.setLogLevel("WARN")
    print(f"{machine()['cores']} cores; {sum(sizes[:files]):,} payments + {sum(sizes[files:]):,} refunds, "
          f"{args.merchants:,} merchants, {args.epochs} epochs x {args.files_per_epoch} file(s) per side, "
          f"{args.epoch_minutes:g} min of event time per epoch, {args.shards} shards; join within "
          f"{BETWEEN_S[1] // 60} min, left outer, then refunds per merchant per hour; watermarks {OUT_OF_ORDERNESS}")

    runs: dict[str, dict[str, Any]] = {}
    if "ours" in engines:
        runs["ours"] = run_ours(spark, staged, work, args.epochs, args.files_per_epoch, args.shards)
    if "one" in engines:
        runs["one"] = run_ours_one(spark, staged, work, args.epochs, args.files_per_epoch, args.shards)
    if "spark" in engines:
        runs["spark"] = run_peer(spark, staged, work, args.files_per_epoch, args.shards, args.epochs)

    print(f"\n{'epoch':>5} {'engine':>6} {'records':>8} {'A s':>6} {'B s':>6} {'s':>6} {'rec/s':>9} "
          f"{'join rows':>9} {'agg rows':>8} {'pairs->B':>8} {'windows':>7} {'late':>5} {'watermark':>10}")
    for i in range(args.epochs):
        for label, run in runs.items():
            if i >= len(run["epochs_detail"]):
                continue
            r = run["epochs_detail"][i]
            rate = r["records"] / r["seconds"] if r["seconds"] else 0
            if label == "ours":
                print(f"{r['epoch']:>5} {label:>6} {r['records']:>8,} {r['a_s']:>6.2f} {r['b_s']:>6.2f} "
                      f"{r['seconds']:>6.2f} {rate:>9,.0f} {_n(r['join_rows']):>9} {'-':>8} "
                      f"{_n(r['b_records_in']):>8} {_n(r['b_rows_out']):>7} {r['late']:>5} "
                      f"{_hours(r['b_watermark']):>10}")
            elif label == "one":
                print(f"{r['epoch']:>5} {label:>6} {r['records']:>8,} {'':>6} {'':>6} {r['seconds']:>6.2f} "
                      f"{rate:>9,.0f} {_n(r['join_rows']):>9} {'-':>8} {_n(r['pairs_in']):>8} "
                      f"{_n(r['rows_out']):>7} {r['late']:>5} {_hours(r['watermark']):>10}")
            else:
                print(f"{r['epoch']:>5} {label:>6} {r['records']:>8,} {'':>6} {'':>6} {r['seconds']:>6.2f} "
                      f"{rate:>9,.0f} {_n(r['join_rows']):>9} {_n(r['agg_rows']):>8} {'':>8} "
                      f"{_n(r['rows_out']):>7} {r['late']:>5} {_wm(r['watermark']):>10}")
    for x in runs.get("spark", {}).get("no_data_batches", []):
        print(f"{x['epoch']:>5} {'spark':>6} {'no-data':>8} {'':>6} {'':>6} {x['seconds']:>6.2f} {'':>9} "
              f"{_n(x['join_rows']):>9} {_n(x['agg_rows']):>8} {'':>8} {_n(x['rows_out']):>7} {x['late']:>5} "
              f"{_wm(x['watermark']):>10}")
    print("(ours: A = the join pipeline, B = the hourly pipeline reading A's table, seconds are each run_next's "
          "wall clock; join rows: waiting on both sides after the epoch; pairs->B: rows B read; watermark: B's, "
          "hours after the first file's start; one: both operators in one pipeline, its run_next, the hourly "
          "stage's watermark; spark: triggerExecution, its query's global watermark)")

    summary = {label: summarize(run) for label, run in runs.items()}
    print(f"\nmedian of epochs 2..{args.epochs}; state on disk after the last epoch (ours: both pipelines' "
          "snapshots; spark: checkpoint/state/), MiB")
    print(f"{'engine':>6} {'A s':>6} {'B s':>6} {'s/epoch':>8} {'rec/s':>9} {'state':>7} {'ckpt':>7} {'wall s':>7}")
    for label, s in summary.items():
        run = runs[label]
        print(f"{label:>6} {_f(s.get('median_a_s')):>6} {_f(s.get('median_b_s')):>6} {s['median_s']:>8.2f} "
              f"{s['median_records_per_s']:>9,.0f} {run['state_bytes'] / MiB:>7.2f} "
              f"{run['checkpoint_bytes'] / MiB:>7.2f} {run['wall_s']:>7.1f}")
    ratios: dict[str, float] = {}
    for label in ("ours", "one"):
        if label in summary and "spark" in summary:
            o, p = summary[label], summary["spark"]
            ratios[f"records_per_s_{label}_to_spark"] = o["median_records_per_s"] / p["median_records_per_s"]
            ratios[f"seconds_per_epoch_{label}_to_spark"] = o["median_s"] / p["median_s"]
            print(f"{label}/spark: {ratios[f'records_per_s_{label}_to_spark']:.2f}x records/s, "
                  f"{ratios[f'seconds_per_epoch_{label}_to_spark']:.2f}x seconds per epoch")

    tables = {label: windows_of(run["table"]) for label, run in runs.items()}
    figures, problems = check(tables.get("ours"), tables.get("spark"), want,
                              runs.get("ours", {}).get("last_watermark_us"), tables.get("one"),
                              runs.get("one", {}).get("last_watermark_us"))
    for label, run in runs.items():
        late = sum(e["late"] or 0 for e in run["epochs_detail"] + run.get("no_data_batches", []))
        if late:
            problems.append(f"{label}: {late} late records (the bench expects none: lower --disorder-s)")
    print("\nhourly windows: " + ", ".join(
        f"{label} emitted {figures[f'{label}_windows']:,} (hours {_hour_list(figures[f'{label}_hours'])})"
        for label in runs) + f"; reference {figures['reference_windows']:,} over all hours")
    if "common_windows" in figures:
        print(f"common to both: {figures['common_windows']:,}, differing: {figures['common_windows_differ']}")
    if "reference_windows_due_ours" in figures:
        print(f"ours against the reference's {figures['reference_windows_due_ours']:,} windows ending by B's last "
              f"watermark ({_hours(runs['ours']['last_watermark_us'])}); every emitted window against the reference: "
              + ", ".join(f"{label} {figures[f'{label}_vs_reference_differ']} differ" for label in runs))
    print("check: OK" if not problems else "CHECK FAILED")

    report = {"args": vars(args), "machine": machine(), "median_warm": summary, "ratios": ratios, "runs": runs,
              "windows": figures, "problems": problems}
    # the state stores' maintenance thread, left running, prints a stack trace as the SparkEnv stops
    spark._jvm.org.apache.spark.sql.execution.streaming.state.StateStore.stop()
    spark.stop()
    path = finish("chain", report, work, keep=bool(args.workdir))
    print(f"wrote {path}")
    if problems:
        print("PROBLEMS: " + "; ".join(problems))
        sys.exit(1)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _wm(v: str | None) -> str:
    """Spark's watermark (ISO text) as hours after the first file's start."""
    if not v:
        return "-"
    us = int(np.datetime64(v.rstrip("Z"), "us").astype(np.int64))
    return "-" if us <= 0 else _hours(us)  # none yet: Spark reports the epoch (1970)


def _hour_list(hours: list[int]) -> str:
    rel = [h - START_US // HOUR_US for h in hours]
    return "-" if not rel else f"{rel[0]}..{rel[-1]}" if rel == list(range(rel[0], rel[-1] + 1)) else str(rel)


if __name__ == "__main__":
    main()
