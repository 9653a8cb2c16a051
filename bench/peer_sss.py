"""The peer for side-by-side benchmarks: the same workloads run through Spark
Structured Streaming the way a careful user would, so our epochs are compared
with the engine's own best configuration rather than a straw man.

    ./dev bench peer_sss [--records 200000] [--keys 20000] [--epochs 4] [--workload A|B] [--restart-check]

* Source: the event files as a parquet file stream, ``maxFilesPerTrigger=1``, so one
  file is one micro-batch is one of our epochs (file mtimes are set in name order
  first: Spark orders new files by modification time).
* Trigger ``availableNow``; RocksDB state store with changelog checkpointing;
  ``spark.sql.shuffle.partitions`` = shards.
* Sink: ``foreachBatch`` writing to Delta with delta-rs (no delta-spark jars here),
  one commit per batch carrying the app transaction ``(app_id, batch_id)``; a
  replayed batch whose txn is already in the table is skipped (exactly-once).
* Workload A: running total/count per merchant over active events, update mode,
  MERGE into the table. Workload B: 1-minute tumbling windows per merchant with a
  30 s watermark, append mode, appended to the table (Bsl: 5-minute windows sliding
  every minute; Bse: ``session_window`` with a 5-minute gap). Ad: A after
  ``withWatermark("event_time", "10 minutes").dropDuplicatesWithinWatermark(["event_id"])``.
  C: A's query, its changed rows appended. The windows are ``bench.workloads.WINDOWS``,
  the ones our pipelines use.

Spark behaviour this module works around or relies on (found while building it):

* A foreachBatch that returns without executing the batch DataFrame leaves the
  batch's state-store versions uncommitted, and Spark 4 then fails the batch
  (STATE_STORE_COMMIT_VALIDATION_FAILED, "Expected 4 commits but got 0"; seen
  on a replay with the noop write removed). The skip path therefore still runs
  the batch into the ``noop`` sink.
* Batch 0 carries the query's warm-up (first planning, codegen, Python worker
  start: ~6 s of its ~8 s here); ``median_batch_s`` is the steady-state figure.
* Watermark timing (workload B): batch N evicts with the watermark computed at
  the end of batch N-1 (max event time of files 0..N-1 minus 30 s; 0 for batch
  0). With ``availableNow`` Spark runs one extra no-data batch after the last
  file when the advanced watermark would evict state, so everything whose window
  end <= (max event time of all files - 30 s) is emitted by the end. The check in
  ``main`` verifies this rule per batch (row counts), that no window is emitted
  twice, and that every emitted window equals the reference from all its records.
* ``recentProgress`` keeps the last 100 progresses (``numRecentProgressUpdates``):
  enough for the small runs this is meant for; entries whose ``durationMs`` has
  no ``addBatch`` are idle reports, not executed batches.
* The foreachBatch function runs in this driver process (classic PySpark, not
  Spark Connect), which is what lets it record its own timings in a closure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake  # noqa: E402
from deltalake.exceptions import TableNotFoundError  # noqa: E402
from pyspark.sql import DataFrame, SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from bench.workloads import WINDOWS  # noqa: E402

ENGINE = "spark_structured_streaming"
WATERMARK_DELAY_S = 30
WINDOW_S = WINDOWS["B"].size_s

EVENT_SCHEMA = StructType(
    [
        StructField("event_id", LongType()),
        StructField("merchant_id", LongType()),
        StructField("amount", DoubleType()),
        StructField("status", StringType()),
        StructField("event_time", TimestampType()),
    ]
)

PEER_CONF: dict[str, str] = {
    "spark.sql.streaming.stateStore.providerClass":
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true",
}

PHASES = ("triggerExecution", "latestOffset", "getBatch", "queryPlanning", "addBatch", "walCommit", "commitOffsets")
STATE_FIELDS = ("numRowsTotal", "numRowsUpdated", "numRowsRemoved", "numRowsDroppedByWatermark",
                "memoryUsedBytes", "allUpdatesTimeMs", "allRemovalsTimeMs", "commitTimeMs",
                "numShufflePartitions", "numStateStoreInstances")


def order_file_mtimes(events_dir: Path) -> list[Path]:
    """Give the event files strictly increasing mtimes in name order, whole seconds
    apart (coarse filesystems), ending now: Spark's file source picks new files by
    modification time, and only name order matches our epochs."""
    files = sorted(events_dir.glob("events-*.parquet"))
    now = int(time.time())
    for i, f in enumerate(files):
        t = now - (len(files) - i)
        os.utime(f, (t, t))
    return files


def _progress_dict(progress: Any) -> dict[str, Any]:
    """A StreamingQueryProgress as a plain dict (its ``json`` is a property in 4.x)."""
    raw = progress.json
    return json.loads(raw() if callable(raw) else raw)


def _dir_bytes(path: Path) -> int:
    return sum((Path(root) / f).stat().st_size for root, _, fs in os.walk(path) for f in fs)


def _set_confs(spark: SparkSession, conf: dict[str, str]) -> dict[str, str | None]:
    """Set session confs; return the previous values so they can be restored."""
    previous: dict[str, str | None] = {}
    for key, value in conf.items():
        previous[key] = spark.conf.get(key, None)
        spark.conf.set(key, value)
    return previous


def _restore_confs(spark: SparkSession, previous: dict[str, str | None]) -> None:
    for key, value in previous.items():
        if value is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, value)


def _workload_a(events: DataFrame) -> DataFrame:
    return (events.where(F.col("status") == "active")
            .groupBy("merchant_id")
            .agg(F.sum("amount").alias("total"), F.count(F.lit(1)).alias("events")))


def _windowed(events: DataFrame, workload: str) -> DataFrame:
    """B, Bsl, Bse: count, sum and max per merchant and window, 30 s watermark."""
    return (events.withWatermark("event_time", f"{WATERMARK_DELAY_S} seconds")
            .groupBy("merchant_id", WINDOWS[workload].spark().alias("window"))
            .agg(F.count(F.lit(1)).alias("events"), F.sum("amount").alias("total"),
                 F.max("amount").alias("largest"))
            .select("merchant_id", F.col("window.start").alias("window_start"),
                    F.col("window.end").alias("window_end"), "events", "total", "largest"))


WORKLOADS = ("A", "Ad", "B", "Bsl", "Bse", "C")


def _query(events: DataFrame, workload: str) -> tuple[DataFrame, str, bool]:
    """A workload's streaming query, its output mode, and whether its batches MERGE
    into the table (A, Ad: an upsert table) or are appended to it."""
    if workload in WINDOWS:
        return _windowed(events, workload), "append", False
    if workload == "Ad":
        events = events.withWatermark("event_time", "10 minutes").dropDuplicatesWithinWatermark(["event_id"])
    return _workload_a(events), "update", workload in ("A", "Ad")


def _delta_writer(delta_uri: str, app_id: str, upsert: bool,
                  sink_stats: dict[int, dict[str, Any]]) -> Callable[[DataFrame, int], None]:
    """The foreachBatch function: one Delta commit per batch with txn (app_id, batch_id),
    skipped when the table already holds that batch (a replay after a crash between
    our commit and Spark's commit log). Times itself into ``sink_stats``."""

    def write_batch(batch_df: DataFrame, batch_id: int) -> None:
        t0 = time.perf_counter()
        try:
            table: DeltaTable | None = DeltaTable(delta_uri)
        except TableNotFoundError:
            table = None
        held = None if table is None else table.transaction_version(app_id)
        if held is not None and held >= batch_id:
            # Still execute the batch, or the state stores of this batch never commit.
            batch_df.write.format("noop").mode("overwrite").save()
            sink_stats[batch_id] = {"skipped": True, "held": held, "rows": None, "collect_s": 0.0,
                                    "delta_s": 0.0, "fn_s": time.perf_counter() - t0}
            return
        t1 = time.perf_counter()
        data = batch_df.toArrow()
        t2 = time.perf_counter()
        props = CommitProperties(app_transactions=[Transaction(app_id, batch_id)])
        if data.num_rows == 0:
            pass  # nothing to write; a replay would produce nothing as well
        elif table is None:
            write_deltalake(delta_uri, data, mode="error", commit_properties=props)
        elif upsert:
            (table.merge(source=data, predicate="t.merchant_id = s.merchant_id", source_alias="s",
                         target_alias="t", commit_properties=props)
             .when_matched_update_all().when_not_matched_insert_all().execute())
        else:
            write_deltalake(table, data, mode="append", commit_properties=props)
        t3 = time.perf_counter()
        sink_stats[batch_id] = {"skipped": False, "held": held, "rows": data.num_rows,
                                "open_s": t1 - t0, "collect_s": t2 - t1, "delta_s": t3 - t2,
                                "fn_s": t3 - t0}

    return write_batch


def run_to_end(writer: Any) -> tuple[list[dict], float]:
    """Start a streaming query (``availableNow``), wait for its end: its progress
    reports and wall-clock seconds; a failed query raises."""
    t0 = time.perf_counter()
    query = writer.start()
    query.awaitTermination()
    wall = time.perf_counter() - t0
    if query.exception() is not None:
        raise RuntimeError(f"peer query failed: {query.exception()}")
    return [_progress_dict(p) for p in query.recentProgress], wall


def executed_batches(progresses: list[dict], sink_stats: dict) -> list[dict]:
    """The batches that ran (an idle trigger adds no batch), with what the sink wrote."""
    return [_batch_entry(p, sink_stats.get(p["batchId"])) for p in progresses if "addBatch" in p.get("durationMs", {})]


def _batch_entry(p: dict[str, Any], sink: dict[str, Any] | None) -> dict[str, Any]:
    """One progress as {batch_id, records, seconds, phases (s), state, watermark, sink}."""
    dur = p.get("durationMs", {})
    phases = {k: dur[k] / 1000.0 for k in PHASES if k in dur}
    if sink:  # the foreachBatch's own timings: toArrow (runs the batch), Delta commit, whole fn
        phases.update({name: sink[k] for k, name in (("collect_s", "fn_collect"), ("delta_s", "fn_delta_commit"),
                                                     ("fn_s", "fn_total")) if k in sink})
    ops = p.get("stateOperators") or []
    state: dict[str, Any] = {}
    if ops:
        op = ops[0]
        state = {k: op[k] for k in STATE_FIELDS if k in op}
        state["customMetrics"] = dict(op.get("customMetrics") or {})
        if len(ops) > 1:
            state["other_operators"] = ops[1:]
    return {
        "batch_id": p["batchId"],
        "records": int(p.get("numInputRows", 0)),
        "seconds": dur.get("triggerExecution", 0) / 1000.0,
        "phases": phases,
        "state": state,
        "watermark": (p.get("eventTime") or {}).get("watermark"),
        "timestamp": p.get("timestamp"),
        "sink": sink,
    }


def run_peer(spark: SparkSession, events_dir: Path, workdir: Path, workload: str, shards: int) -> dict[str, Any]:
    """Run a workload of ``WORKLOADS`` over the files in ``events_dir`` until they are drained
    (availableNow), checkpointing in ``workdir/checkpoint-<W>`` and writing Delta at
    ``workdir/delta-<W>``; calling it again with the same workdir resumes from the
    checkpoint. Needs a classic (non-Connect) session. Times are in seconds;
    ``records_per_s`` is records over the summed trigger time of all executed
    batches (no-data flush batches included: they do the emitting in B)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, not {workload!r}")
    events_dir, workdir = Path(events_dir), Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / f"checkpoint-{workload}"
    delta_uri = str((workdir / f"delta-{workload}").absolute())
    app_id = f"peer-sss-{workload}"
    order_file_mtimes(events_dir)

    previous = _set_confs(spark, {**PEER_CONF, "spark.sql.shuffle.partitions": str(shards)})
    sink_stats: dict[int, dict[str, Any]] = {}
    try:
        events = (spark.readStream.format("parquet").schema(EVENT_SCHEMA)
                  .option("maxFilesPerTrigger", 1).load(str(events_dir)))
        result, mode, upsert = _query(events, workload)
        writer = (result.writeStream
                  .queryName(f"peer_sss_{workload}_{os.getpid()}_{int(time.time())}")
                  .outputMode(mode)
                  .option("checkpointLocation", str(checkpoint))
                  .trigger(availableNow=True)
                  .foreachBatch(_delta_writer(delta_uri, app_id, upsert, sink_stats)))
        progresses, wall = run_to_end(writer)
    finally:
        _restore_confs(spark, previous)

    executed = executed_batches(progresses, sink_stats)
    batches = [b for b in executed if b["records"] > 0]
    empty = [b for b in executed if b["records"] == 0]
    idle = [p for p in progresses if "addBatch" not in p.get("durationMs", {})]
    records = sum(b["records"] for b in batches)
    work_s = sum(b["seconds"] for b in executed)
    secs = sorted(b["seconds"] for b in batches)
    return {
        "engine": ENGINE,
        "workload": workload,
        "shards": shards,
        "batches": batches,
        "empty_batches": empty,
        "idle_progress": len(idle),
        "records": records,
        "records_per_s": records / work_s if work_s else 0.0,
        "query_wall_s": wall,
        "records_per_s_query_wall": records / wall if wall else 0.0,
        "median_batch_s": statistics.median(secs) if secs else 0.0,
        "p95_batch_s": float(np.percentile(secs, 95)) if secs else 0.0,
        "skipped_batches": sorted(b for b, s in sink_stats.items() if s["skipped"]),
        "checkpoint_bytes": _dir_bytes(checkpoint),
        "checkpoint": str(checkpoint),
        "delta_uri": delta_uri,
        "app_id": app_id,
        "conf": {**PEER_CONF, "spark.sql.shuffle.partitions": str(shards)},
    }


def read_peer_table(result: dict[str, Any]) -> pa.Table:
    """The peer's Delta table as Arrow (empty when no batch wrote anything)."""
    try:
        return DeltaTable(result["delta_uri"]).to_pyarrow_table()
    except TableNotFoundError:
        return pa.table({})


# ---------------------------------------------------------------- references


def _read_events(events_dir: Path) -> list[pa.Table]:
    return [pq.read_table(f) for f in sorted(Path(events_dir).glob("events-*.parquet"))]


def reference_a(files: list[pa.Table]) -> pa.Table:
    """Total and count per merchant over active events, straight from the files."""
    t = pa.concat_tables(files)
    t = t.filter(pc.equal(t["status"], "active"))
    g = t.group_by("merchant_id").aggregate([("amount", "sum"), ("amount", "count")])
    return pa.table({"merchant_id": g["merchant_id"], "total": g["amount_sum"],
                     "events": g["amount_count"].cast(pa.int64())})


def _minute_us(t: pa.Table) -> pa.Array:
    """Start of each record's tumbling window, in µs since the epoch."""
    us = t["event_time"].cast(pa.int64()).to_numpy()
    return pa.array(us // (WINDOW_S * 1_000_000) * (WINDOW_S * 1_000_000))


def reference_b(files: list[pa.Table]) -> pa.Table:
    """Every (merchant, minute) window from all records: start/end in µs, count, sum, max."""
    t = pa.concat_tables(files)
    t = t.append_column("window_start", _minute_us(t))
    g = t.group_by(["merchant_id", "window_start"]).aggregate(
        [("amount", "count"), ("amount", "sum"), ("amount", "max")])
    return pa.table({"merchant_id": g["merchant_id"], "window_start": g["window_start"],
                     "window_end": pc.add(g["window_start"], WINDOW_S * 1_000_000),
                     "events": g["amount_count"].cast(pa.int64()), "total": g["amount_sum"],
                     "largest": g["amount_max"]})


def _sorted(t: pa.Table, keys: list[str]) -> pa.Table:
    return t.sort_by([(k, "ascending") for k in keys])


def _compare(got: pa.Table, want: pa.Table, keys: list[str], exact: list[str], approx: list[str]) -> list[str]:
    problems: list[str] = []
    if got.num_rows != want.num_rows:
        return [f"{got.num_rows} rows, expected {want.num_rows}"]
    got, want = _sorted(got, keys), _sorted(want, keys)
    for c in keys + exact:
        if not np.array_equal(got[c].to_numpy(), want[c].to_numpy()):
            problems.append(f"column {c} differs")
    for c in approx:
        if not np.allclose(got[c].to_numpy(), want[c].to_numpy(), rtol=0, atol=1e-6):
            problems.append(f"column {c} differs beyond 1e-6")
    return problems


def check_a(result: dict[str, Any], events_dir: Path) -> list[str]:
    """The table equals the per-merchant reference (no double counting)."""
    got = read_peer_table(result).select(["merchant_id", "total", "events"])
    return _compare(got, reference_a(_read_events(events_dir)), ["merchant_id"], ["events"], ["total"])


def expected_b_rows_per_batch(files: list[pa.Table]) -> tuple[list[int], int, int]:
    """Spark's append rule replayed on the files: batch N evicts windows with
    end <= W[N] = max event time of files < N - 30 s (W[0] = 0); then one no-data
    batch with W = max of all - 30 s. Returns rows per data batch, rows of the
    flush batch, and the final watermark (µs)."""
    maxes = [int(pc.max(f["event_time"].cast(pa.int64())).as_py()) for f in files]
    keys_seen: list[pa.Table] = []
    emitted_until = -(2**62)
    rows: list[int] = []
    for n, f in enumerate(files):
        watermark = 0 if n == 0 else max(maxes[:n]) - WATERMARK_DELAY_S * 1_000_000
        keys_seen.append(pa.table({"m": f["merchant_id"], "e": pc.add(_minute_us(f), WINDOW_S * 1_000_000)}))
        open_ = pa.concat_tables(keys_seen).group_by(["m", "e"]).aggregate([])
        e = open_["e"].to_numpy()
        rows.append(int(((e <= watermark) & (e > emitted_until)).sum()))
        emitted_until = max(emitted_until, watermark)
    final = max(maxes) - WATERMARK_DELAY_S * 1_000_000
    e = pa.concat_tables(keys_seen).group_by(["m", "e"]).aggregate([])["e"].to_numpy()
    flush = int(((e <= final) & (e > emitted_until)).sum())
    return rows, flush, final


def check_b(result: dict[str, Any], events_dir: Path) -> list[str]:
    """No window twice; every emitted window equals the reference from all its
    records; emitted set = windows ending at or before the final watermark; rows
    per batch follow the append rule replayed on the files."""
    files = _read_events(events_dir)
    got = read_peer_table(result)
    got = got.set_column(got.schema.get_field_index("window_start"), "window_start",
                         got["window_start"].cast(pa.int64()))
    got = got.set_column(got.schema.get_field_index("window_end"), "window_end", got["window_end"].cast(pa.int64()))
    problems: list[str] = []
    distinct = got.group_by(["merchant_id", "window_start"]).aggregate([]).num_rows
    if distinct != got.num_rows:
        problems.append(f"{got.num_rows - distinct} windows emitted more than once")
    per_batch, flush, final = expected_b_rows_per_batch(files)
    ref = reference_b(files)
    ref = ref.filter(pc.less_equal(ref["window_end"], final))
    problems += _compare(got.select(ref.column_names), ref, ["merchant_id", "window_start"],
                         ["window_end", "events"], ["total", "largest"])
    rows = {b["batch_id"]: (b["sink"] or {}).get("rows") for b in result["batches"] + result["empty_batches"]}
    want = {i: r for i, r in enumerate(per_batch)}
    if flush:
        want[len(per_batch)] = flush
    if rows != want:
        problems.append(f"rows per batch {rows}, append rule says {want}")
    return problems


# ---------------------------------------------------------------- main


def print_result(result: dict[str, Any]) -> None:
    """A small per-batch table and the summary."""
    print(f"\n{result['engine']} workload {result['workload']} shards={result['shards']}")
    head = (f"{'batch':>5} {'records':>8} {'s':>6} {'addBatch':>8} {'plan':>6} {'wal':>6} {'commit':>6} "
            f"{'delta':>6} {'out':>6} {'stateRows':>9} {'updated':>8} {'stateMB':>7} {'stCommit':>8} {'clogSync':>8}")
    print(head)
    for b in result["batches"] + result["empty_batches"]:
        ph, st, sk = b["phases"], b["state"], b["sink"] or {}
        cm = st.get("customMetrics", {})
        out = "skip" if sk.get("skipped") else sk.get("rows", "-")
        print(f"{b['batch_id']:>5} {b['records']:>8} {b['seconds']:>6.2f} {ph.get('addBatch', 0):>8.2f} "
              f"{ph.get('queryPlanning', 0):>6.2f} {ph.get('walCommit', 0):>6.2f} {ph.get('commitOffsets', 0):>6.2f} "
              f"{ph.get('fn_delta_commit', 0):>6.2f} {out!s:>6} {st.get('numRowsTotal', 0):>9} "
              f"{st.get('numRowsUpdated', 0):>8} {st.get('memoryUsedBytes', 0) / 2**20:>7.1f} "
              f"{st.get('commitTimeMs', 0) / 1000:>8.2f} {cm.get('rocksdbCommitFileSyncLatencyMs', 0) / 1000:>8.2f}")
    keys = ("records", "records_per_s", "query_wall_s", "records_per_s_query_wall", "median_batch_s",
            "p95_batch_s", "checkpoint_bytes", "skipped_batches", "idle_progress")
    print(json.dumps({k: (round(result[k], 3) if isinstance(result[k], float) else result[k]) for k in keys}))


def _dump(path: Path | None, results: list[dict[str, Any]]) -> None:
    if path is not None:
        path.write_text(json.dumps(results, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workload", choices=("A", "B"), default="A")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--restart-check", action="store_true",
                        help="A only: run half the files, simulate a crash after the last Delta commit, "
                             "add the rest, resume, and check nothing is counted twice")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    parser.add_argument("--json", type=Path, help="write the result dict(s) here")
    args = parser.parse_args()

    from volley_dagster.demo.events import generate
    from volley_dagster.spark.session import get_or_create_spark

    tmp = Path(tempfile.mkdtemp(prefix="peer_sss_"))
    events_dir, workdir = tmp / "events", tmp / "work"
    per_file = args.records // args.epochs
    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": "4"})
    spark.sparkContext.setLogLevel("WARN")
    results: list[dict[str, Any]] = []
    problems: list[str] = []
    try:
        if args.restart_check:
            first = args.epochs // 2 or 1
            generate(events_dir, files=first, records_per_file=per_file, keys=args.keys)
            r1 = run_peer(spark, events_dir, workdir, "A", args.shards)
            print_result(r1)
            # Simulate a crash after the sink committed the last batch but before Spark
            # wrote its commit log entry: Spark must replay it, our txn check skip it.
            last = max(b["batch_id"] for b in r1["batches"])
            (Path(r1["checkpoint"]) / "commits" / str(last)).unlink()
            crc = Path(r1["checkpoint"]) / "commits" / f".{last}.crc"
            crc.unlink(missing_ok=True)
            generate(events_dir, files=args.epochs - first, records_per_file=per_file, keys=args.keys,
                     first_file=first)
            r2 = run_peer(spark, events_dir, workdir, "A", args.shards)
            print_result(r2)
            results = [r1, r2]
            _dump(args.json, results)
            if r2["skipped_batches"] != [last]:
                problems.append(f"expected batch {last} replayed and skipped, got {r2['skipped_batches']}")
            problems += check_a(r2, events_dir)
        else:
            generate(events_dir, files=args.epochs, records_per_file=per_file, keys=args.keys)
            r = run_peer(spark, events_dir, workdir, args.workload, args.shards)
            print_result(r)
            results = [r]
            _dump(args.json, results)
            problems += check_a(r, events_dir) if args.workload == "A" else check_b(r, events_dir)
    finally:
        spark.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    if problems:
        print("CHECK FAILED: " + "; ".join(problems))
        sys.exit(1)
    print("check: OK (Delta table equals the reference" +
          (", replayed batch skipped, nothing counted twice)" if args.restart_check else ")"))


if __name__ == "__main__":
    main()
