"""A stream-stream event-time interval join, ours against Spark Structured Streaming's
(watermarks on both sides, RocksDB state store with changelog checkpointing,
``foreachBatch`` into Delta with delta-rs) on the same files, in one run.

    ./dev bench join [--events 200000] [--epochs 6] [--files-per-epoch 1] [--shards 4]
                     [--epoch-minutes 10] [--refunded 0.2] [--outside 0.05] [--disorder-s 20] [--profile]

Two append-only Parquet logs: ``payments`` (payment_id, merchant_id, amount, paid_at)
and ``refunds`` (payment_id, refund_amount, refunded_at; and merchant_id for
``--dataset skewed``, which joins each refund with every payment of its merchant in
the 5 s before it, merchants drawn Zipf with merchant 0 holding 5% of the payments:
one key holding thousands of waiting rows). ``--events`` counts the
records of both logs. A ``--refunded`` share of the payments gets one refund, mostly
0..30 minutes after the payment, an ``--outside`` share of them 30..90 minutes after
(no match); refunds due after the last file's time never arrive. Event time
advances with the files (``--epoch-minutes`` per epoch), and each record lands in a
file up to ``--disorder-s`` after its event time (less than the 1 minute of
out-of-orderness both engines allow, so no record is late). File ``k`` of each side
is ``events-<k>.parquet`` (name order = time order; the name lets
``peer_sss.order_file_mtimes`` order the mtimes Spark picks files by).

Ours: ``Pipeline.sources(...).join(..., between=("0 seconds", "30 minutes"),
how="left", max_out_of_orderness="1 minute")`` into a Delta append table; epoch ``i``'s
files are published into the logs (hardlinks) just before the epoch runs, so each
epoch reads exactly ``--files-per-epoch`` files per side. The peer reads the same
files with ``maxFilesPerTrigger`` = ``--files-per-epoch``, ``availableNow``.

Prints per-epoch seconds, records/s and state rows per side for both engines, the
medians of epochs 2.., ours/peer, the peak state rows per side, and the matched
pairs of each engine against a reference computed from the files (with no late
record, all three must agree). The peer's state per side is read back with Spark's
state data source (``format("statestore")``, ``joinSide``) after the run; its
progress only reports both sides' total (``numRowsTotal``). Writes
bench/results/join.json. The machine is shared and noisy: compare ratios within a run.

Why the state and unmatched figures differ although the pairs agree: Spark evicts
and emits in batch N with the watermark of batch N-1 (one batch later than our
epoch N, which uses its own W[N]), so it holds about one epoch more of each side and
emits each unmatched payment a batch later. Both take the lesser of the two sides'
watermarks (Spark's default ``multipleWatermarkPolicy``, ours by rule).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.types import DoubleType, LongType, StructField, StructType, TimestampType  # noqa: E402

from bench.common import finish  # noqa: E402
from bench.compare import volley_phases  # noqa: E402
from bench.peer_sss import (  # noqa: E402
    ENGINE,
    PEER_CONF,
    _delta_writer,
    _dir_bytes,
    _restore_confs,
    _set_confs,
    executed_batches,
    order_file_mtimes,
    read_peer_table,
    run_to_end,
)
from volley_dagster.demo.events import START_US  # noqa: E402
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402

BETWEEN_S = (0, 30 * 60)  # refunded_at - paid_at, both ends included
OUT_OF_ORDERNESS = "1 minute"
MINUTE_US = 60_000_000
TS = pa.timestamp("us", tz="UTC")

PAYMENTS = pa.schema([("payment_id", pa.int64()), ("merchant_id", pa.int64()), ("amount", pa.float64()),
                      ("paid_at", TS)])
REFUNDS = pa.schema([("payment_id", pa.int64()), ("refund_amount", pa.float64()), ("refunded_at", TS)])
PAYMENTS_SPARK = StructType([StructField("payment_id", LongType()), StructField("merchant_id", LongType()),
                             StructField("amount", DoubleType()), StructField("paid_at", TimestampType())])
REFUNDS_SPARK = StructType([StructField("payment_id", LongType()), StructField("refund_amount", DoubleType()),
                            StructField("refunded_at", TimestampType())])


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class Dataset:
    """What the join is on, and how the merchants are spread."""

    name: str
    key: str  # the join key: each payment's own id, or its merchant
    between_s: tuple[int, int]  # refunded_at - paid_at, both ends included
    top_merchant_share: float | None = None  # Zipf merchants, the first this share of the payments (None: uniform)


DATASETS = {
    "uniform": Dataset("uniform", "payment_id", BETWEEN_S),
    # each refund with every payment of its merchant in the 5 s before it: merchant 0 holds 5% of the
    # payments, so its key holds thousands of rows waiting on each side and emits most of the pairs
    "skewed": Dataset("skewed", "merchant_id", (0, 5), top_merchant_share=0.05),
}


def merchants_of(rng: np.random.Generator, n: int, keys: int, top_share: float | None) -> np.ndarray:
    """Uniform over ``keys`` merchants; or merchant 0 with ``top_share`` of them and the
    rest Zipf (rank ``k`` drawn in proportion to 1/k)."""
    if top_share is None:
        return rng.integers(0, keys, n)
    weights = 1.0 / np.arange(1, keys)
    weights = np.concatenate([[top_share], (1 - top_share) * weights / weights.sum()])
    return rng.choice(keys, size=n, p=weights)


def _draw(payments: int, files: int, slot_us: int, refunded: float, outside: float, disorder_us: int,
          keys: int, seed: int, dataset: Dataset) -> tuple[pa.Table, np.ndarray, pa.Table, np.ndarray]:
    """``payments`` payments and the refunds that arrive before the last file's end,
    each with the file it lands in."""
    rng = np.random.default_rng(seed)
    end_us = START_US + files * slot_us
    ids = np.arange(payments, dtype=np.int64)
    paid = START_US + (ids * (files * slot_us - disorder_us) // payments)  # arrival stays before the end
    amount = np.round(rng.uniform(1, 500, payments), 2)
    merchants = merchants_of(rng, payments, keys, dataset.top_merchant_share)
    pay = pa.table([pa.array(ids), pa.array(merchants), pa.array(amount), pa.array(paid).cast(TS)], schema=PAYMENTS)
    pay_file = (paid + rng.integers(0, disorder_us + 1, payments) - START_US) // slot_us

    low, high = (s * 10**6 for s in dataset.between_s)
    chosen = np.flatnonzero(rng.random(payments) < refunded)
    far = rng.random(len(chosen)) < outside
    delay = np.where(far, rng.integers(high + 1, 3 * high, len(chosen)), rng.integers(low, high + 1, len(chosen)))
    refund = np.round(amount[chosen] * rng.uniform(0.1, 1, len(chosen)), 2)
    refunded_at = paid[chosen] + delay
    arrival = refunded_at + rng.integers(0, disorder_us + 1, len(chosen))
    keep = arrival < end_us  # due after the end: never arrives
    ref = pa.table([pa.array(chosen[keep]), pa.array(refund[keep]), pa.array(refunded_at[keep]).cast(TS)],
                   schema=REFUNDS)
    if dataset.key != "payment_id":  # a refund carries its payment's merchant to be joined on
        ref = ref.append_column(dataset.key, pa.array(merchants[chosen[keep]]))
    return pay, pay_file, ref, (arrival[keep] - START_US) // slot_us


def generate_logs(root: Path, files: int, events: int, epoch_minutes: float, files_per_epoch: int,
                  refunded: float, outside: float, disorder_s: float, keys: int = 10_000,
                  seed: int = 11, dataset: Dataset = DATASETS["uniform"]) -> tuple[Path, Path]:
    """``root/payments`` and ``root/refunds``, ``files`` files each, about ``events``
    records in all (see the module doc); returns the two folders."""
    slot_us = int(epoch_minutes * MINUTE_US / files_per_epoch)  # event time one file covers
    draw = lambda n: _draw(n, files, slot_us, refunded, outside, int(disorder_s * 1e6), keys, seed,  # noqa: E731
                           dataset)
    guess = int(events / (1 + refunded))
    arrived = draw(guess)[2].num_rows  # not every refund arrives: size the payments for ``events`` in all
    pay, pay_file, ref, ref_file = draw(int(events * guess / (guess + arrived)))
    rng = np.random.default_rng([seed, 1])
    dirs = (root / "payments", root / "refunds")
    for d, table, where in ((dirs[0], pay, pay_file), (dirs[1], ref, ref_file)):
        d.mkdir(parents=True)
        for k in range(files):
            part = table.filter(pa.array(where == k))
            part = part.take(pa.array(rng.permutation(part.num_rows)))  # out of order within a file, too
            pq.write_table(part, d / f"events-{k:05d}.parquet")
        order_file_mtimes(d)
    return dirs


def reference_pairs(pay_dir: Path, ref_dir: Path, dataset: Dataset = DATASETS["uniform"]) -> int:
    """Matched (payment, refund) pairs over all files: the same key and ``lower <=
    refunded_at - paid_at <= upper``, counted per refund by two binary searches over the
    payments sorted by key and time (a merchant's payments times its refunds would not fit)."""
    p, r = pq.read_table(pay_dir), pq.read_table(ref_dir)
    low, high = (s * 10**6 for s in dataset.between_s)
    ranks = np.unique(np.concatenate([p[dataset.key].to_numpy(), r[dataset.key].to_numpy()]), return_inverse=True)[1]
    times = p["paid_at"].cast(pa.int64()).to_numpy()
    span = 2 * (int(max(times.max(initial=START_US), pc.max(r["refunded_at"]).value or START_US)) - START_US + high + 1)
    packed = lambda rank, t: rank.astype(np.int64) * span + (t - START_US) + span // 2  # noqa: E731
    paid = np.sort(packed(ranks[:p.num_rows], times))
    r_keys, r_times = ranks[p.num_rows:], r["refunded_at"].cast(pa.int64()).to_numpy()
    return int((np.searchsorted(paid, packed(r_keys, r_times - low), "right")
                - np.searchsorted(paid, packed(r_keys, r_times - high), "left")).sum())


def _matched(table: pa.Table) -> int | None:
    """Rows with a refund (a left outer join's unmatched rows have a null refund)."""
    for name in ("refunded_at", "refund_amount", "r_refunded_at", "right_refunded_at"):
        if name in table.column_names:
            return table.num_rows - table[name].null_count
    return None


# ---------------------------------------------------------------- ours


def _figure(result: Any, name: str) -> int | None:
    """An operator figure of an epoch: the epoch's own, else summed over its shards."""
    if name in result.figures:
        return int(result.figures[name])
    per_shard = [s.operator.figures[name] for s in result.shards.values()
                 if s.operator is not None and name in s.operator.figures]
    return int(sum(per_shard)) if per_shard else None


def run_ours(spark: SparkSession, staged: tuple[Path, Path], work: Path, epochs: int, files_per_epoch: int,
             shards: int, dataset: Dataset = DATASETS["uniform"]) -> dict[str, Any]:
    """Each epoch: publish its files into the logs (hardlinks), run it; per epoch its
    seconds, records, the join's figures."""
    from volley_dagster import DeltaSink, EpochRunner, FileLog, Pipeline

    logs = (work / "ours-log" / "payments", work / "ours-log" / "refunds")
    for d in logs:
        d.mkdir(parents=True)
    table = work / "ours-joined"
    pipeline = (Pipeline("refunds_join")
                .sources({"payments": FileLog(logs[0], format="parquet"), "refunds": FileLog(logs[1], format="parquet")})
                .join(left="payments", right="refunds", on=dataset.key, left_time="paid_at",
                      right_time="refunded_at",
                      between=(f"{dataset.between_s[0]} seconds", f"{dataset.between_s[1]} seconds"),
                      how="left", max_out_of_orderness=OUT_OF_ORDERNESS)
                .sink(DeltaSink(table, name="joined", mode="append"))
                .with_shards(shards))
    runner = EpochRunner(pipeline, work / "ours-state", RunSettings(max_records_per_epoch=None), spark=spark)
    rows = []
    t0 = time.perf_counter()
    for i in range(epochs):
        for src, dst in zip(staged, logs, strict=True):
            for k in range(i * files_per_epoch, (i + 1) * files_per_epoch):
                os.link(src / f"events-{k:05d}.parquet", dst / f"events-{k:05d}.parquet")
        r = runner.run_next()
        assert r is not None, f"epoch {i + 1}: nothing to run"
        rows.append({"epoch": r.epoch, "records": r.records_in, "seconds": r.durations["total"],
                     "phases": volley_phases(r, r.durations["total"]),
                     "records_out": r.records_out, "late": r.late_records,
                     "left_rows": _figure(r, "join_left_rows"), "right_rows": _figure(r, "join_right_rows"),
                     "pairs": _figure(r, "join_pairs"), "unmatched": _figure(r, "join_unmatched"),
                     "state_bytes": r.state_bytes, "figures": dict(r.figures)})
    wall = time.perf_counter() - t0
    out = _read_delta(table)
    return {"engine": "volley", "epochs_detail": rows, "wall_s": wall, "output_rows": out.num_rows,
            "matched_in_table": _matched(out), "columns": out.column_names}


def _read_delta(path: Path) -> pa.Table:
    return read_peer_table({"delta_uri": str(path.absolute())})


# ---------------------------------------------------------------- the peer


def peer_state_sides(spark: SparkSession, checkpoint: Path, batch_ids: list[int]) -> dict[int, dict[str, int]]:
    """Rows buffered per join side after each batch, from Spark's state data source."""
    sides: dict[int, dict[str, int]] = {}
    for b in batch_ids:
        sides[b] = {side: spark.read.format("statestore").option("joinSide", side).option("batchId", b)
                    .load(str(checkpoint)).count() for side in ("left", "right")}
    return sides


def run_peer(spark: SparkSession, staged: tuple[Path, Path], work: Path, files_per_epoch: int, shards: int,
             batches_expected: int, dataset: Dataset = DATASETS["uniform"]) -> dict[str, Any]:
    """The same files through Spark Structured Streaming's stream-stream join."""
    checkpoint = work / "peer-checkpoint"
    delta_uri = str((work / "peer-joined").absolute())
    conf = {**PEER_CONF, "spark.sql.shuffle.partitions": str(shards),
            "spark.sql.streaming.numRecentProgressUpdates": str(max(100, 2 * batches_expected + 10))}
    previous = _set_confs(spark, conf)
    sink_stats: dict[int, dict[str, Any]] = {}
    try:
        def side(path: Path, schema: StructType) -> Any:
            return (spark.readStream.format("parquet").schema(schema)
                    .option("maxFilesPerTrigger", files_per_epoch).load(str(path)))

        p = side(staged[0], PAYMENTS_SPARK).withWatermark("paid_at", OUT_OF_ORDERNESS).alias("p")
        refunds_schema = REFUNDS_SPARK if dataset.key == "payment_id" else \
            StructType([*REFUNDS_SPARK.fields, StructField(dataset.key, LongType())])
        r = side(staged[1], refunds_schema).withWatermark("refunded_at", OUT_OF_ORDERNESS).alias("r")
        low, high = dataset.between_s
        joined = p.join(r, F.expr(f"p.{dataset.key} = r.{dataset.key} AND "
                                  f"r.refunded_at >= p.paid_at + interval {low} seconds AND "
                                  f"r.refunded_at <= p.paid_at + interval {high} seconds"), "leftOuter")
        joined = joined.select("p.payment_id", "p.merchant_id", "p.amount", "p.paid_at", "r.refund_amount",
                               "r.refunded_at")
        query = (joined.writeStream.queryName(f"peer_join_{os.getpid()}_{int(time.time())}")
                 .outputMode("append").option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True)
                 .foreachBatch(_delta_writer(delta_uri, "peer-join", False, sink_stats)))
        progresses, wall = run_to_end(query)
    finally:
        _restore_confs(spark, previous)

    executed = executed_batches(progresses, sink_stats)
    sides = peer_state_sides(spark, checkpoint, [b["batch_id"] for b in executed])
    rows = [{"epoch": b["batch_id"] + 1, "records": b["records"], "seconds": b["seconds"],
             "records_out": (b["sink"] or {}).get("rows"), "state_rows_total": b["state"].get("numRowsTotal"),
             "left_rows": sides[b["batch_id"]]["left"], "right_rows": sides[b["batch_id"]]["right"],
             "dropped_by_watermark": b["state"].get("numRowsDroppedByWatermark"),
             "state_memory_bytes": b["state"].get("memoryUsedBytes"), "watermark": b["watermark"],
             "phases": b["phases"]} for b in executed]
    out = _read_delta(Path(delta_uri))
    return {"engine": ENGINE, "epochs_detail": [x for x in rows if x["records"] > 0],
            "no_data_batches": [x for x in rows if x["records"] == 0], "wall_s": wall,
            "output_rows": out.num_rows, "matched_in_table": _matched(out), "checkpoint_bytes": _dir_bytes(checkpoint),
            "conf": conf}


# ---------------------------------------------------------------- main


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Medians of epochs 2.. (seconds, records/s) and the peak state rows per side."""
    rows = run["epochs_detail"]
    warm = rows[1:] or rows
    peak = lambda k: max((r[k] for r in rows if r.get(k) is not None), default=None)  # noqa: E731
    return {"median_s": statistics.median(r["seconds"] for r in warm),
            "median_records_per_s": statistics.median(r["records"] / r["seconds"] for r in warm if r["seconds"]),
            "records": sum(r["records"] for r in rows), "peak_left_rows": peak("left_rows"),
            "peak_right_rows": peak("right_rows"),
            "peak_total_rows": max((sum(r.get(k) or 0 for k in ("left_rows", "right_rows")) for r in rows), default=0)}


PHASES = {"ours": ("read_transform", "state_stage", "sinks", "rest", "side_output", "restore", "merge", "flush",
                   "snapshot"),
          "peer": ("latestOffset", "getBatch", "queryPlanning", "addBatch", "walCommit", "commitOffsets",
                   "fn_collect", "fn_delta_commit")}


def print_phases(runs: dict[str, dict[str, Any]]) -> None:
    """Each engine's median phases of epochs 2.. (seconds). Ours: read_transform +
    state_stage + sinks + rest = the epoch; side_output inside read_transform; restore,
    merge (the join's shard work), flush and snapshot summed over the shards, inside
    state_stage. The peer: its micro-batch's durations, fn_* inside addBatch."""
    print("\nmedian phases of epochs 2.. (s; ours: restore..snapshot summed over the shards, inside state_stage)")
    for label, run in runs.items():
        warm = run["epochs_detail"][1:] or run["epochs_detail"]
        names = PHASES[label]
        medians = {n: statistics.median(r["phases"].get(n, 0.0) for r in warm) for n in names}
        print(f"{label:>6} " + " ".join(f"{n} {v:.2f}" for n, v in medians.items()))


def machine() -> dict[str, Any]:
    mem = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:")), None)
    return {"cores": os.cpu_count(), "memory_bytes": mem, "platform": platform.platform(),
            "python": platform.python_version(), "load_avg_1m": os.getloadavg()[0]}


def _n(v: Any, fmt: str = ",") -> str:
    return "-" if v is None else format(v, fmt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200_000, help="records of both logs together")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--files-per-epoch", type=int, default=1, help="files per side per epoch")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--epoch-minutes", type=float, default=10.0, help="event time one epoch covers")
    parser.add_argument("--refunded", type=float, default=0.2, help="share of payments refunded")
    parser.add_argument("--outside", type=float, default=0.05,
                        help="share of refunds after the interval (up to 3x its end after the payment)")
    parser.add_argument("--dataset", choices=sorted(DATASETS), default="uniform",
                        help="uniform: joined on payment_id within 30 min; skewed: on merchant_id within 5 s, "
                             "Zipf merchants, merchant 0 with 5%% of the payments")
    parser.add_argument("--disorder-s", type=float, default=20.0, help="how late a record may land in the files")
    parser.add_argument("--engines", default="ours,peer", help="ours,peer (default both)")
    parser.add_argument("--workdir", default=None, help="keep the data and state here (default: a temp dir, removed)")
    parser.add_argument("--profile", action="store_true", help="print the median phases of an epoch per engine")
    args = parser.parse_args()
    engines = set(args.engines.split(","))
    dataset = DATASETS[args.dataset]

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-bench-join-"))
    shutil.rmtree(work, ignore_errors=True)
    files = args.epochs * args.files_per_epoch
    staged = generate_logs(work / "staged", files, args.events, args.epoch_minutes, args.files_per_epoch,
                           args.refunded, args.outside, args.disorder_s, dataset=dataset)
    sizes = [pq.read_metadata(d / f"events-{k:05d}.parquet").num_rows for d in staged for k in range(files)]
    want = reference_pairs(*staged, dataset)
    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(args.shards)})
    spark.sparkContext.setLogLevel("WARN")
    print(f"{machine()['cores']} cores; {sum(sizes[:files]):,} payments + {sum(sizes[files:]):,} refunds, "
          f"{args.epochs} epochs x {args.files_per_epoch} file(s) per side, {args.epoch_minutes:g} min of event time "
          f"per epoch, {args.shards} shards; {dataset.name}: join on {dataset.key} within {dataset.between_s[1]} s, "
          f"left outer, watermark {OUT_OF_ORDERNESS}")

    runs: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    if "ours" in engines:
        from volley_dagster import Pipeline

        if not hasattr(Pipeline, "join"):
            problems.append("ours not run: Pipeline.join does not exist yet")
        else:
            runs["ours"] = run_ours(spark, staged, work, args.epochs, args.files_per_epoch, args.shards, dataset)
    if "peer" in engines:
        runs["peer"] = run_peer(spark, staged, work, args.files_per_epoch, args.shards, args.epochs, dataset)

    print(f"\n{'epoch':>5} {'engine':>6} {'records':>8} {'s':>6} {'rec/s':>9} {'left rows':>10} {'right rows':>10} "
          f"{'out rows':>9} {'pairs':>7} {'unmatched':>9}")
    for i in range(args.epochs):
        for label, run in runs.items():
            if i >= len(run["epochs_detail"]):
                continue
            r = run["epochs_detail"][i]
            print(f"{r['epoch']:>5} {label:>6} {r['records']:>8,} {r['seconds']:>6.2f} "
                  f"{r['records'] / r['seconds'] if r['seconds'] else 0:>9,.0f} {_n(r['left_rows']):>10} "
                  f"{_n(r['right_rows']):>10} {_n(r['records_out']):>9} {_n(r.get('pairs')):>7} "
                  f"{_n(r.get('unmatched')):>9}")
    for x in runs.get("peer", {}).get("no_data_batches", []):
        print(f"{x['epoch']:>5} {'peer':>6} {'no-data':>8} {x['seconds']:>6.2f} {'':>9} {_n(x['left_rows']):>10} "
              f"{_n(x['right_rows']):>10} {_n(x['records_out']):>9}")

    summary = {label: summarize(run) for label, run in runs.items()}
    print(f"\nmedian of epochs 2..{args.epochs} (peak state rows: after an epoch, all shards)")
    print(f"{'engine':>6} {'s/epoch':>8} {'rec/s':>9} {'peak left':>10} {'peak right':>10} {'peak total':>10} "
          f"{'out rows':>9} {'matched':>8} {'reference':>9} {'unmatched':>9}")
    for label, s in summary.items():
        run = runs[label]
        print(f"{label:>6} {s['median_s']:>8.2f} {s['median_records_per_s']:>9,.0f} {_n(s['peak_left_rows']):>10} "
              f"{_n(s['peak_right_rows']):>10} {_n(s['peak_total_rows']):>10} {run['output_rows']:>9,} "
              f"{_n(run['matched_in_table']):>8} {want:>9,} "
              f"{_n(None if run['matched_in_table'] is None else run['output_rows'] - run['matched_in_table']):>9}")
        if run["matched_in_table"] != want:
            problems.append(f"{label}: {run['matched_in_table']} matched pairs in its table, the reference has {want}")
    if "ours" in runs:
        pairs = [r["pairs"] for r in runs["ours"]["epochs_detail"]]
        if None not in pairs and sum(pairs) != want:
            problems.append(f"ours: join_pairs sums to {sum(pairs)}, the reference has {want}")
    if "peer" in runs:
        print("(peer: rows per side read back from its checkpoint with the state data source; its progress "
              "reports only the total, numRowsTotal)")
    ratios: dict[str, float] = {}
    if "ours" in summary and "peer" in summary:
        o, p = summary["ours"], summary["peer"]
        ratios = {"time_ours_to_peer": o["median_s"] / p["median_s"],
                  "records_per_s_ours_to_peer": o["median_records_per_s"] / p["median_records_per_s"]}
        for k in ("peak_left_rows", "peak_right_rows", "peak_total_rows"):
            if o[k] and p[k]:
                ratios[f"{k}_ours_to_peer"] = o[k] / p[k]
        print(f"ours/peer: {ratios['time_ours_to_peer']:.2f}x time per epoch, "
              f"{ratios['records_per_s_ours_to_peer']:.2f}x records/s; peak state rows "
              + ", ".join(f"{k.split('_')[1]} {v:.2f}x" for k, v in ratios.items() if k.startswith("peak_")))

    if args.profile:
        print_phases(runs)
    report = {"args": vars(args), "machine": machine(), "reference_pairs": want, "median_warm": summary,
              "dataset": dataset.name,
              "ratios": ratios, "runs": runs, "problems": problems}
    spark.stop()
    path = finish("join" if dataset.name == "uniform" else f"join_{dataset.name}", report, work,
                  keep=bool(args.workdir))
    print(f"wrote {path}")
    if problems:
        print("PROBLEMS: " + "; ".join(problems))
        sys.exit(1)


if __name__ == "__main__":
    main()
