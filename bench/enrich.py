"""What an enrichment costs: the same running aggregate over the same files, with and
without ``enrich`` (a Delta dimension of one row per key, pinned per epoch), and the
stateless Spark floor of the join (read, join, group, collect: no state, no sink), in
one run.

    ./dev bench enrich [--records 2000000] [--keys 200000] [--epochs 5] [--how inner]

Prints per-epoch seconds, medians of epochs 2.. and the ratios; writes
bench/results/enrich.json. The machine is shared and noisy: compare ratios within a run.
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

import pyarrow as pa  # noqa: E402
from deltalake import DeltaTable, write_deltalake  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

from bench.common import finish, log_arguments  # noqa: E402
from volley_dagster import DeltaDimension, EpochRunner, FileLog, Pipeline, count, sum_  # noqa: E402
from volley_dagster.demo.events import generate  # noqa: E402
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402


def fees(events: Path, merchants: Path | None, how: str, shards: int) -> Pipeline:
    """Fees per merchant; without ``merchants``, one flat rate (the same work minus the join)."""
    pipeline = Pipeline("fees").source(FileLog(events, format="parquet")).where("status = 'active'")
    if merchants is not None:
        pipeline = pipeline.enrich(DeltaDimension(merchants, name="merchants"), on="merchant_id",
                                   columns=["fee_rate"], how=how)
    else:
        pipeline = pipeline.with_column("fee_rate", "0.02")
    return (pipeline.with_column("fee", "amount * fee_rate").key_by("merchant_id")
            .aggregate(fees=sum_("fee"), payments=count()).with_shards(shards))


def join_floor(spark, file: str, dimension_files: list[str]) -> float:
    """The epoch's join and aggregate as a plain Spark batch (it reads the table's files too)."""
    t = time.perf_counter()
    dim = spark.read.parquet(*dimension_files)
    (spark.read.parquet(file).where("status = 'active'").join(dim, "merchant_id")
     .groupBy("merchant_id").agg(F.sum(F.col("amount") * F.col("fee_rate")), F.count(F.lit(1))).toArrow())
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser, records=2_000_000, keys=200_000, epochs=5)
    parser.add_argument("--how", choices=["left", "inner"], default="inner")
    args = parser.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-bench-"))
    shutil.rmtree(work, ignore_errors=True)
    per_epoch = args.records // args.epochs
    names = generate(work / "events", args.epochs, per_epoch, args.keys)
    ids = [m for m in range(args.keys) if m % 10]  # a tenth of the merchants are not in the table
    write_deltalake(work / "merchants", pa.table({"merchant_id": pa.array(ids, pa.int64()),
                                                  "fee_rate": [(m % 5 + 1) / 100 for m in ids]}))
    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(args.shards)})
    plain = EpochRunner(fees(work / "events", None, args.how, args.shards), work / "state-plain", RunSettings(max_records_per_epoch=per_epoch), spark=spark)
    enriched = EpochRunner(fees(work / "events", work / "merchants", args.how, args.shards), work / "state-enriched", RunSettings(max_records_per_epoch=per_epoch), spark=spark)
    print(f"{args.records:,} events over {args.keys:,} keys, {args.epochs} epochs, {args.shards} shards, "
          f"how={args.how}, {len(ids):,} dimension rows")
    print(f"{'epoch':>5} {'plain s':>8} {'enriched s':>10} {'x plain':>7} {'join floor s':>12} {'unmatched':>10}")
    rows = []
    for i in range(args.epochs):
        a, b = plain.run_next(), enriched.run_next()
        assert a is not None and b is not None
        floor = join_floor(spark, str(work / "events" / names[i]), DeltaTable(work / "merchants").file_uris())
        row = {"epoch": b.epoch, "plain_s": a.durations["total"], "enriched_s": b.durations["total"],
               "floor_s": floor, "unmatched": b.enrichments["merchants"].unmatched}
        rows.append(row)
        print(f"{row['epoch']:>5} {row['plain_s']:>8.2f} {row['enriched_s']:>10.2f} "
              f"{row['enriched_s'] / row['plain_s']:>7.2f} {floor:>12.2f} {row['unmatched']:>10,}")
    warm = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in warm) for k in ("plain_s", "enriched_s", "floor_s")}
    summary = {**vars(args), "median_warm": med, "ratio_enriched_to_plain": med["enriched_s"] / med["plain_s"],
               "ratio_enriched_to_floor": med["enriched_s"] / med["floor_s"], "epochs_detail": rows}
    print(f"\nmedian of epochs 2..{args.epochs}: plain {med['plain_s']:.2f} s, enriched {med['enriched_s']:.2f} s "
          f"({summary['ratio_enriched_to_plain']:.2f}x plain), the join's stateless floor {med['floor_s']:.2f} s "
          f"({summary['ratio_enriched_to_floor']:.2f}x the floor)")
    finish("enrich", summary, work, keep=bool(args.workdir))


if __name__ == "__main__":
    main()
