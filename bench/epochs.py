"""Epoch throughput of the demo pipeline, phase by phase, against the stateless
Spark floor over the same files in the same run.

    ./dev bench epochs [--records 10000000] [--keys 1000000] [--epochs 10] [--keep 3]

Prints a table per epoch and writes bench/results/epochs.json. Figures are
medians; the machine is shared and noisy, so compare ratios within one run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pyspark.sql import functions as F  # noqa: E402

from bench.common import finish, log_arguments  # noqa: E402
from volley_dagster import EpochRunner  # noqa: E402
from volley_dagster.cli import disk_usage  # noqa: E402
from volley_dagster.demo.events import generate  # noqa: E402
from volley_dagster.demo.payments import local_tables, payments_pipeline  # noqa: E402
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402


def stateless_floor(spark, files: list[str]) -> float:
    """The same epoch as a plain Spark batch: read, filter, groupBy, collect. No state, no sink."""
    t = time.perf_counter()
    (
        spark.read.parquet(*files)
        .where("status = 'active'")
        .groupBy("merchant_id")
        .agg(F.sum("amount"), F.count(F.lit(1)), F.avg("amount"), F.max("amount"), F.max_by("event_time", "event_id"))
        .toArrow()
    )
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser)
    parser.add_argument("--keep", type=int, default=3)
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    per_epoch = args.records // args.epochs
    t = time.perf_counter()
    names = generate(work / "events", args.epochs, per_epoch, args.keys)
    print(f"generated {args.records:,} events over {args.keys:,} keys in {time.perf_counter() - t:.1f}s -> {work}")

    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(args.shards)})
    pipeline = payments_pipeline(work / "events", local_tables(work / "tables"), shards=args.shards)
    runner = EpochRunner(pipeline, work / "state", RunSettings(max_records_per_epoch=per_epoch, keep_epochs=args.keep), spark=spark)
    rows = []
    header = (f"{'epoch':>5} {'records':>10} {'rec/s':>10} {'total s':>8} {'read+tf':>8} {'stage':>7} "
              f"{'restore':>8} {'merge':>7} {'flush':>7} {'snap':>7} {'sink':>6} {'floor s':>8} {'x floor':>7} "
              f"{'ckpt written':>12}")
    print(header)
    for i in range(args.epochs):
        result = runner.run_next()
        floor = stateless_floor(spark, [str(work / "events" / names[i])])
        d = result.durations
        row = {
            "epoch": result.epoch,
            "records": result.records_in,
            "records_per_s": result.records_per_second,
            "total_s": d["total"],
            "read_transform_s": d["read_transform"],
            "state_stage_s": d["state_stage"],
            "restore_s": d["restore_shard_sum"],
            "merge_s": d["merge_shard_sum"],
            "flush_s": d["flush_shard_sum"],
            "snapshot_s": d["snapshot_shard_sum"],
            "sinks_s": d["sinks"],
            "floor_s": floor,
            "state_bytes_written": result.state_bytes_written,
            "keys_touched": result.keys_touched,
        }
        rows.append(row)
        print(f"{row['epoch']:>5} {row['records']:>10,} {row['records_per_s']:>10,.0f} {row['total_s']:>8.2f} "
              f"{row['read_transform_s']:>8.2f} {row['state_stage_s']:>7.2f} {row['restore_s']:>8.2f} "
              f"{row['merge_s']:>7.2f} {row['flush_s']:>7.2f} {row['snapshot_s']:>7.2f} {row['sinks_s']:>6.2f} "
              f"{floor:>8.2f} {row['total_s'] / floor:>7.2f} {row['state_bytes_written'] / 2**20:>9.1f} MiB")

    warm = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in warm) for k in warm[0] if k != "epoch"}
    disk = disk_usage(work / "state")
    summary = {
        "records": args.records, "keys": args.keys, "epochs": args.epochs, "shards": args.shards,
        "keep_epochs": args.keep, "median_warm": med,
        "ratio_total_to_floor": med["total_s"] / med["floor_s"],
        "checkpoint_root_bytes": disk, "retained_snapshots": runner.log.retained_snapshots(),
        "epochs_detail": rows,
    }
    print(f"\nmedian of epochs 2..{args.epochs}: {med['records_per_s']:,.0f} records/s, {med['total_s']:.2f} s/epoch "
          f"(read+transform {med['read_transform_s']:.2f}, state stage {med['state_stage_s']:.2f}: restore "
          f"{med['restore_s']:.2f} + merge {med['merge_s']:.2f} + flush {med['flush_s']:.2f} + snapshot "
          f"{med['snapshot_s']:.2f} summed over shards), stateless floor {med['floor_s']:.2f} s "
          f"-> {summary['ratio_total_to_floor']:.2f}x the floor")
    print(f"checkpoint root after {args.epochs} epochs with keep={args.keep}: {disk / 2**20:.1f} MiB on disk "
          f"(snapshots {summary['retained_snapshots']})")
    finish("epochs", summary, work, keep=bool(args.workdir))


if __name__ == "__main__":
    main()
