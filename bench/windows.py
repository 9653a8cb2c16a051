"""Throughput of a 1-minute tumbling window per merchant, with and without a bound
on the pending-window index, against the stateless Spark floor, in one run.

    ./dev bench windows [--records 10000000] [--keys 1000000] [--epochs 10] [--bound 10000]

Both pipelines read the same files (30 s out-of-orderness in the data and in the
watermark) and append fired windows to Delta. Prints per-epoch figures and the
medians, and the peak RSS of the Spark Python workers (the shard tasks) and of
the driver; writes bench/results/windows.json.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import functions as F  # noqa: E402

from bench.common import finish, log_arguments  # noqa: E402
from volley_dagster import DeltaSink, EpochRunner, FileLog, Pipeline, count, max_, sum_, tumbling  # noqa: E402
from volley_dagster.demo.events import generate  # noqa: E402
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402


def minute_windows(events: Path, tables: Path, name: str, shards: int, bound: int | None) -> Pipeline:
    return (
        Pipeline(name)
        .source(FileLog(events, format="parquet"))
        .key_by("merchant_id")
        .window(tumbling("1 minute"), on="event_time", max_out_of_orderness="30 seconds", max_pending_windows=bound)
        .aggregate(events=count(), total=sum_("amount"), largest=max_("amount"))
        .sink(DeltaSink(tables / name, mode="append"))
        .with_shards(shards)
    )


def stateless_floor(spark, file: str) -> float:
    """The same epoch as a plain Spark batch: per merchant and minute, no state, no sink."""
    t = time.perf_counter()
    (
        spark.read.parquet(file)
        .groupBy("merchant_id", F.window("event_time", "1 minute"))
        .agg(F.count(F.lit(1)), F.sum("amount"), F.max("amount"))
        .toArrow()
    )
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser)
    parser.add_argument("--bound", type=int, default=10_000, help="max_pending_windows per shard for the bounded run")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-bench-windows-"))
    shutil.rmtree(work, ignore_errors=True)
    per_epoch = args.records // args.epochs
    names = generate(work / "events", args.epochs, per_epoch, args.keys)
    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(args.shards)})
    runners = {
        label: EpochRunner(minute_windows(work / "events", work / "tables", label, args.shards, bound), work / "state" / label, RunSettings(max_records_per_epoch=per_epoch), spark=spark)
        for label, bound in (("unbounded", None), ("bounded", args.bound))
    }
    print(f"{args.records:,} events, {args.keys:,} keys, {args.epochs} epochs, {args.shards} shards; "
          f"bounded: max_pending_windows={args.bound:,} per shard")
    print(f"{'epoch':>5} {'run':>9} {'rec/s':>10} {'total s':>8} {'side+wm':>8} {'stage':>7} {'merge':>7} "
          f"{'fired':>9} {'late':>6} {'resident':>9} {'evicted':>8} {'worker MiB':>10} {'floor s':>8}")
    rows = []
    for i in range(args.epochs):
        floor = stateless_floor(spark, str(work / "events" / names[i]))
        for label, runner in runners.items():
            r = runner.run_next()
            shards = r.shards.values()
            row = {
                "epoch": r.epoch, "run": label, "records_per_s": r.records_per_second, "total_s": r.durations["total"],
                "side_outputs_s": r.durations["read_transform"], "state_stage_s": r.durations["state_stage"],
                "merge_s": r.durations["merge_shard_sum"], "windows_fired": r.records_out, "late": r.late_records,
                "pending_resident": sum(s.operator.figures["pending_resident"] for s in shards),
                "pending_evicted": sum(s.operator.figures["pending_evicted"] for s in shards),
                "worker_peak_rss_mib": max(s.peak_rss_mib for s in shards), "floor_s": floor,
            }
            rows.append(row)
            print(f"{row['epoch']:>5} {label:>9} {row['records_per_s']:>10,.0f} {row['total_s']:>8.2f} "
                  f"{row['side_outputs_s']:>8.2f} {row['state_stage_s']:>7.2f} {row['merge_s']:>7.2f} "
                  f"{row['windows_fired']:>9,} {row['late']:>6,} {row['pending_resident']:>9,} "
                  f"{row['pending_evicted']:>8,} {row['worker_peak_rss_mib']:>10.0f} {floor:>8.2f}")

    summary = {"records": args.records, "keys": args.keys, "epochs": args.epochs, "shards": args.shards,
               "bound": args.bound, "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               "epochs_detail": rows, "median_warm": {}}
    print()
    for label in runners:
        warm = [r for r in rows if r["run"] == label and r["epoch"] > 1]
        med = {k: statistics.median(r[k] for r in warm) for k in warm[0] if k not in ("epoch", "run")}
        med["worker_peak_rss_mib"] = max(r["worker_peak_rss_mib"] for r in rows if r["run"] == label)
        summary["median_warm"][label] = med
        print(f"{label:>9}: median of epochs 2..{args.epochs}: {med['records_per_s']:,.0f} records/s, "
              f"{med['total_s']:.2f} s/epoch ({med['total_s'] / med['floor_s']:.2f}x the stateless floor "
              f"{med['floor_s']:.2f} s); peak Python worker RSS {med['worker_peak_rss_mib']:.0f} MiB")
    u, b = summary["median_warm"]["unbounded"], summary["median_warm"]["bounded"]
    print(f"bounded / unbounded: {b['total_s'] / u['total_s']:.2f}x time, "
          f"{b['worker_peak_rss_mib'] / u['worker_peak_rss_mib']:.2f}x worker RSS; "
          f"driver peak RSS {summary['driver_peak_rss_mib']:.0f} MiB")
    finish("windows", summary, work, keep=bool(args.workdir))


if __name__ == "__main__":
    main()
