"""A team's own stateful processor, ours against Spark Structured Streaming's: the
demo's ``VelocityAlert`` (``volley_dagster/demo/velocity.py``: a card paying
``--threshold`` times within ``--window-ms`` raises an alert; each card's recent
payments in list state, one event-time timer per payment to age them out) run by
``Pipeline.process(...)`` and by ``transformWithStateInPandas``, on the same files,
in one run.

    ./dev bench process [--files 8] [--records 20000] [--keys 10000] [--cards 1000]
                        [--shards 4] [--window-ms 10000] [--threshold 15]
                        [--events-per-second 1000] [--disorder-s 5] [--profile]

The log: ``--files`` demo event files of ``--records`` each (``demo.events.generate``,
``--keys`` merchants, ``--events-per-second`` of event time, each record up to
``--disorder-s`` out of order: less than the 10 s of out-of-orderness both engines
allow, so no record is late), card = merchant_id % ``--cards``.

Ours: ``velocity_pipeline`` (the demo's pipeline: ``key_by("card").process(
VelocityAlert(...), time_mode="EventTime", max_out_of_orderness="10 seconds")`` into a
Delta append table), ``EpochRunner.run_available()`` with ``max_records_per_epoch`` =
``--records``: one file per epoch. The peer (``bench/peer_sss.py``'s settings): the
files as a Parquet file stream, ``maxFilesPerTrigger=1``, ``availableNow``; RocksDB
state store with changelog checkpointing; shuffle partitions = shards;
``withWatermark("event_time", "10 seconds").groupBy("card").transformWithStateInPandas(
..., outputMode="Append", timeMode="EventTime")``; ``foreachBatch`` -> Delta append
with its app transaction. The peer runs the same ``VelocityAlert`` object's code,
unchanged (both engines hand the processor UTC's wall clock without a zone).

Each engine runs in a process of its own (``--child``), one after the other, so one's
JVM and memory do not disturb the other's. Prints per epoch (Spark: per micro-batch)
seconds and records/s; per engine the medians of epochs 2..N, ours/Spark, the state on
disk (ours: the last epoch's snapshots; Spark: its checkpoint's ``state/`` folder, every
version it retains, as ``du`` counts it; both checkpoints whole beside), the
driver's peak RSS (the Python process and its JVM) and the Python workers' (ours: the
shard tasks' ``peak_rss_mib``, each task's own; Spark: VmHWM of the ``pyspark.daemon``
workers over their life, sampled after every batch); the drivers' Python peak is VmHWM of
``/proc/self`` (``ru_maxrss`` would include the parent's peak, ``bench/compare.py``
says why); ``--profile``: the median phases of an epoch. Then checks that both
Delta tables hold the same alerts (sorted rows equal; else the first differing rows,
exit 1). Writes bench/results/process.json. The machine is shared and noisy: compare
ratios within a run.

Why the timers differ but the alerts do not: Spark fires event-time timers at the
previous micro-batch's watermark, ours at the epoch's own (so ours holds about one
epoch fewer of them); a timer only drops payments that every later (on time) payment's
window excludes anyway. The alerts do depend on the order of a card's rows within an
epoch (out-of-order records: a later payment drops older ones from ``recent`` before
an earlier one arrives: 3 files of the defaults, each card's rows sorted by event time
instead of taken in log order, change the alerts of 730 of the 1,000 cards). Ours hands them over in log order,
by rule; Spark promises no order, and here gives the file's (one scan task per file, a
stable sort by card). A mismatch after a change of sizes may be that, not a bug.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402

from bench.common import finish  # noqa: E402
from bench.compare import dir_bytes, jvm_peak_rss_mib, machine, self_peak_rss_mib  # noqa: E402
from volley_dagster.demo.velocity import VelocityAlert  # noqa: E402

MiB = 2**20
OUT_OF_ORDERNESS = "10 seconds"  # velocity_pipeline's max_out_of_orderness
ALERT_COLUMNS = ["card", "alert_at_ms", "payments", "total"]


# ---------------------------------------------------------------- measuring


def _status(pid: int | str) -> str | None:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None


def _field(status: str, name: str) -> str | None:
    line = next((x for x in status.splitlines() if x.startswith(name + ":")), None)
    return None if line is None else line.split(":", 1)[1].strip()


def spark_worker_peaks_mib() -> dict[int, float]:
    """VmHWM of every Python worker of this process's Spark: the children of the
    ``pyspark.daemon`` its JVM started (the daemon forks one per worker)."""
    procs: dict[int, tuple[int, str, str]] = {}  # pid -> (ppid, name, status)
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        ppid = _field(text, "PPid")
        if ppid is not None:
            procs[int(status.parent.name)] = (int(ppid), _field(text, "Name") or "", text)
    jvms = {pid for pid, (ppid, name, _) in procs.items() if ppid == os.getpid() and name == "java"}
    daemons = set()
    for pid, (ppid, _, _) in procs.items():
        if ppid in jvms:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"pyspark.daemon" in cmd:
                daemons.add(pid)
    peaks = {}
    for pid, (ppid, _, text) in procs.items():
        if ppid in daemons:
            hwm = _field(text, "VmHWM")
            if hwm is not None:
                peaks[pid] = int(hwm.split()[0]) / 1024
    return peaks


def spark_session(shards: int, log_level: str = "WARN") -> Any:
    from volley_dagster.spark.session import get_or_create_spark

    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(shards)})
    spark.sparkContext.setLogLevel(log_level)
    return spark


# ---------------------------------------------------------------- ours


OURS_TOP_LEVEL = ("read_transform", "state_stage", "sinks")


def run_ours(args: argparse.Namespace, events: Path, work: Path) -> dict[str, Any]:
    from volley_dagster import EpochRunner
    from volley_dagster.demo.velocity import velocity_pipeline
    from volley_dagster.deploy import TableSettings
    from volley_dagster.settings import RunSettings

    spark = spark_session(args.shards)
    pipeline = velocity_pipeline(events, TableSettings(str(work / "tables")), cards=args.cards,
                                 window_ms=args.window_ms, threshold=args.threshold, shards=args.shards)
    runner = EpochRunner(pipeline, work / "state", RunSettings(max_records_per_epoch=args.records), spark=spark)
    t = time.perf_counter()
    results = runner.run_available()
    wall = time.perf_counter() - t
    epochs = []
    for r in results:
        total = r.durations["total"]
        phases = {k.removesuffix("_shard_sum"): v for k, v in r.durations.items() if k != "total"}
        phases.update({f"sink_{name}": s.seconds or 0.0 for name, s in r.sinks.items()})
        phases["rest"] = total - sum(phases.get(k, 0.0) for k in OURS_TOP_LEVEL)
        epochs.append({"epoch": r.epoch, "records": r.records_in, "seconds": total, "records_out": r.records_out,
                       "late": r.late_records, "figures": dict(r.figures), "state_bytes": r.state_bytes,
                       "state_bytes_written": r.state_bytes_written, "phases": phases,
                       "worker_peak_rss_mib": max(s.peak_rss_mib for s in r.shards.values())})
    out = {"engine": "ours", "epochs": epochs, "wall_s": wall,
           "state_bytes": results[-1].state_bytes if results else 0,
           "checkpoint_bytes": dir_bytes(work / "state"),
           "worker_peak_rss_mib": max((e["worker_peak_rss_mib"] for e in epochs), default=0.0),
           "delta_uri": str(work / "tables" / "delta" / "velocity_alerts")}
    runner.wait_for_compactions()
    out["driver_py_peak_rss_mib"] = self_peak_rss_mib()
    out["driver_jvm_peak_rss_mib"] = jvm_peak_rss_mib()
    spark.stop()
    return out


# ---------------------------------------------------------------- the peer


PEER_TOP_LEVEL = ("latestOffset", "getBatch", "queryPlanning", "addBatch", "walCommit", "commitOffsets")


def run_peer(args: argparse.Namespace, events: Path, work: Path) -> dict[str, Any]:
    from pyspark.sql import functions as F

    from bench.peer_sss import (
        EVENT_SCHEMA,
        PEER_CONF,
        _delta_writer,
        _set_confs,
        executed_batches,
        run_to_end,
    )

    # ERROR: a WARN per timer registered twice (two payments of a card in one millisecond)
    spark = spark_session(args.shards, log_level="ERROR")
    checkpoint = work / "checkpoint"
    delta_uri = str((work / "alerts").absolute())
    _set_confs(spark, {**PEER_CONF, "spark.sql.shuffle.partitions": str(args.shards),
                       "spark.sql.streaming.numRecentProgressUpdates": str(max(100, 2 * args.files + 10))})
    sink_stats: dict[int, dict[str, Any]] = {}
    workers: dict[int, float] = {}
    write = _delta_writer(delta_uri, "peer-process", False, sink_stats)

    def write_and_sample(batch_df: Any, batch_id: int) -> None:
        write(batch_df, batch_id)
        for pid, peak in spark_worker_peaks_mib().items():  # the batch's workers, idle now
            workers[pid] = max(peak, workers.get(pid, 0.0))

    rows = (spark.readStream.format("parquet").schema(EVENT_SCHEMA).option("maxFilesPerTrigger", 1)
            .load(str(events))
            .withColumn("card", F.col("merchant_id") % args.cards)
            .select("card", "event_time", "amount")
            .withWatermark("event_time", OUT_OF_ORDERNESS))
    alerts = rows.groupBy("card").transformWithStateInPandas(
        statefulProcessor=VelocityAlert(args.window_ms, args.threshold), outputStructType=VelocityAlert.OUTPUT,
        outputMode="Append", timeMode="EventTime")
    query = (alerts.writeStream.queryName(f"peer_process_{os.getpid()}_{int(time.time())}")
             .outputMode("append").option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).foreachBatch(write_and_sample))
    progresses, wall = run_to_end(query)
    for pid, peak in spark_worker_peaks_mib().items():
        workers[pid] = max(peak, workers.get(pid, 0.0))

    batches = []
    for b in executed_batches(progresses, sink_stats):
        phases = dict(b["phases"])
        phases.pop("triggerExecution", None)
        phases["rest"] = b["seconds"] - sum(phases.get(k, 0.0) for k in PEER_TOP_LEVEL)
        state = b["state"]
        batches.append({"epoch": b["batch_id"] + 1, "records": b["records"], "seconds": b["seconds"],
                        "records_out": (b["sink"] or {}).get("rows"), "phases": phases,
                        "state_rows": state.get("numRowsTotal"),
                        # a fired timer is deleted; numExpiredTimers stays 0 with the Python runner
                        "timers_fired": (state.get("customMetrics") or {}).get("numDeletedTimers"),
                        "late": state.get("numRowsDroppedByWatermark"),
                        "state": state, "watermark": b["watermark"]})
    out = {"engine": "spark", "epochs": [b for b in batches if b["records"]],
           "no_data_batches": [b for b in batches if not b["records"]], "wall_s": wall,
           "state_bytes": dir_bytes(checkpoint / "state"), "checkpoint_bytes": dir_bytes(checkpoint),
           "worker_peak_rss_mib": max(workers.values(), default=0.0), "workers_seen": len(workers),
           "delta_uri": delta_uri, "driver_py_peak_rss_mib": self_peak_rss_mib(),
           "driver_jvm_peak_rss_mib": jvm_peak_rss_mib()}
    # the state stores' maintenance thread, left running, prints a stack trace as the SparkEnv stops
    spark._jvm.org.apache.spark.sql.execution.streaming.state.StateStore.stop()
    spark.stop()
    return out


# ---------------------------------------------------------------- orchestration


def child(args: argparse.Namespace) -> None:
    events, work = Path(args.events), Path(args.work)
    out = run_ours(args, events, work) if args.child == "ours" else run_peer(args, events, work)
    Path(args.out).write_text(json.dumps(out))


def spawn(engine: str, args: argparse.Namespace, events: Path, work: Path) -> dict[str, Any]:
    place = work / engine
    place.mkdir(parents=True, exist_ok=True)
    out = place / "result.json"
    cmd = [sys.executable, __file__, "--child", engine, "--events", str(events), "--work", str(place),
           "--out", str(out), "--files", str(args.files), "--records", str(args.records), "--cards", str(args.cards),
           "--shards", str(args.shards), "--window-ms", str(args.window_ms), "--threshold", str(args.threshold)]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - t
    return result


def alerts_of(delta_uri: str) -> pa.Table:
    """An engine's alerts, sorted by every column (empty when it wrote none)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        t = DeltaTable(delta_uri).to_pyarrow_table(columns=ALERT_COLUMNS)
    except TableNotFoundError:
        return pa.table({c: pa.array([], pa.int64()) for c in ALERT_COLUMNS})
    t = pa.table({c: t[c].cast(pa.float64() if c == "total" else pa.int64()) for c in ALERT_COLUMNS})
    return t.sort_by([(c, "ascending") for c in ALERT_COLUMNS])


def compare_alerts(ours: pa.Table, peer: pa.Table, show: int = 5) -> list[str]:
    """Empty when the sorted rows are equal; else what differs, with the first differing rows."""
    a, b = ours.to_pylist(), peer.to_pylist()
    if a == b:
        return []
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    lines = [f"alerts differ: ours {len(a):,} rows, spark {len(b):,}; first difference at sorted row {first:,}"]
    lines += [f"  ours  {r}" for r in a[first:first + show]] or ["  ours  (no more rows)"]
    lines += [f"  spark {r}" for r in b[first:first + show]] or ["  spark (no more rows)"]
    return lines


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Medians of epochs 2..N (all of them when there is one)."""
    rows = run["epochs"]
    warm = rows[1:] or rows
    phases = {name: statistics.median(r["phases"].get(name, 0.0) for r in warm)
              for name in {p for r in warm for p in r["phases"]}}
    return {"epochs": len(rows), "median_s": statistics.median(r["seconds"] for r in warm),
            "median_records_per_s": statistics.median(r["records"] / r["seconds"] for r in warm if r["seconds"]),
            "records": sum(r["records"] for r in rows), "phases": phases}


def print_profile(label: str, phases: dict[str, float], order: tuple[str, ...]) -> None:
    first = [p for p in order if p in phases]
    rest = sorted(p for p in phases if p not in order)
    print(f"  {label}: " + ", ".join(f"{p} {phases[p]:.2f}" for p in first + rest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8, help="event files = epochs = micro-batches")
    parser.add_argument("--records", type=int, default=20_000, help="records per file")
    parser.add_argument("--keys", type=int, default=10_000, help="merchants in the log")
    parser.add_argument("--cards", type=int, default=1_000, help="card = merchant_id %% cards (the processor's key)")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--window-ms", type=int, default=10_000)
    parser.add_argument("--threshold", type=int, default=15, help="payments within the window that raise an alert")
    parser.add_argument("--events-per-second", type=float, default=1000.0, help="of event time, in the log")
    parser.add_argument("--disorder-s", type=float, default=5.0, help="how out of order records are (< 10 s: none late)")
    parser.add_argument("--engines", default="ours,spark", help="ours,spark (default both)")
    parser.add_argument("--profile", action="store_true", help="also print the median phases of an epoch per engine")
    parser.add_argument("--workdir", default=None, help="keep the data and state here (default: a temp dir, removed)")
    parser.add_argument("--child", choices=("ours", "spark"), help=argparse.SUPPRESS)
    parser.add_argument("--events", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from bench.peer_sss import order_file_mtimes
    from volley_dagster.demo.events import generate

    engines = [e for e in ("ours", "spark") if e in args.engines.split(",")]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-bench-process-"))
    shutil.rmtree(work, ignore_errors=True)
    events = work / "events"
    generate(events, args.files, args.records, args.keys, events_per_second=args.events_per_second,
             disorder_s=args.disorder_s)
    order_file_mtimes(events)  # Spark's file source takes new files by mtime: name order
    print(f"{os.cpu_count()} cores; {args.files} files x {args.records:,} records, {args.keys:,} merchants -> "
          f"{args.cards:,} cards, {args.shards} shards; VelocityAlert(window_ms={args.window_ms:,}, "
          f"threshold={args.threshold}), {args.events_per_second:g} events/s of event time, disorder "
          f"{args.disorder_s:g} s, watermark {OUT_OF_ORDERNESS}")

    runs = {engine: spawn(engine, args, events, work) for engine in engines}

    print(f"\n{'epoch':>5} {'engine':>6} {'records':>8} {'s':>6} {'rec/s':>9} {'alerts':>7} {'timers':>7}")
    for i in range(max(len(r["epochs"]) for r in runs.values())):
        for label, run in runs.items():
            if i < len(run["epochs"]):
                r = run["epochs"][i]
                timers = r["figures"].get("process_timers_fired") if label == "ours" else r.get("timers_fired")
                print(f"{r['epoch']:>5} {label:>6} {r['records']:>8,} {r['seconds']:>6.2f} "
                      f"{r['records'] / r['seconds'] if r['seconds'] else 0:>9,.0f} "
                      f"{'-' if r['records_out'] is None else format(r['records_out'], ','):>7} "
                      f"{'-' if timers is None else format(timers, ','):>7}")
    for x in runs.get("spark", {}).get("no_data_batches", []):
        print(f"{x['epoch']:>5} {'spark':>6} {'no-data':>8} {x['seconds']:>6.2f} {'':>9} "
              f"{'-' if x['records_out'] is None else format(x['records_out'], ','):>7} "
              f"{'-' if x['timers_fired'] is None else format(x['timers_fired'], ','):>7}")
    print("(timers: fired in the epoch, Spark's numDeletedTimers; Spark fires at the previous batch's watermark, "
          "ours at the epoch's own)")

    summary = {label: summarize(run) for label, run in runs.items()}
    n = max(s["epochs"] for s in summary.values())
    print(f"\nmedian of epochs 2..{n}; state on disk after the last epoch (ours: its snapshots; spark: "
          "checkpoint/state/); peak RSS in MiB")
    print(f"{'engine':>6} {'rec/s':>9} {'s/epoch':>8} {'state MiB':>10} {'ckpt MiB':>9} {'driver py':>10} "
          f"{'driver JVM':>10} {'py workers':>10} {'wall s':>7}")
    for label, s in summary.items():
        run = runs[label]
        print(f"{label:>6} {s['median_records_per_s']:>9,.0f} {s['median_s']:>8.2f} {run['state_bytes'] / MiB:>10.2f} "
              f"{run['checkpoint_bytes'] / MiB:>9.2f} {run['driver_py_peak_rss_mib']:>10.0f} "
              f"{run['driver_jvm_peak_rss_mib']:>10.0f} {run['worker_peak_rss_mib']:>10.0f} {run['wall_s']:>7.1f}")
    ratios: dict[str, float] = {}
    if len(summary) == 2:
        o, p = summary["ours"], summary["spark"]
        ratios = {"records_per_s_ours_to_spark": o["median_records_per_s"] / p["median_records_per_s"],
                  "seconds_per_epoch_ours_to_spark": o["median_s"] / p["median_s"]}
        print(f"ours/spark: {ratios['records_per_s_ours_to_spark']:.2f}x records/s, "
              f"{ratios['seconds_per_epoch_ours_to_spark']:.2f}x seconds per epoch")
    if args.profile:
        print(f"\nmedian phases of epochs 2..{n}, seconds (ours: *_shard_sum summed over the shards, inside "
              "state_stage, pre_step and side_output inside read_transform; spark: its progress's durationMs, fn_* "
              "inside addBatch)")
        for label, s in summary.items():
            print_profile(label, s["phases"], OURS_TOP_LEVEL if label == "ours" else PEER_TOP_LEVEL)

    problems: list[str] = []
    tables = {label: alerts_of(run["delta_uri"]) for label, run in runs.items()}
    if len(tables) == 2:
        diff = compare_alerts(tables["ours"], tables["spark"])
        if diff:
            problems.append(diff[0])
            print("\nCHECK FAILED: " + "\n".join(diff))
            print("(the alerts depend on each card's row order within an epoch: ours is the log's, Spark's "
                  "is not promised; see the module doc)")
        else:
            print(f"\ncheck: OK, both Delta tables hold the same {tables['ours'].num_rows:,} alerts (sorted rows equal)")
    for label, run in runs.items():
        late = sum(e.get("late") or 0 for e in run["epochs"])
        if late:
            problems.append(f"{label}: {late} late records (the bench expects none: lower --disorder-s)")

    report = {"args": vars(args), "machine": machine(), "median_warm": summary, "ratios": ratios, "runs": runs,
              "alerts": {label: t.num_rows for label, t in tables.items()}, "problems": problems}
    path = finish("process", report, work, keep=bool(args.workdir))
    print(f"wrote {path}")
    if problems:
        print("PROBLEMS: " + "; ".join(problems))
        sys.exit(1)


if __name__ == "__main__":
    main()
