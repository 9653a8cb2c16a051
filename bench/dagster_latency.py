"""Freshness through Dagster, with ``./dev dagster``'s defaults: a file lands in the
source -> the sensor cuts an epoch -> a run commits it, on a real ``dagster dev``
with the shipped ``dagster.yaml`` and the demo deployments.

    ./dev bench dagster_latency                                   # 1,000-record files, payments
    ./dev bench dagster_latency --records 300000 --every 20 --pipelines payments,merchant_minutes
    ./dev bench dagster_latency --spark local                     # a local Spark per run (the old default)

Prints, per file and pipeline, the seconds from landing to the epoch's manifest and where
they went: waiting for the sensor's tick and its cut (the cut's recorded wall clock),
the cut to the run's request, the queue and the launch (the run's creation to its
start), the run's start to its epoch, the plan (the epoch's time outside its read,
stage and sinks), the stage, the sinks and the manifest; and after the commit, the
checks to the run's end. Then medians and p95s, and the machine's core count. The first
file after ``dagster dev`` starts (the fork server and the Spark session warming up)
is reported on its own line and left out of the medians and p95s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from harness.dagster_dev import dagster_dev
from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.demo.events import generate

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=8, help="files measured, after one that warms up")
    parser.add_argument("--records", type=int, default=1_000)
    parser.add_argument("--every", type=float, default=0.0,
                        help="seconds between files (0: each file 0-5 s after the last commit, at random, so that "
                             "landings do not lock to the sensor's 5 s loop)")
    parser.add_argument("--pipelines", default="payments")
    parser.add_argument("--spark", choices=["warm", "local"], default="warm")
    args = parser.parse_args()
    pipelines = args.pipelines.split(",")
    base = Path(tempfile.mkdtemp(prefix="volley-dagster-bench-"))
    (base / "events").mkdir()
    logs = {name: EpochLog(base / "state" / name) for name in pipelines}
    env = {"VOLLEY_BENCH_BASE": str(base), "VOLLEY_BENCH_PIPELINES": args.pipelines, "VOLLEY_BENCH_SPARK": args.spark}
    rows: list[dict] = []
    done: list[tuple[str, int, int]] = []  # (pipeline, file, the epoch that committed its last record)
    with dagster_dev(ROOT / "bench" / "dagster_workspace.yaml", dagster_yaml=ROOT / "dagster.yaml",
                     home=base / "dagster_home", env=env) as srv:
        if args.spark == "warm":  # as ./dev dagster: the warm Spark starts beside the UI
            from volley_dagster.spark.warm import find_or_start

            find_or_start(base / "dagster_home" / "warm-spark", owner_pid=srv.proc.pid)
        landed: dict[int, float] = {}
        total = args.files + 1  # file 0 warms up
        pending = {(name, i) for name in pipelines for i in range(total)}
        pause = random.Random(7)
        next_landing: float | None = time.time()
        while pending:
            i = len(landed)
            if i < total and not args.every and next_landing is None and all(
                    (n, j) not in pending for n in pipelines for j in range(i)):
                next_landing = time.time() + pause.uniform(0, 5)
            if i < total and next_landing is not None and time.time() >= next_landing:
                generate(base / "events", 1, args.records, 1_000, first_file=i)
                landed[i] = time.time()
                next_landing = landed[i] + args.every if args.every else None
            for name, file in sorted(pending):
                if file in landed and _committed(logs[name], file, args.records):
                    pending.discard((name, file))
                    done.append((name, file, logs[name].last_committed()))
                    print(f"{name} file {file}: committed", flush=True)
            if time.time() - max(landed.values(), default=time.time()) > 300:
                raise SystemExit(f"not committed 300 s after landing: {sorted(pending)}\n{srv.logtail()}")
            time.sleep(0.1)
        for name, file, epoch in done:  # once each run has ended: its checks come after the commit
            rows.append(_row(srv, logs[name], name, file, epoch, landed[file]))
            r = rows[-1]
            print(f"{name} file {file}: landed -> committed {r['landing_to_commit_s']:6.1f} s = "
                  + " + ".join(f"{label} {r[key]:.2f}" for key, label in SPLIT) + f"; then {r['after_commit_s']:.2f} s "
                  "of checks to the run's end")
    summary = {"cores": os.cpu_count(), "spark": args.spark, "records_per_file": args.records, "every_s": args.every,
               "pipelines": pipelines, "files": args.files,
               "first_file_s": {r["pipeline"]: r["landing_to_commit_s"] for r in rows if r["file"] == 0}}
    measured = [r for r in rows if r["file"] > 0]
    for key in ("landing_to_commit_s", "run_overhead_s", "epoch_s", *(k for k, _ in SPLIT), "after_commit_s"):
        values = sorted(r[key] for r in measured if r[key] == r[key])
        summary[key] = {"median": statistics.median(values), "p95": _p95(values)} if values else {}
    print(f"\n{args.spark} Spark, {os.cpu_count()} cores, {args.files} files of {args.records:,} records "
          f"{f'every {args.every:.0f} s' if args.every else 'one after another'}, pipelines {args.pipelines}:")
    cold = ", ".join(f"{name} {s:.1f} s" for name, s in summary["first_file_s"].items())
    print(f"  {'first file (warming up)':28s} {cold}")
    for key, label in (("landing_to_commit_s", "landing -> committed"), ("run_overhead_s", "run created -> epoch start"),
                       ("epoch_s", "epoch, sinks included")):
        print(f"  {label:28s} median {summary[key]['median']:6.2f} s   p95 {summary[key]['p95']:6.2f} s")
    print("  where landing -> committed goes (medians, s): "
          + ", ".join(f"{label} {summary[key]['median']:.2f}" for key, label in SPLIT)
          + f"; after the commit, checks to the run's end {summary['after_commit_s']['median']:.2f}")
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "dagster_latency.json").write_text(json.dumps({"summary": summary, "files": rows}, indent=1))


def _committed(log: EpochLog, file: int, records: int) -> bool:
    """Whether every record of file ``file`` (records ``file * records`` on) is committed."""
    committed = log.last_committed()
    return committed > 0 and sum(log.committed_manifest(e).records_in for e in range(1, committed + 1)) >= (
        (file + 1) * records)


SPLIT = (("tick_s", "waiting for the sensor's tick and its cut"), ("request_s", "the cut to the run's request"),
         ("queue_s", "the queue and the launch"), ("setup_s", "the run's start to its epoch"),
         ("plan_s", "the plan"), ("stage_s", "the stage"), ("sinks_s", "the sinks and the manifest"))


def _row(srv, log: EpochLog, pipeline: str, file: int, epoch: int, landed: float) -> dict:
    """Where the file's time went, from landing to the manifest of the epoch that committed
    its last record (``SPLIT``, summing to landing -> committed), and after it."""
    manifest = log.committed_manifest(epoch)
    commit_time = datetime.fromisoformat(manifest.committed_at).timestamp()
    d = manifest.durations
    epoch_start = commit_time - d["total"]
    cut_us = log.offsets(epoch).cut_at_us
    cut = cut_us / 1e6 if cut_us is not None else float("nan")
    run = _run_record(srv, pipeline, epoch)
    created = run.create_timestamp.timestamp() if run else float("nan")
    started = run.start_time if run and run.start_time else float("nan")
    ended = run.end_time if run and run.end_time else float("nan")
    stage = d["read_transform"] + d["state_stage"]
    return {"pipeline": pipeline, "file": file, "epoch": epoch, "landing_to_commit_s": commit_time - landed,
            "epoch_s": d["total"], "run_overhead_s": epoch_start - created,
            "tick_s": cut - landed, "request_s": created - cut, "queue_s": started - created,
            "setup_s": epoch_start - started, "plan_s": d["total"] - stage - d["sinks"], "stage_s": stage,
            "sinks_s": d["sinks"] + (commit_time - epoch_start - d["total"]), "after_commit_s": ended - commit_time}


def _run_record(srv, pipeline: str, epoch: int, wait_s: float = 60.0):
    """The run that committed ``epoch``, once it has ended (None: not found)."""
    from dagster import RunsFilter

    deadline = time.time() + wait_s
    with srv.instance() as instance:
        while True:
            for tags in ({"dagster/partition": f"{epoch:010d}"}, {"dagster/asset_partition_range_end": f"{epoch:010d}"}):
                records = instance.get_run_records(RunsFilter(tags={**tags, "volley/pipeline": pipeline}))
                if records and (records[0].end_time or time.time() > deadline):
                    return records[0]
            if time.time() > deadline:
                return None
            time.sleep(0.5)


def _p95(values: list[float]) -> float:
    return values[min(len(values) - 1, int(round(0.95 * (len(values) - 1))))]


if __name__ == "__main__":
    main()
