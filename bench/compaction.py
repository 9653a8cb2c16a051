"""What a shard's level 0 costs over a long history: ``--shards`` shards of ``--keys`` keys
in all, then ``--epochs`` epochs that each rewrite ``--touched`` of them, as shard tasks do
(restore N-1's snapshot, one ``WriteBatch``, snapshot, close), the shards of an epoch on
``--workers`` processes as Spark's cores run them. Four ways, taking turns:
``turns`` (the engine's: RocksDB's own compactions off, level 0 folded into the base on
the shard's turn, ``RocksDBOptions.compaction_turn`` and ``compaction_due``, a turn for
as many shards as ``--workers``), ``one a turn`` (the same with a turn for each shard alone),
``together`` (the eleventh round's: the same without turns, every shard at ten level-0
files, so all in the same epoch) and ``background`` (before it: RocksDB's compactions
on, started at every open past four level-0 files and dropped unfinished at close).

    ./dev bench compaction [--keys 1000000] [--shards 1] [--workers 1] [--touched 0.1]
                           [--epochs 40] [--rounds 2]

Prints per way the median and p95 seconds of an epoch (all its shards), its CPU seconds
per wall second (over what the workers can use: RocksDB's threads beside the tasks) and
its mean seconds and CPU seconds (compactions included), the most shards that compacted
in one epoch, the most level-0 files a snapshot held, and the shards' snapshots' size at
the end and at most; writes bench/results/compaction.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.pool import Pool
from pathlib import Path

import numpy as np
import pyarrow as pa
import rocksdict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS  # noqa: E402
from volley_dagster.state.keys import encode_keys  # noqa: E402
from volley_dagster.state.options import RocksDBOptions  # noqa: E402
from volley_dagster.state.store import ShardStore, SnapshotInfo  # noqa: E402

VALUE_BYTES = 26  # a running aggregate's record: format byte, a sum, a count, padding


@dataclass(frozen=True)
class Together(RocksDBOptions):
    """The eleventh round's options: no turns, every shard compacts at ten level-0 files."""

    compact_l0_files: int = 10

    def compaction_turn(self, epoch: int, shard: int) -> bool:
        return False


@dataclass(frozen=True)
class BackgroundCompactions(RocksDBOptions):
    """The options before foreground compaction: RocksDB compacts on its own, the
    snapshot never does."""

    def build(self) -> rocksdict.Options:
        opts = super().build()
        opts.set_disable_auto_compactions(False)
        return opts

    def compaction_due(self, level0_files: int, newer_bytes: int, base_bytes: int, turn: bool = False) -> bool:
        return False


def ways(workers: int) -> dict[str, RocksDBOptions]:
    return {"turns": RocksDBOptions(compact_together=workers), "one a turn": RocksDBOptions(compact_together=1),
            "together": Together(), "background": BackgroundCompactions()}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process: RocksDB's too
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class ShardEpoch:
    options: RocksDBOptions
    work: Path
    epoch: int
    shard: int
    keys: np.ndarray
    previous: SnapshotInfo | None
    seed: int


def shard_epoch(task: ShardEpoch) -> tuple[SnapshotInfo, float]:
    """One shard task (in a worker process): its new snapshot and CPU seconds."""
    options = task.options
    state_keys = encode_keys(1, (task.keys % 256).astype(np.int64), pa.array(task.keys))
    order = sorted(range(len(state_keys)), key=state_keys.__getitem__)
    values = np.random.default_rng(task.seed).bytes(VALUE_BYTES * len(task.keys))
    batch = ([state_keys[i] for i in order], [values[i * VALUE_BYTES:(i + 1) * VALUE_BYTES] for i in order])
    cpu, prev = cpu_seconds(), task.previous
    store = ShardStore.restore(prev.path if prev else None, prev.files if prev else None,
                               task.work / f"db-{task.shard}-{task.epoch}", options)
    txn = store.transaction()
    txn.set_many(*batch)
    txn.flush()
    new = store.snapshot(task.work / "snapshots" / f"{task.shard}-{task.epoch}", prev.path if prev else None,
                         prev.files if prev else None, options.compaction_turn(task.epoch, task.shard))
    store.close()
    return new, cpu_seconds() - cpu


def run(options: RocksDBOptions, work: Path, batches: list[list[np.ndarray]], pool: Pool, seed: int) -> list[dict[str, float]]:
    """Every epoch's seconds (all its shards), CPU per wall second, compactions, most
    level-0 files and snapshot bytes."""
    snaps: list[SnapshotInfo | None] = [None] * len(batches[0])
    out = []
    for epoch, shard_keys in enumerate(batches):
        tasks = [ShardEpoch(options, work, epoch, shard, keys, snaps[shard], seed * 100_000 + epoch * 100 + shard)
                 for shard, keys in enumerate(shard_keys)]
        t = time.perf_counter()
        done = pool.map(shard_epoch, tasks, chunksize=1)
        wall = time.perf_counter() - t
        for old in snaps:
            if old is not None:
                shutil.rmtree(old.path)  # as retention would, with keep_epochs 1
        snaps = [new for new, _ in done]
        cpu = sum(c for _, c in done)
        out.append({"seconds": wall, "cpu_s": cpu, "cpu_per_wall": cpu / wall,
                    "level0_files": max(new.level0_files or 0 for new in snaps),
                    "compactions": sum(new.compacted for new in snaps),
                    "bytes": sum(new.bytes_total for new in snaps)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--touched", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    rng = np.random.default_rng(7)
    everything = np.arange(args.keys, dtype=np.int64)
    epochs = [everything] + [rng.choice(everything, int(args.keys * args.touched), replace=False)
                             for _ in range(args.epochs)]
    batches = [[keys[keys % args.shards == shard] for shard in range(args.shards)] for keys in epochs]
    print(f"{args.shards} shard(s) of {args.keys:,} keys in all on {args.workers} worker(s), then {args.epochs} "
          f"epochs rewriting {args.touched:.0%} of them; {args.rounds} rounds, the ways taking turns")
    compared = ways(args.workers)
    runs: dict[str, list[list[dict[str, float]]]] = {way: [] for way in compared}
    work = Path(tempfile.mkdtemp(prefix="volley-compaction-"))
    try:
        with get_context("fork").Pool(args.workers) as pool:
            for r in range(args.rounds):
                for way, options in compared.items():
                    place = work / f"{way.replace(' ', '-')}-{r}"
                    runs[way].append(run(options, place, batches, pool, seed=r)[1:])  # the first epoch builds the state
                    shutil.rmtree(place, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = {}
    print(f"{'way':<11} {'med s':>6} {'p95 s':>6} {'max s':>6} {'cpu/wall':>8} {'mean s':>6} {'mean cpu s':>10} "
          f"{'max L0':>6} {'compactions':>11} {'most at once':>12} {'end MiB':>8} {'max MiB':>8}")
    for way, rounds in runs.items():
        every = [e for r in rounds for e in r]
        seconds = sorted(e["seconds"] for e in every)
        row = {"median_s": statistics.median(seconds), "p95_s": seconds[int(0.95 * (len(seconds) - 1))],
               "max_s": seconds[-1],
               "cpu_per_wall": statistics.median(e["cpu_per_wall"] for e in every) / args.workers,
               "mean_s": statistics.mean(seconds), "mean_cpu_s": statistics.mean(e["cpu_s"] for e in every),
               "max_level0_files": max(e["level0_files"] for e in every),
               "compactions_per_round": sum(e["compactions"] for e in every) / len(rounds),
               "most_at_once": max(e["compactions"] for e in every),
               "end_mib": statistics.median(r[-1]["bytes"] for r in rounds) / 2**20,
               "max_mib": max(e["bytes"] for e in every) / 2**20,
               "compactions": [e["compactions"] for e in rounds[0]]}
        summary[way] = row
        print(f"{way:<11} {row['median_s']:>6.3f} {row['p95_s']:>6.3f} {row['max_s']:>6.3f} "
              f"{row['cpu_per_wall']:>8.2f} {row['mean_s']:>6.3f} {row['mean_cpu_s']:>10.3f} "
              f"{row['max_level0_files']:>6} {row['compactions_per_round']:>11.1f} {row['most_at_once']:>12} "
              f"{row['end_mib']:>8.1f} {row['max_mib']:>8.1f}")
    for way, row in summary.items():
        print(f"{way}: shards that compacted in each epoch of round 1: {row['compactions']}")
    ours = summary["turns"]
    for way in ("one a turn", "together", "background"):
        other = summary[way]
        print(f"{way} / turns: {other['median_s'] / ours['median_s']:.2f}x the median epoch, "
              f"{other['p95_s'] / ours['p95_s']:.2f}x its p95, {other['max_s'] / ours['max_s']:.2f}x the slowest, "
              f"{other['mean_cpu_s'] / ours['mean_cpu_s']:.2f}x the CPU seconds of an epoch (mean, compactions "
              f"included), {other['end_mib'] / ours['end_mib']:.2f}x the snapshots at the end")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "compaction.json"
    out.write_text(json.dumps({**vars(args), "ways": summary}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
