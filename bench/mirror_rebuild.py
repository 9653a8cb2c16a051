"""What rebuilding a lost mirror buys: one shard of a running count (``--keys`` keys in
RocksDB, its mirror in memory) loses its mirror (stamped with another snapshot, as a
killed attempt or a reboot leaves it), then runs ``--epochs`` epochs that each touch
``--touched`` of its keys. Two ways over copies of the same shard, taking turns:
``rebuild`` (a lost mirror lowers the scan's bar to ``REBUILD_SHARE`` of the scan
fraction: the first epoch scans and rebuilds it) and ``stay`` (the bar left at the scan
fraction: every epoch below it reads RocksDB with ``multi_get``, as before).

    ./dev bench mirror_rebuild [--keys 2500000] [--touched 0.1] [--epochs 5] [--rounds 3]

Prints the median seconds of each epoch's read, merge and write (``Aggregate.apply``,
the flush and the mirror's commit) per way, how each read its state, and the epoch by which the rebuild
has paid for its scan; writes bench/results/mirror_rebuild.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS  # noqa: E402
from volley_dagster import columns  # noqa: E402
from volley_dagster.operators.accumulators import count  # noqa: E402
from volley_dagster.operators.aggregate import Aggregate  # noqa: E402
from volley_dagster.operators.base import ShardStep  # noqa: E402
from volley_dagster.state import transaction  # noqa: E402
from volley_dagster.state.resident import ResidentStateCache  # noqa: E402
from volley_dagster.state.store import ShardStore  # noqa: E402

IDENTITY = {"state": "bench|mirror_rebuild", "shard": 0, "layout": {"namespace": 1}}
WAYS = {"rebuild": transaction.REBUILD_SHARE, "stay": 1.0}


def snapshot_files(epoch: int) -> dict:
    """A stand-in for the digests of epoch ``epoch``'s snapshot (the mirror's lineage)."""
    return {f"{epoch:06d}.sst": {"size": epoch, "sha256": f"{epoch:064x}"}}


def run_epoch(store: ShardStore, cache: ResidentStateCache, aggregate: Aggregate, epoch: int, keys: np.ndarray,
              restored: dict | None) -> tuple[float, str]:
    """One shard task's read, merge and write of ``keys``; its seconds and how it read."""
    ones = np.ones(len(keys), np.int64)
    data = pa.table({columns.KEY_GROUP: pa.array(np.zeros(len(keys), np.int64)), columns.KEY: pa.array(keys),
                     columns.ROWS: ones, "n:n": ones})
    t = time.perf_counter()
    mirror = cache.open(IDENTITY, restored, aggregate.resident_records)
    assert mirror is not None, "another process holds this bench's mirror"
    txn = store.transaction(resident=mirror)
    aggregate.apply(txn, data, ShardStep(epoch, "int"))
    txn.flush()
    mirror.commit(snapshot_files(epoch))
    seconds = time.perf_counter() - t
    mode = "resident" if mirror.answered else "scan" if txn.scanned else "multi_get"
    mirror.release()
    return seconds, mode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=2_500_000)
    parser.add_argument("--touched", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    aggregate = Aggregate((("n", count()),)).recorded({"namespace": 1, "accumulators": [{"kind": None}]})
    work = Path(tempfile.mkdtemp(prefix="volley-mirror-rebuild-"))
    rng = np.random.default_rng(7)
    all_keys = np.arange(args.keys, dtype=np.int64)
    touched = [np.sort(rng.choice(all_keys, int(args.keys * args.touched), replace=False))
               for _ in range(args.epochs)]
    base = ShardStore.restore(None, None, work / "base")
    build = ResidentStateCache(str(work / "resident-build"), max_bytes=2**34)
    run_epoch(base, build, aggregate, 1, all_keys, None)  # the state every round starts from
    snapshot = base.snapshot(work / "snapshot", None, None)
    base.close()
    shutil.rmtree(build.directory, ignore_errors=True)
    print(f"one shard of {args.keys:,} keys; {args.epochs} epochs touching {args.touched:.0%} of them after its "
          f"mirror was lost; {args.rounds} rounds, the ways taking turns")
    seconds: dict[str, list[list[float]]] = {way: [] for way in WAYS}
    modes: dict[str, list[str]] = {}
    try:
        for r in range(args.rounds):
            for way, share in WAYS.items():
                copy = work / f"{way}-{r}"
                store = ShardStore.restore(snapshot.path, snapshot.files, copy)
                cache = ResidentStateCache(str(work / f"resident-{way}-{r}"), max_bytes=2**34)
                transaction.REBUILD_SHARE = share
                try:
                    run = [run_epoch(store, cache, aggregate, 2 + i, keys, snapshot_files(0 if i == 0 else 1 + i))
                           for i, keys in enumerate(touched)]
                finally:
                    transaction.REBUILD_SHARE = WAYS["rebuild"]
                    store.close()
                    shutil.rmtree(cache.directory, ignore_errors=True)
                seconds[way].append([s for s, _ in run])
                modes[way] = [m for _, m in run]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    medians = {way: [statistics.median(rounds[e] for rounds in seconds[way]) for e in range(args.epochs)]
               for way in WAYS}
    print(f"{'epoch':>5} " + " ".join(f"{way + ' s':>10} {'read':>9}" for way in WAYS))
    for e in range(args.epochs):
        print(f"{e + 1:>5} " + " ".join(f"{medians[way][e]:>10.3f} {modes[way][e]:>9}" for way in WAYS))
    totals = {way: np.cumsum(medians[way]) for way in WAYS}
    ahead = np.flatnonzero(totals["rebuild"] <= totals["stay"])
    paid = int(ahead[0]) + 1 if len(ahead) else None
    later = medians["stay"][1:]
    ratio = statistics.median(later) / statistics.median(medians["rebuild"][1:]) if later else None
    print(f"after the rebuild: stay / rebuild {ratio:.2f}x an epoch (medians of epochs 2..); the rebuild has paid "
          f"for its scan {'by epoch ' + str(paid) if paid else 'not within the run'}; totals: rebuild "
          f"{totals['rebuild'][-1]:.2f} s, stay {totals['stay'][-1]:.2f} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "mirror_rebuild.json"
    out.write_text(json.dumps({**vars(args), "median_s": medians, "modes": modes, "paid_back_by_epoch": paid,
                               "stay_over_rebuild_after": ratio}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
