"""What a deduplication costs: the same running aggregate over the same files with
and without ``deduplicate(on="event_id", within=...)``, each into a Delta upsert table,
and the stateless Spark floor (read, group, collect), in one run. Each file from the
second on re-sends the first ``--resend`` share of the file before it in place of its
own last records, so the deduplication drops that many per epoch.

    ./dev bench dedup [--records 1000000] [--keys 100000] [--epochs 6] [--resend 0.05]

Prints per-epoch seconds, duplicates, the medians of epochs 2.. and the ratios; writes
bench/results/dedup.json. The machine is shared and noisy: compare ratios within a run.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import aggregate_floor, finish, log_arguments  # noqa: E402
from bench.workloads import resend  # noqa: E402
from volley_dagster import DeltaSink, EpochRunner, FileLog, Pipeline, count, sum_  # noqa: E402
from volley_dagster.demo.events import generate  # noqa: E402
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402


def spend(events: Path, table: Path, shards: int, dedup: bool) -> Pipeline:
    pipeline = Pipeline("spend").source(FileLog(events, format="parquet"))
    if dedup:
        pipeline = pipeline.deduplicate(on="event_id", within="10 minutes", event_time="event_time")
    return (pipeline.key_by("merchant_id").aggregate(spent=sum_("amount"), payments=count())
            .sink(DeltaSink(table, mode="upsert")).with_shards(shards))



def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser, records=1_000_000, keys=100_000, epochs=6)
    parser.add_argument("--resend", type=float, default=0.05)
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    per_epoch = args.records // args.epochs
    names = generate(work / "events", args.epochs, per_epoch, args.keys)
    resend(work / "events", names, args.resend)
    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(args.shards)})
    plain = EpochRunner(spend(work / "events", work / "plain", args.shards, False), work / "state-plain", RunSettings(max_records_per_epoch=per_epoch), spark=spark)
    dedup = EpochRunner(spend(work / "events", work / "dedup", args.shards, True), work / "state-dedup", RunSettings(max_records_per_epoch=per_epoch), spark=spark)
    print(f"{args.records:,} events over {args.keys:,} keys, {args.epochs} epochs, {args.shards} shards, "
          f"{args.resend:.0%} of each epoch re-sent, a Delta upsert table each")
    print(f"{'epoch':>5} {'plain s':>8} {'dedup s':>8} {'x plain':>7} {'floor s':>8} {'duplicates':>10} "
          f"{'remembered':>10} {'forgotten':>9}")
    rows = []
    for i in range(args.epochs):
        a, b = plain.run_next(), dedup.run_next()
        assert a is not None and b is not None
        figures = [s.operator.figures for s in b.shards.values()]
        row = {"epoch": b.epoch, "plain_s": a.durations["total"], "dedup_s": b.durations["total"],
               "floor_s": aggregate_floor(spark, str(work / "events" / names[i])), "duplicates": b.figures["duplicates"],
               "remembered": sum(f.get("dedup_keys_remembered", 0) for f in figures),
               "forgotten": sum(f.get("dedup_keys_forgotten", 0) for f in figures)}
        rows.append(row)
        print(f"{row['epoch']:>5} {row['plain_s']:>8.2f} {row['dedup_s']:>8.2f} {row['dedup_s'] / row['plain_s']:>7.2f} "
              f"{row['floor_s']:>8.2f} {row['duplicates']:>10,} {row['remembered']:>10,} {row['forgotten']:>9,}")
    warm = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in warm) for k in ("plain_s", "dedup_s", "floor_s")}
    summary = {**vars(args), "median_warm": med, "ratio_dedup_to_plain": med["dedup_s"] / med["plain_s"],
               "ratio_dedup_to_floor": med["dedup_s"] / med["floor_s"], "epochs_detail": rows}
    print(f"\nmedian of epochs 2..{args.epochs}: plain {med['plain_s']:.2f} s, dedup {med['dedup_s']:.2f} s "
          f"({summary['ratio_dedup_to_plain']:.2f}x plain), the stateless floor {med['floor_s']:.2f} s "
          f"({summary['ratio_dedup_to_floor']:.2f}x the floor)")
    finish("dedup", summary, work, keep=bool(args.workdir))


if __name__ == "__main__":
    main()
