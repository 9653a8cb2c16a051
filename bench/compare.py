"""Side by side: our engine against Spark Structured Streaming (RocksDB state store,
``Trigger.AvailableNow``, ``foreachBatch`` into Delta) on the same files, in one run.

    ./dev bench compare [--records 10000000] [--keys 1000000] [--epochs 10] [--shards 4]
                        [--workloads A,As,B,C,D,DB,DP,DBP] [--modes warm,cold] [--cold-epochs 3]
                        [--state-keys 10000000] [--touched 100000] [--zipf 1.3]

The workloads are in ``bench/workloads.py`` (``As`` is A keyed by strings, ours
only); the peer in ``bench/peer_sss.py``. Each
engine runs in its own process (so its peak RSS is its own): warm runs every epoch
in one long-lived Spark; cold starts a process, and so Spark, per epoch, as a plain
Dagster run does. Both engines' Delta tables are checked against a reference
computed from the files. A's and B's floors (D, DB) are also timed right after each
of their epochs, in the same process: the target ratios are the medians of those
pairs, which the machine's drift within a run does not skew. DP and DBP are D's and
DB's aggregations through A's and B's plans and one Python task per shard that hands
its rows back unchanged, each paired with its floor: what a state stage in the Python
workers pays before any state work. Prints a table; writes ``bench/results/compare.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402

from bench.common import finish, log_arguments  # noqa: E402
from bench.workloads import (  # noqa: E402
    Workload,
    check_table,
    event_log,
    reference_totals,
    reference_windows,
    scaling_log,
    string_key_log,
)
from volley_dagster.settings import RunSettings  # noqa: E402

MiB = 2**20


# -- measurement helpers (run inside the engine processes) --------------------------------

def jvm_peak_rss_mib() -> float:
    """Peak RSS of this process's Spark JVM (the driver; in local mode also the executors)."""
    peak = 0.0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"PPid:\t{os.getpid()}\n" in text and "Name:\tjava" in text:
            hwm = next(line for line in text.splitlines() if line.startswith("VmHWM:"))
            peak = max(peak, int(hwm.split()[1]) / 1024)
    return peak


def self_peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def dir_bytes(path: Path) -> int:
    """Bytes on disk, each hardlinked file once."""
    seen, total = set(), 0
    for p in path.rglob("*"):
        if p.is_file():
            st = p.stat()
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def spark_session(shards: int):
    from volley_dagster.spark.session import get_or_create_spark

    return get_or_create_spark(conf={"spark.sql.shuffle.partitions": str(shards)})


# -- our engine ---------------------------------------------------------------------------

def volley_runner(w: Workload, work: Path, spark):
    from volley_dagster import EpochRunner

    return EpochRunner(w.pipeline(work / "tables"), work / "state", RunSettings(keep_epochs=3), spark=spark)


def volley_epoch(runner, w: Workload, index: int, paired: bool) -> dict[str, Any]:
    """Run file ``index`` as one epoch; its figures. Right after it, in the same Spark,
    its floor over the same file: the ratio of the two is measured under the same load
    (this machine is shared, and its speed drifts within a run). ``paired``: warm runs
    only (a cold run's time includes its process's start, and so would the floor's)."""
    runner.settings = replace(runner.settings, max_records_per_epoch=w.records(index))
    t = time.perf_counter()
    r = runner.run_next()
    wall = time.perf_counter() - t
    d = r.durations
    floor = FLOOR_OF.get(w.name) if paired else None
    return {
        "floor_s": floor_epoch(runner.spark, floor, w.events / w.files[index]) if floor else None,
        "epoch": r.epoch, "records": r.records_in, "seconds": wall, "keys_touched": r.keys_touched,
        "phases": {"read_transform": d["read_transform"], "state_stage": d["state_stage"],
                   "restore": d["restore_shard_sum"], "merge": d["merge_shard_sum"], "flush": d["flush_shard_sum"],
                   "snapshot": d["snapshot_shard_sum"],
                   **{f"sink_{name}": s.seconds or 0.0 for name, s in r.sinks.items()}},
        "bytes_written": r.state_bytes_written,
        "worker_peak_rss_mib": max(s.peak_rss_mib for s in r.shards.values()),
        "state_reads": sorted(s.read_mode for s in r.shards.values()),  # "resident": the memory mirror
    }


def volley_empty_epochs(runner, n: int) -> list[float]:
    """End-to-end seconds of empty epochs (cut, Spark stage, sinks, manifest)."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        rng = runner.cut_next(allow_empty=True)
        runner.run(rng.epoch)
        times.append(time.perf_counter() - t)
    return times


def run_volley(w: Workload, work: Path, indices: list[int], empty: int, paired: bool) -> dict[str, Any]:
    spark = spark_session(w.shards)
    runner = volley_runner(w, work, spark)
    batches = [volley_epoch(runner, w, i, paired) for i in indices]
    out: dict[str, Any] = {"batches": batches}
    if empty:
        out["empty_epoch_s"] = volley_empty_epochs(runner, empty)
    out["checkpoint_bytes"] = dir_bytes(work / "state")
    out["driver_peak_rss_mib"] = jvm_peak_rss_mib() + self_peak_rss_mib()
    return out


# -- the peer and the floor ---------------------------------------------------------------

def run_peer(w: Workload, work: Path, indices: list[int]) -> dict[str, Any]:
    """Spark Structured Streaming over the files of ``indices``, hardlinked into its own
    source folder (so a cold run sees exactly one new file per process)."""
    from bench.peer_sss import run_peer as peer

    source = work / "source"
    source.mkdir(parents=True, exist_ok=True)
    for i in indices:
        target = source / w.files[i]
        if not target.exists():
            os.link(w.events / w.files[i], target)
    spark = spark_session(w.shards)
    t = time.perf_counter()
    result = peer(spark, source, work / "peer", w.name, w.shards)
    wall = time.perf_counter() - t
    batches = [{"epoch": b["batch_id"] + 1, "records": b["records"], "seconds": b["seconds"],
                "phases": {**b.get("phases", {}), "sink_delta": b.get("phases", {}).get("fn_delta_commit", 0.0)},
                "state": b.get("state", {})} for b in result["batches"]]
    for flush in result["empty_batches"]:  # B's no-data batch emits what the last file's watermark closed
        if batches:
            batches[-1]["seconds"] += flush["seconds"]
    return {"batches": batches, "wall_s": wall, "checkpoint_bytes": dir_bytes(work / "peer"),
            "driver_peak_rss_mib": jvm_peak_rss_mib() + self_peak_rss_mib(), "delta_uri": result["delta_uri"]}


FLOOR_OF = {"A": "D", "B": "DB", "DP": "D", "DBP": "DB"}  # a workload's floor, also timed beside each of its epochs


def floor_epoch(spark, floor: str, file: Path, shards: int = 4) -> float:
    """Seconds of one epoch's floor: D, a stateless Spark batch doing A's aggregation
    over the epoch's file; DB, B's, a groupBy of (merchant, 1-minute window) over all its
    events; DP and DBP, D's and DB's aggregations in A's and B's plans, handed to one
    Python task per shard and back unchanged (``python_handover``)."""
    t = time.perf_counter()
    events = spark.read.parquet(str(file))
    if floor in ("DP", "DBP"):
        python_handover(events, shards, windowed=floor == "DBP").toArrow()
    else:
        rows, window, values = floor_aggregation(events, windowed=floor == "DB")
        rows.groupBy("merchant_id", *window).agg(*values).toArrow()
    return time.perf_counter() - t


def floor_aggregation(events, windowed: bool):
    """D's (or DB's) rows, window column (none for D) and named aggregates, as A's
    (or B's) pipeline in ``bench/workloads.py`` computes them."""
    from pyspark.sql import functions as F

    if windowed:
        return events, [F.window("event_time", "1 minute")], [
            F.count(F.lit(1)).alias("events"), F.sum("amount").alias("total"), F.max("amount").alias("largest")]
    return events.where("status = 'active'"), [], [F.sum("amount").alias("total"), F.count(F.lit(1)).alias("events")]


def python_handover(events, shards: int, windowed: bool):
    """A's (or B's) state stage with no state: the same shuffle into shard partitions,
    the same partials per key (and window), one ``per_shard`` Python task per shard
    that returns its rows as they came. What a state kept in the Python workers
    (rocksdict) pays before its first lookup, on top of the stateless floor."""
    from pyspark.sql import functions as F

    from volley_dagster import columns
    from volley_dagster.spark.partitioning import ROUTING_COLUMNS, per_shard, to_shards
    from volley_dagster.state.keys import ShardLayout

    rows, window, values = floor_aggregation(events.withColumnRenamed("merchant_id", columns.KEY), windowed)
    by: list[str] = []
    if window:  # as B's plan carries a window: its bounds in microseconds
        by = [columns.WINDOW_START, columns.WINDOW_END]
        rows = (rows.withColumn(columns.WINDOW_START, F.unix_micros(window[0].getField("start")))
                .withColumn(columns.WINDOW_END, F.unix_micros(window[0].getField("end"))))
    partials = to_shards(rows, ShardLayout(shards)).groupBy(*ROUTING_COLUMNS, columns.KEY, *by).agg(*values)
    returned = [c for c in partials.columns if c not in ROUTING_COLUMNS]
    routed = partials.select(*returned, columns.SHARD)
    return per_shard(routed, lambda table: table.select(returned), partials.select(*returned).schema)


def run_floor(w: Workload, indices: list[int]) -> dict[str, Any]:
    """A floor's epochs; DP's and DBP's each paired with D's or DB's over the same file,
    the two taking turns to go first (the second read of a file leans fast)."""
    spark = spark_session(w.shards)
    paired = FLOOR_OF.get(w.name)
    batches = []
    for i in indices:
        file = w.events / w.files[i]
        order = [w.name, paired] if i % 2 == 0 else [paired, w.name]
        seconds = {name: floor_epoch(spark, name, file, w.shards) for name in order if name}
        batches.append({"epoch": i + 1, "records": w.records(i), "seconds": seconds[w.name], "phases": {},
                        "floor_s": seconds.get(paired) if paired else None})
    return {"batches": batches, "driver_peak_rss_mib": jvm_peak_rss_mib() + self_peak_rss_mib()}


# -- orchestration ------------------------------------------------------------------------

def child(args: argparse.Namespace) -> None:
    """One engine process: ``compare.py --child ENGINE --workload W --indices 0,1,..``."""
    w = Workload(args.workload, Path(args.events), tuple(args.files.split(",")), args.shards)
    work, indices = Path(args.work), [int(i) for i in args.indices.split(",")]
    if args.child == "volley":
        out = run_volley(w, work, indices, args.empty, args.paired)
    elif args.child == "peer":
        out = run_peer(w, work, indices)
    else:
        out = run_floor(w, indices)
    Path(args.out).write_text(json.dumps(out))


def spawn(engine: str, w: Workload, work: Path, indices: list[int], empty: int = 0, paired: bool = False) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    out = work / f"{engine}-{indices[0]}-{indices[-1]}.json"
    cmd = [sys.executable, __file__, "--child", engine, "--workload", w.name, "--events", str(w.events),
           "--files", ",".join(w.files), "--shards", str(w.shards), "--work", str(work),
           "--indices", ",".join(map(str, indices)), "--empty", str(empty), "--out", str(out)] + (["--paired"] if paired else [])
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - t
    return result


def run_mode(engine: str, w: Workload, work: Path, mode: str, epochs: int, empty: int) -> dict[str, Any]:
    indices = list(range(epochs))
    if mode == "warm":
        return spawn(engine, w, work, indices, empty, paired=True)
    runs = [spawn(engine, w, work, [i]) for i in indices]  # a new process and Spark per epoch
    batches = []
    for run in runs:
        for b in run["batches"]:
            b["seconds_with_start"] = run["process_s"]
            batches.append(b)
    return {"batches": batches, "driver_peak_rss_mib": max(r["driver_peak_rss_mib"] for r in runs),
            "checkpoint_bytes": runs[-1].get("checkpoint_bytes", 0), "delta_uri": runs[-1].get("delta_uri")}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Records/s over the measured epochs (the first, state-building or JIT-warming
    epoch is left out when there are more), median and p95 latency, median phases."""
    batches = [b for b in result["batches"] if b["records"]]
    measured = batches[1:] if len(batches) > 2 else batches
    key = "seconds_with_start" if "seconds_with_start" in (measured[0] if measured else {}) else "seconds"
    secs = sorted(b[key] for b in measured)
    records = sum(b["records"] for b in measured)
    phases: dict[str, float] = {}
    for name in {p for b in measured for p in b.get("phases", {})}:
        phases[name] = statistics.median(b["phases"].get(name, 0.0) for b in measured)
    worker = [b["worker_peak_rss_mib"] for b in result["batches"] if "worker_peak_rss_mib" in b]
    written = [b["bytes_written"] for b in measured if "bytes_written" in b]
    paired = [b[key] / b["floor_s"] for b in measured if b.get("floor_s")]
    return {
        "epochs": len(measured),
        "paired_floor_ratio": statistics.median(paired) if paired else None,
        "records_per_s": records / sum(secs) if secs else 0.0,
        "median_s": statistics.median(secs) if secs else 0.0,
        "p95_s": secs[min(len(secs) - 1, int(round(0.95 * (len(secs) - 1))))] if secs else 0.0,
        "phases": phases,
        "driver_peak_rss_mib": result.get("driver_peak_rss_mib", 0.0),
        "worker_peak_rss_mib": max(worker) if worker else None,
        "checkpoint_bytes": result.get("checkpoint_bytes", 0),
        "written_per_epoch_bytes": statistics.median(written) if written else None,
    }


def engine_table(engine: str, w: Workload, work: Path) -> pa.Table:
    from deltalake import DeltaTable

    uri = work / "tables" / "delta" if engine == "volley" else work / "peer" / f"delta-{w.name}"
    return DeltaTable(str(uri)).to_pyarrow_table()


PHASES = ["read_transform", "restore", "merge", "flush", "snapshot", "sink_delta"]


def print_row(workload: str, engine: str, mode: str, s: dict[str, Any], correct: str) -> None:
    ph = s["phases"]
    worker = f"{s['worker_peak_rss_mib']:.0f}" if s["worker_peak_rss_mib"] else "-"
    written = f"{s['written_per_epoch_bytes'] / MiB:.1f}" if s["written_per_epoch_bytes"] is not None else "-"
    print(f"{workload:<9} {engine:<7} {mode:<5} {s['records_per_s']:>10,.0f} {s['median_s']:>7.2f} {s['p95_s']:>7.2f} "
          + " ".join(f"{ph[p]:>6.2f}" if p in ph else f"{'-':>6}" for p in PHASES)
          + f" {s['driver_peak_rss_mib']:>7.0f} {worker:>7} {s['checkpoint_bytes'] / MiB:>8.1f} {written:>8}  {correct}")


def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser)
    parser.add_argument("--zipf", type=float, default=None, help="Zipf exponent for skewed keys (default uniform)")
    parser.add_argument("--workloads", default="A,As,B,C,D,DB,DP,DBP")
    parser.add_argument("--modes", default="warm,cold")
    parser.add_argument("--engines", default="volley,peer")
    parser.add_argument("--cold-epochs", type=int, default=3)
    parser.add_argument("--state-keys", type=int, default=10_000_000)
    parser.add_argument("--touched", type=int, default=100_000)
    parser.add_argument("--empty-epochs", type=int, default=5)
    # one engine process (internal)
    parser.add_argument("--child", choices=["volley", "peer", "floor"])
    for name in ("--workload", "--events", "--files", "--work", "--indices", "--out"):
        parser.add_argument(name)
    parser.add_argument("--empty", type=int, default=0)
    parser.add_argument("--paired", action="store_true", help="time the workload's floor after each epoch")
    args = parser.parse_args()
    if args.child:
        return child(args)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-compare-"))
    workloads, modes, engines = args.workloads.split(","), args.modes.split(","), args.engines.split(",")
    t = time.perf_counter()
    ab = event_log(work / "events", args.epochs, args.records, args.keys, args.zipf)
    print(f"{os.cpu_count()} cores; {args.records:,} events over {args.keys:,} keys"
          f"{f' (Zipf {args.zipf})' if args.zipf else ''} in {args.epochs} files, {args.shards} shards/shuffle partitions;"
          f" data ready in {time.perf_counter() - t:.0f} s -> {work}")
    print(f"{'workload':<9} {'engine':<7} {'mode':<5} {'rec/s':>10} {'med s':>7} {'p95 s':>7} "
          + " ".join(f"{p[:6]:>6}" for p in PHASES) + f" {'drv MiB':>7} {'wrk MiB':>7} {'ckpt MiB':>8} {'wr/ep MiB':>8}  check")
    report: dict[str, Any] = {"cores": os.cpu_count(), "args": {k: v for k, v in vars(args).items()
                                                                  if v is not None and k not in ("child",)},
                              "results": []}

    def record(workload: str, engine: str, mode: str, summary: dict[str, Any], correct: str) -> None:
        print_row(workload, engine, mode, summary, correct)
        report["results"].append({"workload": workload, "engine": engine, "mode": mode, "check": correct, **summary})

    for name in [n for n in ("A", "As", "B") if n in workloads]:
        w = (Workload(name, work / "events", ab, args.shards) if name != "As"
             else Workload(name, work / "events-string-keys", string_key_log(work / "events-string-keys", work / "events", ab), args.shards))
        expected = reference_windows(w.events, ab) if name == "B" else reference_totals(work / "events", ab)
        for mode in modes:
            epochs = args.epochs if mode == "warm" else min(args.cold_epochs, args.epochs)
            for engine in [e for e in engines if name != "As" or e == "volley"]:  # As: against our own A
                place = work / f"{name}-{engine}-{mode}"
                shutil.rmtree(place, ignore_errors=True)
                result = run_mode(engine, w, place, mode, epochs, args.empty_epochs if engine == "volley" and mode == "warm" and name == "A" else 0)
                check = check_table(name, engine_table(engine, w, place), expected) if epochs == args.epochs else "(partial run)"
                summary = summarize(result)
                if "empty_epoch_s" in result:
                    summary["empty_epoch_median_s"] = statistics.median(result["empty_epoch_s"])
                record(name, engine, mode, summary, check)
    for floor in [n for n in ("D", "DB", "DP", "DBP") if n in workloads]:
        w = Workload(floor, work / "events", ab, args.shards)
        result = spawn("floor", w, work / f"{floor}-floor", list(range(args.epochs)))
        record(floor, "spark", "warm", summarize(result), "-")
    if "C" in workloads:
        for state_keys in (args.state_keys, args.touched):
            label = f"C {state_keys // 1000:,}k"
            events = work / f"scaling-{state_keys}"
            files = scaling_log(events, state_keys, args.touched, args.epochs)
            w = Workload("C", events, files, args.shards)
            expected = reference_totals(events, files)
            for engine in engines:
                place = work / f"C{state_keys}-{engine}"
                shutil.rmtree(place, ignore_errors=True)
                result = spawn(engine, w, place, list(range(len(files))))
                result["batches"] = result["batches"][1:]  # the state-building epoch is set-up
                record(label, engine, "warm", summarize(result), check_table("C", engine_table(engine, w, place), expected))
    print_targets(report)
    finish("compare", report, work, keep=bool(args.workdir))


def print_targets(report: dict[str, Any]) -> None:
    """The issue's targets as ratios measured in this run."""
    res = {(r["workload"], r["engine"], r["mode"]): r for r in report["results"]}
    lines = []
    for name in ("A", "B"):
        ours, peer = res.get((name, "volley", "warm")), res.get((name, "peer", "warm"))
        if ours and peer and peer["records_per_s"]:
            lines.append(f"{name}: {ours['records_per_s'] / peer['records_per_s']:.1f}x the peer's records/s")
    a, d = res.get(("A", "volley", "warm")), res.get(("D", "spark", "warm"))
    b, db = res.get(("B", "volley", "warm")), res.get(("DB", "spark", "warm"))
    for name, ours, floor, target in (("A", a, d, 1.5), ("B", b, db, 2)):
        paired = ours.get("paired_floor_ratio") if ours else None
        if paired:
            lines.append(f"{name} / {FLOOR_OF[name]}: {paired:.2f}x the stateless floor's epoch time, median of each "
                         f"epoch against its floor timed right after it (target <= {target}x)")
        if ours and floor:
            lines.append(f"{name} / {FLOOR_OF[name]}: {ours['median_s'] / floor['median_s']:.2f}x, median against "
                         "median of the floor's own process")
    for name, floor, workload, ours in (("DP", "D", "A", a), ("DBP", "DB", "B", b)):
        handover = res.get((name, "spark", "warm"))
        if handover and handover.get("paired_floor_ratio"):
            lines.append(f"{name} / {floor}: handing {floor}'s partials to one Python task per shard and back, and "
                         f"nothing else, takes {handover['paired_floor_ratio']:.2f}x {floor} (median of pairs)")
        if handover and ours:
            lines.append(f"{workload} / {name}: {ours['median_s'] / handover['median_s']:.2f}x, median against median")
    strings = res.get(("As", "volley", "warm"))
    if a and strings:
        lines.append(f"As / A: string keys take {strings['median_s'] / a['median_s']:.2f}x the int keys' epoch time "
                     f"(target <= 1.15x)")
    big = next((r for k, r in res.items() if k[0].startswith("C") and k[1] == "volley" and r is not None), None)
    small = [r for k, r in res.items() if k[0].startswith("C") and k[1] == "volley"]
    if big and len(small) == 2:
        lines.append(f"C: the same keys touched in the large state take {small[0]['median_s'] / small[1]['median_s']:.2f}x "
                     f"the small state's epoch (target <= 1.5x); checkpoint written per epoch "
                     f"{(small[0]['written_per_epoch_bytes'] or 0) / MiB:.1f} vs {(small[1]['written_per_epoch_bytes'] or 0) / MiB:.1f} MiB")
    if a and "empty_epoch_median_s" in a:
        lines.append(f"empty epoch, warm: {a['empty_epoch_median_s']:.2f} s end to end (target < 0.5 s)")
    print("\n" + "\n".join(lines))
    report["targets"] = lines


if __name__ == "__main__":
    main()
