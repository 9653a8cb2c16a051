"""What a state TTL costs: the same running aggregate over the same files with and
without ``ttl_epochs``, each into a Delta upsert table, and the stateless Spark floor
(read, group, collect: no state, no sink), in one run. With the TTL, idle keys expire
and the Delta MERGE deletes their rows in the epoch's commit.

    ./dev bench ttl [--records 2000000] [--keys 1000000] [--epochs 6] [--ttl-epochs 2]

Keys are uniform, so with more keys than an epoch's records most keys are idle in any
one epoch and many expire. Prints per-epoch seconds, keys expired, state keys, the
medians of epochs 2.. and the ratios; writes bench/results/ttl.json. The machine is
shared and noisy: compare ratios within a run.
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
from volley_dagster import DeltaSink, EpochRunner, FileLog, Pipeline, count, sum_  # noqa: E402
from volley_dagster.demo.events import generate  # noqa: E402
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402


def spend(events: Path, table: Path, shards: int, ttl_epochs: int | None) -> Pipeline:
    return (Pipeline("spend").source(FileLog(events, format="parquet")).key_by("merchant_id")
            .aggregate(spent=sum_("amount"), payments=count(), ttl_epochs=ttl_epochs)
            .sink(DeltaSink(table, mode="upsert")).with_shards(shards))



def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser, records=2_000_000, keys=1_000_000, epochs=6)
    parser.add_argument("--ttl-epochs", type=int, default=2)
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    per_epoch = args.records // args.epochs
    names = generate(work / "events", args.epochs, per_epoch, args.keys)
    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(args.shards)})
    plain = EpochRunner(spend(work / "events", work / "plain", args.shards, None), work / "state-plain", RunSettings(max_records_per_epoch=per_epoch), spark=spark)
    ttl = EpochRunner(spend(work / "events", work / "ttl", args.shards, args.ttl_epochs), work / "state-ttl", RunSettings(max_records_per_epoch=per_epoch), spark=spark)
    print(f"{args.records:,} events over {args.keys:,} keys, {args.epochs} epochs, {args.shards} shards, "
          f"ttl_epochs={args.ttl_epochs}, a Delta upsert table each")
    print(f"{'epoch':>5} {'plain s':>8} {'ttl s':>7} {'x plain':>7} {'floor s':>8} {'expired':>9} "
          f"{'merge plain s':>13} {'merge ttl s':>11} {'plain rows':>11} {'ttl rows':>9}")
    rows = []
    for i in range(args.epochs):
        a, b = plain.run_next(), ttl.run_next()
        assert a is not None and b is not None
        row = {"epoch": b.epoch, "plain_s": a.durations["total"], "ttl_s": b.durations["total"],
               "floor_s": aggregate_floor(spark, str(work / "events" / names[i])), "keys_expired": b.figures["keys_expired"],
               "merge_plain_s": a.durations["merge_shard_sum"], "merge_ttl_s": b.durations["merge_shard_sum"],
               "plain_rows": plain.pipeline.sinks[0].row_count(), "ttl_rows": ttl.pipeline.sinks[0].row_count()}
        rows.append(row)
        print(f"{row['epoch']:>5} {row['plain_s']:>8.2f} {row['ttl_s']:>7.2f} {row['ttl_s'] / row['plain_s']:>7.2f} "
              f"{row['floor_s']:>8.2f} {row['keys_expired']:>9,} {row['merge_plain_s']:>13.2f} "
              f"{row['merge_ttl_s']:>11.2f} {row['plain_rows']:>11,} {row['ttl_rows']:>9,}")
    warm = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in warm) for k in ("plain_s", "ttl_s", "floor_s", "merge_plain_s", "merge_ttl_s")}
    summary = {**vars(args), "median_warm": med, "ratio_ttl_to_plain": med["ttl_s"] / med["plain_s"],
               "ratio_ttl_to_floor": med["ttl_s"] / med["floor_s"], "epochs_detail": rows}
    print(f"\nmedian of epochs 2..{args.epochs}: plain {med['plain_s']:.2f} s, ttl {med['ttl_s']:.2f} s "
          f"({summary['ratio_ttl_to_plain']:.2f}x plain), the stateless floor {med['floor_s']:.2f} s "
          f"({summary['ratio_ttl_to_floor']:.2f}x the floor); shard merge time summed over shards: plain "
          f"{med['merge_plain_s']:.2f} s, ttl {med['merge_ttl_s']:.2f} s")
    finish("ttl", summary, work, keep=bool(args.workdir))


if __name__ == "__main__":
    main()
