"""One hot key in the interval join's shard task: ``n`` rows waiting on each side of one
key (none matching: every right row is earlier than every left row), then an epoch of
one new row of that key. Review J5: the shard task hash-joined every left row with
every right row of the key before filtering to pairs with a new row, so memory and
time grew with n squared; they must grow linearly.

    ./dev bench join_hot_key [--rows 1000,10000,100000] [--repeats 3]

Each size runs in a process of its own (so its peak RSS is its own), on a real
RocksDB, through ``apply_join`` as a shard task calls it. Printed per size: the
median seconds of the one-row epoch (each repeat on a fresh copy of the same state),
seconds per waiting row, the process's peak RSS, and the floor: what any epoch that
touches the key must do whatever the join does (read its index, decode it, write it
back). ``--before`` also times the old all-pairs search alone (Arrow's hash join of
every left with every right row of the key), up to 6,000 rows per side.
Writes bench/results/join_hot_key.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import rocksdict
from pyspark.sql import types as T

from bench.common import RESULTS
from volley_dagster import columns
from volley_dagster.operators.base import ShardStep
from volley_dagster.operators.join_rows import RowCodec
from volley_dagster.operators.join_state import INDEX_NS, JoinBounds, JoinShard, apply_join
from volley_dagster.state.keys import ShardLayout, encode_keys, namespace_prefix
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.transaction import ShardTransaction

LAYOUT = ShardLayout(1, 8)
CODEC = RowCodec(("rid",), (T.LongType(),))
SHARD = JoinShard(JoinBounds(0, 100, (True, False)), (CODEC, CODEC), None, ("left", "right"))


def rows(sides: np.ndarray, times: np.ndarray) -> pa.Table:
    n = len(sides)
    return pa.table({
        columns.KEY: pa.array(np.ones(n, dtype=np.int64)),
        columns.KEY_GROUP: pa.array(np.ones(n, dtype=np.int32)),
        columns.POS: pa.array(np.arange(n, dtype=np.int64)),
        columns.JOIN_SIDE: pa.array(sides.astype(np.int8)),
        columns.JOIN_TIME: pa.array(times.astype(np.int64)),
        columns.JOIN_ROW: pa.array([f'{{"rid": {i}}}' for i in range(n)], pa.string()),
        columns.ROWS: pa.array(np.ones(n, dtype=np.int32)),
    })


def one_size(n: int, repeats: int, before: bool) -> dict[str, float]:
    """Load n rows per side of key 1 (epoch 1), then time an epoch of one new left row."""
    work = Path(tempfile.mkdtemp(prefix="volley-hot-key-"))
    try:
        loaded = work / "loaded"
        db = rocksdict.Rdict(str(loaded), RocksDBOptions().build())
        sides = np.repeat([1, 0], n)  # right rows at 0..n-1 us, left rows from 10^9 us: no pair
        times = np.concatenate([np.arange(n), 10**9 + np.arange(n)])
        txn = ShardTransaction(db)
        apply_join(SHARD, txn, rows(sides, times), ShardStep(1, "int", layout=LAYOUT, shard=0))
        txn.flush()
        db.close()
        seconds, floors = [], []
        for attempt in range(repeats):
            copy = work / f"copy{attempt}"
            shutil.copytree(loaded, copy)
            db = rocksdict.Rdict(str(copy), RocksDBOptions().build())
            try:
                t = time.perf_counter()
                index_key = encode_keys(INDEX_NS, np.array([1]), pa.array([1], pa.int64()))
                blob = ShardTransaction(db).get_many(index_key, namespace_prefix(INDEX_NS))[0]
                assert blob is not None
                floor_txn = ShardTransaction(db)
                floor_txn.set_many(index_key, [np.frombuffer(blob, dtype=np.uint8).copy().tobytes()])
                floors.append(time.perf_counter() - t)
                txn = ShardTransaction(db)
                t = time.perf_counter()
                out, _ = apply_join(SHARD, txn, rows(np.array([0]), np.array([2 * 10**9])),
                                    ShardStep(2, "int", layout=LAYOUT, shard=0))
                seconds.append(time.perf_counter() - t)
                assert len(out[0]) == 0  # no pair: the new left row is far after every right row
            finally:
                db.close()
        figures = {"rows_per_side": n, "epoch_s": statistics.median(seconds), "floor_s": statistics.median(floors),
                   "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if before and n <= 6_000:
            figures["all_pairs_s"] = all_pairs_seconds(n)
        return figures
    finally:
        shutil.rmtree(work, ignore_errors=True)


def all_pairs_seconds(n: int) -> float:
    """The old search alone: every left row of the key hash-joined with every right row."""
    t = time.perf_counter()
    keys = np.ones(n, dtype=np.int64)
    joined = pa.table({"k": keys, "l": np.arange(n)}).join(pa.table({"k": keys, "r": np.arange(n)}), "k")
    assert joined.num_rows == n * n
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1000,10000,100000", help="rows waiting per side, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before", action="store_true", help="also time the old all-pairs search (n <= 6,000)")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child process: one size
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_size(args.one, args.repeats, args.before)))
        return
    report = []
    print(f"{'rows/side':>10} {'epoch s':>9} {'us/row':>8} {'floor s':>9} {'epoch/floor':>11} {'peak MiB':>9}"
          f"{' all-pairs s':>12}")
    for n in (int(x) for x in args.rows.split(",")):
        child = [sys.executable, "-m", "bench.join_hot_key", "--one", str(n), "--repeats", str(args.repeats)]
        done = subprocess.run(child + (["--before"] if args.before else []), check=True, capture_output=True,
                              text=True)
        f = json.loads(done.stdout.strip().splitlines()[-1])
        report.append(f)
        pairs = f"{f['all_pairs_s']:12.3f}" if "all_pairs_s" in f else f"{'-':>12}"
        print(f"{n:>10,} {f['epoch_s']:9.3f} {f['epoch_s'] / (2 * n) * 1e6:8.2f} {f['floor_s']:9.4f} "
              f"{f['epoch_s'] / max(f['floor_s'], 1e-9):10.1f}x {f['peak_rss_mib']:9.0f}{pairs}")
    if len(report) > 1:
        a, b = report[0], report[-1]
        print(f"from {a['rows_per_side']:,} to {b['rows_per_side']:,} rows per side "
              f"({b['rows_per_side'] / a['rows_per_side']:.0f}x): epoch time {b['epoch_s'] / a['epoch_s']:.1f}x, "
              f"peak RSS {b['peak_rss_mib'] / a['peak_rss_mib']:.1f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "join_hot_key.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
