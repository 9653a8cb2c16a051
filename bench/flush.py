"""What a shard's write-behind flush costs: one ``ShardTransaction`` batch of N keys in
RocksDB's order (a running aggregate's write), written with one ``WriteBatch``, kept as
given (flushed without a dict or a sort) against the same batch through the dict
(as every batch went before: the cache a dict, sorted at flush; forced here by one
earlier write of its first key), each into a fresh RocksDB, the two ways taking turns.

    ./dev bench flush [--keys 160000] [--reps 9]

Prints the medians (set_many + flush) and their ratio; writes bench/results/flush.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from volley_dagster.state.keys import encode_keys  # noqa: E402
from volley_dagster.state.store import ShardStore  # noqa: E402


def batch(n: int, seed: int = 1) -> tuple[list[bytes], list[bytes]]:
    """``n`` int state keys of 128 key groups, in key order, and 30-byte values."""
    rng = np.random.default_rng(seed)
    values = np.sort(rng.choice(40 * n, n, replace=False))
    groups = values % 128
    order = np.lexsort((values, groups))
    keys = encode_keys(3, groups[order], pa.array(values[order]))
    return keys, [rng.bytes(30) for _ in range(n)]


def timed_flush(keys: list[bytes], values: list[bytes], through_dict: bool) -> float:
    with tempfile.TemporaryDirectory() as work:
        store = ShardStore.restore(None, None, Path(work) / "shard")
        try:
            txn = store.transaction()
            t0 = time.perf_counter()
            if through_dict:
                txn.set_many(keys[:1], values[:1])
            txn.set_many(keys, values)
            written = txn.flush()
            seconds = time.perf_counter() - t0
        finally:
            store.close()
    assert written == len(keys)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=160_000, help="keys in the batch (a shard's share of an epoch)")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    keys, values = batch(args.keys)
    times: dict[str, list[float]] = {"as given": [], "through the dict": []}
    for rep in range(args.reps):
        ways = [("as given", False), ("through the dict", True)]
        for name, through_dict in ways if rep % 2 == 0 else ways[::-1]:
            times[name].append(timed_flush(keys, values, through_dict))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = medians["as given"] / medians["through the dict"]
    for name, median in medians.items():
        print(f"{name:<17} {median * 1000:7.1f} ms  (set_many + flush, median of {args.reps}, {args.keys:,} keys)")
    print(f"as given / through the dict: {ratio:.2f}x")
    out = Path(__file__).parent / "results" / "flush.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"keys": args.keys, "reps": args.reps, "median_s": medians, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
