"""What a shard's level 0 costs over a long history: one shard of ``--keys`` keys, then
``--epochs`` epochs that each rewrite ``--touched`` of them, as a shard task does (restore
N-1's snapshot, one ``WriteBatch``, snapshot, close). Two ways, taking turns:
``foreground`` (the engine's: RocksDB's own compactions off, level 0 folded into the
base when ``RocksDBOptions.compaction_due``) and ``background`` (as before: RocksDB's
compactions on, started at every open past four level-0 files and dropped unfinished at
close).

    ./dev bench compaction [--keys 1000000] [--touched 0.1] [--epochs 40] [--rounds 2]

Prints per way the median and p95 seconds of an epoch, its CPU seconds per wall second
(over 1: RocksDB's threads beside the task) and its mean seconds and CPU seconds (what
it costs where shard tasks share the cores: compactions included), the most level-0
files a snapshot held, and the snapshot's size at the end and at most; writes
bench/results/compaction.json.
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
class BackgroundCompactions(RocksDBOptions):
    """The options before foreground compaction: RocksDB compacts on its own, the
    snapshot never does."""

    def build(self) -> rocksdict.Options:
        opts = super().build()
        opts.set_disable_auto_compactions(False)
        return opts

    def compaction_due(self, level0_files: int, newer_bytes: int, base_bytes: int) -> bool:
        return False


WAYS = {"foreground": RocksDBOptions(), "background": BackgroundCompactions()}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process: RocksDB's too
    return usage.ru_utime + usage.ru_stime


def run(options: RocksDBOptions, work: Path, batches: list[np.ndarray], seed: int) -> list[dict[str, float]]:
    """Every epoch's seconds, CPU per wall second, level-0 files and snapshot bytes."""
    rng = np.random.default_rng(seed)
    snap: SnapshotInfo | None = None
    out = []
    for epoch, keys in enumerate(batches):
        state_keys = encode_keys(1, (keys % 256).astype(np.int64), pa.array(keys))
        order = sorted(range(len(state_keys)), key=state_keys.__getitem__)
        values = rng.bytes(VALUE_BYTES * len(keys))
        batch = ([state_keys[i] for i in order], [values[i * VALUE_BYTES:(i + 1) * VALUE_BYTES] for i in order])
        t, cpu = time.perf_counter(), cpu_seconds()
        store = ShardStore.restore(snap.path if snap else None, snap.files if snap else None,
                                   work / f"db-{epoch}", options)
        txn = store.transaction()
        txn.set_many(*batch)
        txn.flush()
        new = store.snapshot(work / "snapshots" / str(epoch), snap.path if snap else None,
                             snap.files if snap else None)
        store.close()
        wall = time.perf_counter() - t
        if snap is not None:
            shutil.rmtree(snap.path)  # as retention would, with keep_epochs 1
        snap = new
        out.append({"seconds": wall, "cpu_s": cpu_seconds() - cpu, "cpu_per_wall": (cpu_seconds() - cpu) / wall,
                    "level0_files": new.level0_files, "bytes": new.bytes_total, "compacted": new.compacted})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--touched", type=float, default=0.1)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    rng = np.random.default_rng(7)
    everything = np.arange(args.keys, dtype=np.int64)
    batches = [everything] + [rng.choice(everything, int(args.keys * args.touched), replace=False)
                              for _ in range(args.epochs)]
    print(f"one shard of {args.keys:,} keys, then {args.epochs} epochs rewriting {args.touched:.0%} of them; "
          f"{args.rounds} rounds, the ways taking turns")
    runs: dict[str, list[list[dict[str, float]]]] = {way: [] for way in WAYS}
    work = Path(tempfile.mkdtemp(prefix="volley-compaction-"))
    try:
        for r in range(args.rounds):
            for way, options in WAYS.items():
                place = work / f"{way}-{r}"
                runs[way].append(run(options, place, batches, seed=r)[1:])  # the first epoch builds the state
                shutil.rmtree(place, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = {}
    print(f"{'way':<11} {'med s':>6} {'p95 s':>6} {'cpu/wall':>8} {'mean s':>6} {'mean cpu s':>10} {'max L0':>6} "
          f"{'compactions':>11} "
          f"{'end MiB':>8} {'max MiB':>8}")
    for way, rounds in runs.items():
        epochs = [e for r in rounds for e in r]
        seconds = sorted(e["seconds"] for e in epochs)
        row = {"median_s": statistics.median(seconds), "p95_s": seconds[int(0.95 * (len(seconds) - 1))],
               "cpu_per_wall": statistics.median(e["cpu_per_wall"] for e in epochs),
               "mean_s": statistics.mean(seconds), "mean_cpu_s": statistics.mean(e["cpu_s"] for e in epochs),
               "max_level0_files": max(e["level0_files"] for e in epochs),
               "compactions_per_round": sum(e["compacted"] for e in epochs) / len(rounds),
               "end_mib": statistics.median(r[-1]["bytes"] for r in rounds) / 2**20,
               "max_mib": max(e["bytes"] for e in epochs) / 2**20,
               "level0_files": [e["level0_files"] for e in rounds[0]]}
        summary[way] = row
        print(f"{way:<11} {row['median_s']:>6.3f} {row['p95_s']:>6.3f} {row['cpu_per_wall']:>8.2f} "
              f"{row['mean_s']:>6.3f} {row['mean_cpu_s']:>10.3f} "
              f"{row['max_level0_files']:>6} {row['compactions_per_round']:>11.1f} {row['end_mib']:>8.1f} "
              f"{row['max_mib']:>8.1f}")
    for way, row in summary.items():
        print(f"{way}: level-0 files after each epoch of round 1: {row['level0_files']}")
    fg, bg = summary["foreground"], summary["background"]
    print(f"background / foreground: {bg['median_s'] / fg['median_s']:.2f}x the median epoch, "
          f"{bg['cpu_per_wall'] / fg['cpu_per_wall']:.2f}x its CPU per wall second, "
          f"{bg['mean_cpu_s'] / fg['mean_cpu_s']:.2f}x the CPU seconds of an epoch (mean, compactions included), "
          f"{bg['end_mib'] / fg['end_mib']:.2f}x the snapshot at the end")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "compaction.json"
    out.write_text(json.dumps({**vars(args), "ways": summary}, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
