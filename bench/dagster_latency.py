"""Latency through Dagster: a file lands in the source -> the sensor cuts an epoch ->
a run commits it, on a real ``dagster dev`` (sensor every 5 s, in-process executor).

    ./dev bench dagster_latency [--files 5] [--records 1000] [--connect]

With ``--connect`` runs use a Spark Connect server started here instead of a new
local Spark JVM per run.

Prints, per file, the seconds from landing to the epoch's manifest, and per run
the run's wall time against the epoch's own processing time (the difference is
the per-epoch overhead of a Dagster run: process start, Spark start, events).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from harness.dagster_dev import dagster_dev
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.demo.events import generate

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=5)
    parser.add_argument("--records", type=int, default=1_000)
    parser.add_argument("--connect", action="store_true", help="runs use a Spark Connect server")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="volley-dagster-bench-"))
    (base / "events").mkdir()
    log = EpochLog(base / "state" / "payments")
    rows = []
    env = {"VOLLEY_BENCH_BASE": str(base)}
    server = None
    if args.connect:
        from volley_dagster.spark.connect import start_connect_server

        server = start_connect_server(15_077, "local[2]", base / "connect.log")
        env["VOLLEY_SPARK_REMOTE"] = server.url
    with dagster_dev(ROOT / "bench" / "dagster_workspace.yaml", dagster_yaml=ROOT / "dagster.yaml",
                     overrides={"run_coordinator": {"config": {"dequeue_interval_seconds": 1}}},
                     home=base / "dagster_home", env=env) as srv:
        for i in range(args.files):
            landed = time.time()
            generate(base / "events", 1, args.records, 100, first_file=i)
            epoch = i + 1
            while not log.is_committed(epoch):
                if time.time() - landed > 300:
                    raise SystemExit(f"epoch {epoch} not committed after 300 s:\n{srv.log_tail()}")
                time.sleep(0.2)
            latency = time.time() - landed
            manifest = log.committed_manifest(epoch)
            run = _run_for(srv, epoch)
            rows.append({"epoch": epoch, "landing_to_commit_s": latency, "run_wall_s": run,
                         "epoch_processing_s": manifest.durations["total"]})
            print(f"epoch {epoch}: landed -> committed {latency:6.1f} s; run {run:5.1f} s, "
                  f"of which epoch processing {manifest.durations['total']:4.1f} s")
    if server is not None:
        server.stop()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "epoch"}
    print(f"\n{'Spark Connect' if args.connect else 'a local Spark per run'}: median over {len(rows)} files of {args.records:,} records: landing -> committed "
          f"{med['landing_to_commit_s']:.1f} s; run wall {med['run_wall_s']:.1f} s, epoch processing "
          f"{med['epoch_processing_s']:.1f} s -> run overhead {med['run_wall_s'] - med['epoch_processing_s']:.1f} s")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "dagster_latency.json").write_text(json.dumps({"median": med, "epochs": rows}, indent=1))


def _run_for(srv, epoch: int) -> float:
    """Wall seconds of the run that committed ``epoch`` (start to end, from the run record)."""
    from dagster import RunsFilter

    instance = srv.instance()
    deadline = time.time() + 60
    while time.time() < deadline:
        records = instance.get_run_records(RunsFilter(tags={"dagster/partition": f"{epoch:010d}"}))
        done = [r for r in records if r.end_time]
        if done:
            return done[0].end_time - done[0].start_time
        time.sleep(0.5)
    return float("nan")


if __name__ == "__main__":
    main()
