"""One shard task of the interval join, epoch after epoch, without Spark: the shard's
share of ``./dev bench join``'s stream (payments keyed by a unique payment_id, a fifth
of them refunded 0..30 minutes later, 10 minutes of event time an epoch) folded through
``apply_join`` on a real RocksDB, as the shard task calls it, then flushed and
snapshotted. It isolates the shard's own work (``merge`` in ``compare --profile``) so it
can be profiled and timed without the JVM.

    ./dev bench join_shard [--rows-per-epoch 55000] [--epochs 8] [--profile 25] [--scan-fraction 0.2]

Prints per epoch: seconds in ``apply_join``, in the flush and in the checkpoint, rows
waiting and pairs; then the medians of epochs 2.. . ``--profile N`` prints the top N
functions of cProfile over epochs 2.. .
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import rocksdict
from pyspark.sql import types as T

from volley_dagster import columns
from volley_dagster.operators.base import ShardStep
from volley_dagster.operators.join_rows import RowCodec
from volley_dagster.operators.join_state import JoinBounds, JoinShard, apply_join
from volley_dagster.state.keys import ShardLayout
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.transaction import DEFAULT_SCAN_FRACTION, ShardTransaction

MINUTE_US = 60_000_000
EPOCH_US = 10 * MINUTE_US
LAYOUT = ShardLayout(1, 128)
LEFT_CODEC = RowCodec(("merchant_id", "amount", "paid_at"), (T.LongType(), T.DoubleType(), T.TimestampType()))
RIGHT_CODEC = RowCodec(("refund_amount", "refunded_at"), (T.DoubleType(), T.TimestampType()))
SHARD = JoinShard(JoinBounds(0, 30 * MINUTE_US, (True, False)), (LEFT_CODEC, RIGHT_CODEC), None,
                  ("payments", "refunds"))


def epoch_rows(epoch: int, n: int, rng: np.random.Generator) -> tuple[pa.Table, int]:
    """Epoch ``epoch``'s payments (ids ``(epoch-1)*n ..``) and the refunds of earlier
    payments that arrive in it; returns the rows and the epoch's latest event time."""
    start = (epoch - 1) * EPOCH_US
    ids = np.arange((epoch - 1) * n, epoch * n, dtype=np.int64)
    paid = start + np.sort(rng.integers(0, EPOCH_US, n))
    # refunds: a fifth of the payments of this and the three epochs before, 0..30 min after
    past = np.arange(max(0, (epoch - 4) * n), epoch * n, dtype=np.int64)
    chosen = past[(past * 2654435761 % 5) == 0]
    refunded_at = (chosen // n) * EPOCH_US + (chosen % n) * EPOCH_US // n + (chosen * 7919 % (30 * MINUTE_US))
    chosen, refunded_at = chosen[(refunded_at >= start) & (refunded_at < start + EPOCH_US)], \
        refunded_at[(refunded_at >= start) & (refunded_at < start + EPOCH_US)]
    keys = np.concatenate([ids, chosen])
    times = np.concatenate([paid, refunded_at])
    sides = np.concatenate([np.zeros(len(ids), np.int8), np.ones(len(chosen), np.int8)])
    texts = pa.array([f'{{"merchant_id":{i % 10000},"amount":"12.5","paid_at":"2026-01-01T00:00:00.000000Z"}}'
                      for i in ids] + ['{"refund_amount":"3.25","refunded_at":"2026-01-01T00:10:00.000000Z"}'
                                       for _ in chosen], pa.string())
    order = rng.permutation(len(keys))
    table = pa.table({
        columns.KEY: pa.array(keys[order]),
        columns.KEY_GROUP: pa.array((keys[order] * 31 % 128).astype(np.int32)),
        columns.POS: pa.array(np.arange(len(keys), dtype=np.int64)),
        columns.JOIN_SIDE: pa.array(sides[order]),
        columns.JOIN_TIME: pa.array(times[order]),
        columns.JOIN_ROW: texts.take(pa.array(order)),
        columns.ROWS: pa.array(np.ones(len(keys), dtype=np.int32)),
    })
    return table, int(times.max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows-per-epoch", type=int, default=55_000, help="payments an epoch in the shard")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions")
    parser.add_argument("--scan-fraction", type=float, default=DEFAULT_SCAN_FRACTION,
                        help="read the index by a scan past this share of the shard's keys (else multi_get)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="volley-join-shard-"))
    rng = np.random.default_rng(5)
    profiler = cProfile.Profile()
    rows = []
    try:
        db = rocksdict.Rdict(str(work / "db"), RocksDBOptions().build())
        before = None
        for epoch in range(1, args.epochs + 1):
            data, latest = epoch_rows(epoch, args.rows_per_epoch, rng)
            watermark = latest - MINUTE_US
            step = ShardStep(epoch, "int", watermark_before=before, watermark=watermark, layout=LAYOUT, shard=0)
            txn = ShardTransaction(db, scan_fraction=args.scan_fraction)
            if epoch > 1 and args.profile:
                profiler.enable()
            t = time.perf_counter()
            out, stats = apply_join(SHARD, txn, data, step)
            merged = time.perf_counter() - t
            txn.flush()
            flushed = time.perf_counter() - t - merged
            checkpoint = rocksdict.Checkpoint(db)
            checkpoint.create_checkpoint(str(work / f"snap{epoch}"))
            del checkpoint
            snapped = time.perf_counter() - t - merged - flushed
            profiler.disable()
            before = watermark
            rows.append({"epoch": epoch, "records": data.num_rows, "merge": merged, "flush": flushed,
                         "snapshot": snapped, "pairs": stats.figures["join_pairs"],
                         "waiting": stats.figures["join_left_rows"] + stats.figures["join_right_rows"],
                         "evicted": stats.figures["join_rows_evicted"], "out": len(out[0])})
            r = rows[-1]
            print(f"epoch {epoch}: {r['records']:,} rows, merge {merged:.3f} s, flush {flushed:.3f} s, "
                  f"snapshot {snapped:.3f} s; {r['pairs']:,} pairs, {r['out']:,} out, {r['waiting']:,} waiting, "
                  f"{r['evicted']:,} left state")
            shutil.rmtree(work / f"snap{epoch - 1}", ignore_errors=True)
        db.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    warm = rows[1:]
    print("median of epochs 2..: " + ", ".join(f"{k} {statistics.median(r[k] for r in warm):.3f} s"
                                               for k in ("merge", "flush", "snapshot")))
    if args.profile:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile)
        print(out.getvalue())


if __name__ == "__main__":
    main()
