"""Side by side: our engine against Spark Structured Streaming (RocksDB state store,
``Trigger.AvailableNow``, ``foreachBatch`` into Delta) on the same files, in one run.

    ./dev bench compare [--records 10000000] [--keys 1000000] [--epochs 10] [--shards 4]
                        [--workloads A,As,Ad,At,B,Bsl,Bse,C,S,D,DB,DP,DPs,DPt,DPW,DPX,DPD,DBP,DBsl,DBse]
                        [--modes warm,cold] [--engines volley,peer] [--cold-epochs 3]
                        [--state-keys 10000000] [--touched 100000] [--zipf 1.3] [--resend head|tail]
                        [--profile]

The workloads are in ``bench/workloads.py``: A a running aggregate (As keyed by
strings, Ad after a deduplication over a log that re-sends 5% of each file, At with
an event-time TTL), B tumbling windows (Bsl sliding, Bse sessions), C and S state-size
scaling; the peer in ``bench/peer_sss.py`` (none for As and At, measured against our
own A: As, Ad and At each take turns epoch by epoch with an A of their own process,
``BESIDE_A``). Each engine runs in its own process (so its peak RSS is its own): warm runs
every epoch in one long-lived Spark; cold starts a process, and so Spark, per epoch, as
a plain Dagster run does. Both engines' Delta tables are checked against a reference
computed from the files. The floors (``FLOOR_OF``) are also timed right after each
epoch of the rows they floor, in the same process: medians of those pairs are not
skewed by the machine's drift within a run, and the summary takes A's and B's ratios
to their targets' floors, DP and DBP, from them. D, DB, DBsl and DBse are the same
aggregation as a stateless Spark batch (the windowed ones paired with Bsl and Bse);
DP and DBP are D's and DB's aggregations through A's and
B's plans and one Python task per shard that hands its rows back unchanged, each paired
with its floor: what a state stage in the Python workers pays before any state work; DPs
is DP over As's string-keyed log, paired with DP over A's: what string keys cost Spark
itself before any state work, the part of As / A no state store can take back. DPt is
DP with one more partial per key, its latest event time (what an event-time TTL keeps
and reads the ``event_time`` column for), paired with DP: the part of At / A that Spark
and the handover pay before any state or index work. DPW is
A's design floor (``bench/design_floor.py``), paired with DP: DP's tasks also restore,
write their rows with one WriteBatch, snapshot and rewrite their own files of a Delta
table, which the driver commits, as every A epoch must whatever its code; no state read, nothing combined. DPD is DP
over Ad's log after each record's trip through a Python task of the shard owning its
event id and back with only the columns A reads (the deduplication's handover, deciding
nothing), paired with DP over the same file: Ad - A cannot go below DPD - DP whatever
the probe's code. DPX is DP over Ad's log after the records' exchange by their event id
alone, in the JVM (no Python): what Spark's own plan pays for a deduplication whose key
is not the aggregate's; DPD - DPX is the records' trip to Python and back.
C touches --touched keys per epoch in a --state-keys-key and a --touched-key state; S
the same records per epoch (--records / --epochs, at most --keys) in a --keys-key and a
--state-keys-key state, each built by one epoch first. Ad's files re-send the first 5%
of the file before (``--resend head``, as ``bench/dedup.py``) or its last (``tail``): the
demo writes 1,000 events a second of event time, so in files of over 600k events the
first records are over 10 minutes old and both engines drop their copies as late, not as
duplicates; the notes say how many went which way.

Prints a row per (workload, engine, mode), then notes (among them, per workload, the
epochs whose shards compacted, and what those epochs and the others took), the issue's
targets as one summary table (``report["summary"]``) and, with ``--profile``, the median
phases of an epoch per engine. Writes ``bench/results/compare.json``, with the machine's
cores and memory (``compare-partial.json`` for a run of some workloads or one engine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow as pa  # noqa: E402
import pyarrow.compute as pc  # noqa: E402

from bench.common import finish, log_arguments  # noqa: E402
from bench.design_floor import StateWrites, commit_to_delta, delta_table  # noqa: E402
from bench.workloads import (  # noqa: E402
    WINDOWS,
    WindowSpec,
    Workload,
    check_table,
    event_log,
    reference_totals,
    reference_windows,
    resend_log,
    scaling_log,
    string_key_log,
)
from volley_dagster.settings import RunSettings  # noqa: E402
from volley_dagster.sinks.staged_files import StagingTarget  # noqa: E402
from volley_dagster.state.keys import ShardLayout  # noqa: E402

MiB = 2**20
GiB = 2**30


# -- measurement helpers (run inside the engine processes) --------------------------------

def _peak_rss_of(status: str) -> float | None:
    """VmHWM of a ``/proc/<pid>/status`` text, in MiB: the peak RSS of that address space."""
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), None)
    return None if line is None else int(line.split()[1]) / 1024


def jvm_peak_rss_mib() -> float:
    """Peak RSS of this process's Spark JVM (the driver; in local mode also the executors)."""
    peak = 0.0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"PPid:\t{os.getpid()}\n" in text and "Name:\tjava" in text:
            peak = max(peak, _peak_rss_of(text) or 0.0)
    return peak


def self_peak_rss_mib() -> float:
    """Peak RSS of this engine process since it started. Not ``ru_maxrss``: a process
    that ``subprocess`` starts inherits the parent's peak in it (Linux keeps the
    high-water mark of the address space its exec replaced), and this run's parent
    peaks at several GiB computing the windowed workloads' references."""
    try:
        peak = _peak_rss_of(Path("/proc/self/status").read_text())
    except OSError:
        peak = None
    if peak is not None:
        return peak
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


def machine() -> dict[str, Any]:
    """Cores and total memory, for reading the figures of another machine's run."""
    try:
        import psutil

        memory = psutil.virtual_memory().total
    except ImportError:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal:"))
        memory = int(line.split()[1]) * 1024
    return {"cores": os.cpu_count(), "memory_bytes": memory}


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
    floor = FLOOR_OF.get(w.name) if paired else None
    return {
        "floor_s": floor_epoch(runner.spark, floor, w.events / w.files[index], w.shards) if floor else None,
        "epoch": r.epoch, "records": r.records_in, "seconds": wall, "keys_touched": r.keys_touched,
        "records_out": r.records_out, "figures": r.figures, "phases": volley_phases(r, wall),
        "bytes_written": r.state_bytes_written,
        "worker_peak_rss_mib": max(s.peak_rss_mib for s in r.shards.values()),
        "state_reads": sorted(s.read_mode for s in r.shards.values()),  # "resident": the memory mirror
        "compacted_shards": sorted(s.shard for s in r.shards.values() if s.compacted),  # RocksDBOptions.compaction_turn
    }


OURS_TOP_LEVEL = ("read_transform", "state_stage", "sinks")  # one after the other in an epoch


def volley_phases(r, wall: float) -> dict[str, float]:
    """Every duration the epoch recorded but its total, whatever the engine measures
    (``x_shard_sum`` as ``x``: summed over the shards, inside ``state_stage``), each
    sink's commit (``sink_<name>``, inside ``sinks``), and ``rest``: the wall time less
    the top-level phases (the cut, planning, the manifest's commit, pruning)."""
    phases = {k.removesuffix("_shard_sum"): v for k, v in r.durations.items() if k != "total"}
    phases.update({f"sink_{name}": s.seconds or 0.0 for name, s in r.sinks.items()})
    phases["rest"] = wall - sum(phases.get(k, 0.0) for k in OURS_TOP_LEVEL)
    return phases


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
    beside = BESIDE_A.get(w.name) if paired else None
    if beside is None:
        batches = [volley_epoch(runner, w, i, paired) for i in indices]
    else:  # A over its own log, in its own state and table, taking turns with this workload
        a = replace(w, name=beside, events=w.events.parent / "events")
        a_runner = volley_runner(a, work / "beside", spark)
        batches = []
        for i in indices:
            if i % 2:
                a_s = volley_epoch(a_runner, a, i, False)["seconds"]
            batches.append(volley_epoch(runner, w, i, False))
            if not i % 2:
                a_s = volley_epoch(a_runner, a, i, False)["seconds"]
            batches[-1]["floor_s"] = a_s
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
                "records_out": (b["sink"] or {}).get("rows"), "phases": dict(b["phases"]),
                "state": b.get("state", {})} for b in result["batches"]]
    for flush in result["empty_batches"]:  # a windowed query's no-data batch emits what the last watermark closed
        if batches:
            last = batches[-1]
            last["seconds"] += flush["seconds"]
            last["records_out"] = (last["records_out"] or 0) + ((flush["sink"] or {}).get("rows") or 0)
            for name, s in flush["phases"].items():
                last["phases"][name] = last["phases"].get(name, 0.0) + s
    for b in batches:
        ph = b["phases"]
        ph["sink_delta"] = ph.get("fn_delta_commit", 0.0)
        ph["rest"] = b["seconds"] - sum(ph.get(k, 0.0) for k in PEER_TOP_LEVEL)
    return {"batches": batches, "wall_s": wall, "checkpoint_bytes": dir_bytes(Path(result["checkpoint"])),
            "driver_peak_rss_mib": jvm_peak_rss_mib() + self_peak_rss_mib(), "delta_uri": result["delta_uri"]}


# a micro-batch's phases one after the other (Spark's durationMs; triggerExecution is their whole)
PEER_TOP_LEVEL = ("latestOffset", "getBatch", "queryPlanning", "addBatch", "walCommit", "commitOffsets")


# also timed beside each epoch: A and B beside the handover floors their targets name,
# so that one run's floor ratios hold on a machine whose speed drifts within it
FLOOR_OF = {"A": "DP", "B": "DBP", "Bsl": "DBsl", "Bse": "DBse", "DP": "D", "DBP": "DB",
            "DPs": "DP", "DPt": "DP", "DPW": "DP", "DPX": "DP", "DPD": "DP"}
AGGREGATION_OF = {"D": "A", "DP": "A", "DPs": "A", "DPt": "A", "DPW": "A", "DPX": "A", "DPD": "A", "DB": "B", "DBP": "B",
                  "DBsl": "Bsl", "DBse": "Bse"}  # a floor: whose aggregation
# our own rows whose target is a ratio to A: warm, each epoch takes turns with an epoch
# of A (over A's own log, in its own state) in the same process, so that the ratio is a
# median of pairs, not of two rows run minutes apart
BESIDE_A = {"As": "A", "Ad": "A", "At": "A"}
HANDOVER = ("DP", "DPs", "DPt", "DBP", "DPW", "DPX", "DPD")
DEDUPLICATED = ("DPX", "DPD")  # over Ad's log; its pair, DP, over the same
STRING_KEYED = ("As", "DPs")  # over the string-keyed copy of A's log; DPs's pair, DP, over A's log itself
OURS_ONLY = ("As", "At")  # no peer: measured against our own A
ALL_WORKLOADS = "A,As,Ad,At,B,Bsl,Bse,C,S,D,DB,DP,DPs,DPt,DPW,DPX,DPD,DBP,DBsl,DBse"


def floor_epoch(spark, floor: str, file: Path, shards: int, work: Path | None = None, epoch: int = 0) -> float:
    """Seconds of one epoch's floor: D, a stateless Spark batch doing A's aggregation
    over the epoch's file; DB (DBsl, DBse), B's (Bsl's, Bse's), a groupBy of (merchant,
    window) over all its events; DP and DBP, D's and DB's aggregations in A's and B's
    plans, handed to one Python task per shard and back unchanged (``python_handover``);
    DPt, DP with each key's latest event time as one more partial (At's ``TOUCHED_PARTIAL``);
    DPW, DP with the state writes and the Delta commit every A epoch makes (``bench/design_floor.py``),
    its state and table under ``work``; DPD, DP after the deduplication's handover of the records
    (``record_handover``); DPX, DP after their exchange alone (``record_handover(to_python=False)``)."""
    t = time.perf_counter()
    events = spark.read.parquet(str(file))
    window = WINDOWS.get(AGGREGATION_OF[floor])
    if floor == "DPW":
        assert work is not None
        layout = ShardLayout(shards)
        sink, target = delta_table(work / "delta", layout)
        rows = python_handover(events, shards, window, writes=(str(work / "state"), epoch, target)).toArrow()
        commit_to_delta(rows, sink, target, work / "state", epoch, layout)
    elif floor in DEDUPLICATED:
        python_handover(record_handover(events, shards, "event_id", to_python=floor == "DPD"), shards, window).toArrow()
    elif floor in HANDOVER:
        python_handover(events, shards, window, touched=floor == "DPt").toArrow()
    else:
        rows, by, values = floor_aggregation(events, window)
        rows.groupBy("merchant_id", *by).agg(*values).toArrow()
    return time.perf_counter() - t


def floor_aggregation(events, window: WindowSpec | None, touched: bool = False):
    """A floor's rows, window column (none for D) and named aggregates, as the
    workload's pipeline in ``bench/workloads.py`` computes them; ``touched``: also each
    key's latest event time, as At's pipeline pre-aggregates it for its TTL."""
    from pyspark.sql import functions as F

    from volley_dagster.operators.ttl import TOUCHED_PARTIAL

    if window is not None:
        return events, [window.spark()], [
            F.count(F.lit(1)).alias("events"), F.sum("amount").alias("total"), F.max("amount").alias("largest")]
    values = [F.sum("amount").alias("total"), F.count(F.lit(1)).alias("events")]
    if touched:
        values.append(F.max(F.unix_micros("event_time")).alias(TOUCHED_PARTIAL))
    return events.where("status = 'active'"), [], values


def python_handover(events, shards: int, window: WindowSpec | None,
                    writes: tuple[str, int, StagingTarget | None] | None = None,
                    touched: bool = False):
    """A's (or B's) state stage with no state: the same shuffle into shard partitions,
    the same partials per key (and window), one ``per_shard`` Python task per shard
    that returns its rows as they came. What a state kept in the Python workers
    (rocksdict) pays before its first lookup, on top of the stateless floor. ``writes``
    (a state root, the epoch, a Delta table's rewrite target): the tasks also write the
    rows as state, and rewrite their files of the table (``StateWrites``);
    ``touched``: At's latest event time per key rides along (``floor_aggregation``)."""
    from pyspark.sql import functions as F

    from volley_dagster import columns
    from volley_dagster.spark.partitioning import ROUTING_COLUMNS, per_shard, to_shards

    rows, spark_window, values = floor_aggregation(events.withColumnRenamed("merchant_id", columns.KEY), window, touched)
    by: list[str] = []
    if spark_window:  # as B's plan carries a window: its bounds in microseconds
        by = [columns.WINDOW_START, columns.WINDOW_END]
        rows = (rows.withColumn("_window", spark_window[0])
                .withColumn(columns.WINDOW_START, F.unix_micros(F.col("_window.start")))
                .withColumn(columns.WINDOW_END, F.unix_micros(F.col("_window.end"))).drop("_window"))
    partials = to_shards(rows, ShardLayout(shards)).groupBy(*ROUTING_COLUMNS, columns.KEY, *by).agg(*values)
    returned = [c for c in partials.columns if c not in ROUTING_COLUMNS]
    schema = partials.select(*returned).schema
    if writes is not None:
        task = StateWrites(writes[0], writes[1], tuple(returned), ShardLayout(shards), writes[2])
        return per_shard(partials.select(*returned, columns.SHARD, columns.KEY_GROUP), task, schema)
    return per_shard(partials.select(*returned, columns.SHARD), lambda table: table.select(returned), schema)


def record_handover(events, shards: int, key: str, returned: tuple[str, ...] = ("merchant_id", "amount", "status"),
                    to_python: bool = True):
    """Ad's deduplication's handover with nothing decided: every record to one Python task
    per shard by the hash of ``key``, as the probe routes them by the deduplication key,
    and back with only the ``returned`` columns A's aggregation reads (the least any probe
    must hand back; the shards' marker rows left out). ``to_python=False``: the exchange
    alone, the records never leaving the JVM."""
    from pyspark.sql import functions as F

    from volley_dagster import columns
    from volley_dagster.spark.partitioning import per_shard, to_shards
    from volley_dagster.state.keys import ShardLayout

    names = list(returned)
    routed = to_shards(events.withColumn(columns.KEY, F.col(key)), ShardLayout(shards))
    if not to_python:
        return routed.where(F.col(columns.KEY).isNotNull()).select(names)
    return per_shard(routed.select(*events.columns, columns.KEY, columns.SHARD),
                     lambda table: table.filter(pc.is_valid(table.column(columns.KEY))).select(names),
                     events.select(*names).schema)


def run_floor(w: Workload, work: Path, indices: list[int]) -> dict[str, Any]:
    """A floor's epochs; DP's and DBP's each paired with D's or DB's over the same file,
    the two taking turns to go first (the second read of a file leans fast)."""
    spark = spark_session(w.shards)
    paired = FLOOR_OF.get(w.name)
    paired_log = w.events.parent / "events" if w.name in STRING_KEYED else w.events  # DPs: against DP over ints
    batches = []
    for i in indices:
        files = {w.name: w.events / w.files[i], paired: paired_log / w.files[i]}
        order = [w.name, paired] if i % 2 == 0 else [paired, w.name]
        seconds = {name: floor_epoch(spark, name, files[name], w.shards, work, i) for name in order if name}
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
        out = run_floor(w, work, indices)
    Path(args.out).write_text(json.dumps(out))
    # stopped, not left to the exit: else PySpark's worker daemon, cut off from the
    # JVM as it goes, prints a BrokenPipeError traceback into the run's output
    spark_session(w.shards).stop()


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
    figures: dict[str, int] = {}  # ours: the operator's, over every epoch (duplicates, dedup_late, windows_fired..)
    for b in result["batches"]:
        for name, n in b.get("figures", {}).items():
            figures[name] = figures.get(name, 0) + n
    worker = [b["worker_peak_rss_mib"] for b in result["batches"] if "worker_peak_rss_mib" in b]
    written = [b["bytes_written"] for b in measured if "bytes_written" in b]
    paired = [b for b in measured if b.get("floor_s")]
    return {
        "epochs": len(measured),
        "paired_floor_ratio": statistics.median(b[key] / b["floor_s"] for b in paired) if paired else None,
        "paired_floor_extra_s": statistics.median(b[key] - b["floor_s"] for b in paired) if paired else None,
        "records_per_s": records / sum(secs) if secs else 0.0,
        "median_s": statistics.median(secs) if secs else 0.0,
        "p95_s": secs[min(len(secs) - 1, int(round(0.95 * (len(secs) - 1))))] if secs else 0.0,
        "phases": phases,
        "driver_peak_rss_mib": result.get("driver_peak_rss_mib", 0.0),
        "worker_peak_rss_mib": max(worker) if worker else None,
        "checkpoint_bytes": result.get("checkpoint_bytes", 0),
        "written_per_epoch_bytes": statistics.median(written) if written else None,
        "figures": figures,
        "per_epoch": [{"epoch": b.get("epoch"), "seconds": b[key], "compacted_shards": b.get("compacted_shards"),
                       "snapshot_s": b.get("phases", {}).get("snapshot")}  # summed over the shards, compactions in it
                      for b in measured],
    }


def engine_table(engine: str, w: Workload, work: Path) -> pa.Table | None:
    """The engine's Delta table; None when it never wrote one (the peer's sink writes
    nothing until a batch has rows: no window closed)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    uri = work / "tables" / "delta" if engine == "volley" else work / "peer" / f"delta-{w.name}"
    try:
        return DeltaTable(str(uri)).to_pyarrow_table()
    except TableNotFoundError:
        return None


PHASES = ["read_transform", "restore", "merge", "flush", "snapshot", "sink_delta"]


def print_row(workload: str, engine: str, mode: str, s: dict[str, Any], correct: str) -> None:
    ph = s["phases"]
    worker = f"{s['worker_peak_rss_mib']:.0f}" if s["worker_peak_rss_mib"] else "-"
    written = f"{s['written_per_epoch_bytes'] / MiB:.1f}" if s["written_per_epoch_bytes"] is not None else "-"
    print(f"{workload:<9} {engine:<7} {mode:<5} {s['records_per_s']:>10,.0f} {s['median_s']:>7.2f} {s['p95_s']:>7.2f} "
          + " ".join(f"{ph[p]:>6.2f}" if p in ph else f"{'-':>6}" for p in PHASES)
          + f" {s['driver_peak_rss_mib']:>7.0f} {worker:>7} {s['checkpoint_bytes'] / MiB:>8.1f} {written:>8}  {correct}")


STREAMING = ("A", "As", "Ad", "At", "B", "Bsl", "Bse")  # in this order; then the floors, then C and S


def workload_log(name: str, work: Path, events: tuple[str, ...], shards: int, resend: str) -> Workload:
    """The workload over its log: A's events (``work/events``), or a copy made from
    them: keyed by strings (As), re-sending the ``resend`` (head or tail) of each file (Ad)."""
    if name == "As":
        return Workload(name, work / "events-string-keys",
                        string_key_log(work / "events-string-keys", work / "events", events), shards)
    if name == "Ad":
        log = work / f"events-resend-{resend}"
        return Workload(name, log, resend_log(log, work / "events", events, tail=resend == "tail"), shards)
    return Workload(name, work / "events", events, shards)


def checked(name: str, engine: str, w: Workload, place: Path, work: Path) -> str:
    """The check of ``engine``'s table against ``reference``, and how many rows it holds
    (a windowed workload's: windows emitted)."""
    expected = reference(w, engine, work)
    got = engine_table(engine, w, place)
    if got is None:
        return "ok, 0 rows" if expected.num_rows == 0 else f"no table, expected {expected.num_rows:,} rows"
    return f"{check_table(name, got, expected)}, {got.num_rows:,} rows"


def checked_apart(name: str, engine: str, w: Workload, place: Path, work: Path) -> str:
    """``checked`` in a process of its own: a windowed workload's reference and table
    take GiBs, which this process would otherwise hold (6.7 GB while Bsl's peer ran,
    8.4 GB during Bse's epochs) while the workloads after it run and are timed."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(checked, name, engine, w, place, work).result()


def reference(w: Workload, engine: str, work: Path) -> pa.Table:
    """What ``engine``'s table must hold: As over A's (integer-keyed) events, Ad over
    each event id's first record; a session closes by the peer's watermark, kept in
    milliseconds (``final_watermark``)."""
    if w.name in WINDOWS:
        spec = WINDOWS[w.name]
        return reference_windows(w.events, w.files, spec, millis=engine == "peer" and spec.kind == "session")
    return reference_totals(work / "events" if w.name == "As" else w.events, w.files, first_occurrence=w.name == "Ad")


def scale_runs(args: argparse.Namespace, workloads: list[str]) -> list[tuple[str, int, int]]:
    """(C or S, state keys, keys touched per epoch) of each scaling run, the larger
    state first: C the same --touched keys in a --state-keys- and a --touched-key state;
    S an epoch's records (at most --keys) in a --state-keys- and a --keys-key state."""
    runs = []
    if "C" in workloads:
        runs += [("C", args.state_keys, args.touched), ("C", args.touched, args.touched)]
    if "S" in workloads:
        touched = min(args.records // args.epochs, args.keys)
        runs += [("S", args.state_keys, touched), ("S", args.keys, touched)]
    return runs


def keys_label(n: int) -> str:
    """A row label's state size: 10M, 200k."""
    return f"{n / 1e6:g}M" if n >= 1_000_000 else f"{n / 1e3:g}k"


def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser)
    parser.add_argument("--zipf", type=float, default=None, help="Zipf exponent for skewed keys (default uniform)")
    parser.add_argument("--workloads", default=ALL_WORKLOADS)
    parser.add_argument("--modes", default="warm,cold")
    parser.add_argument("--engines", default="volley,peer")
    parser.add_argument("--cold-epochs", type=int, default=3)
    parser.add_argument("--state-keys", type=int, default=10_000_000)
    parser.add_argument("--touched", type=int, default=100_000)
    parser.add_argument("--empty-epochs", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print the median phases of an epoch per engine")
    parser.add_argument("--resend", choices=["head", "tail"], default="tail",
                        help="Ad: each file re-sends the first (head) or last (tail) 5%% of the one before it")
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
    host = machine()
    print(f"{host['cores']} cores, {host['memory_bytes'] / GiB:.1f} GiB; {args.records:,} events over {args.keys:,} keys"
          f"{f' (Zipf {args.zipf})' if args.zipf else ''} in {args.epochs} files, {args.shards} shards/shuffle partitions;"
          f" data ready in {time.perf_counter() - t:.0f} s -> {work}")
    print(f"{'workload':<9} {'engine':<7} {'mode':<5} {'rec/s':>10} {'med s':>7} {'p95 s':>7} "
          + " ".join(f"{p[:6]:>6}" for p in PHASES) + f" {'drv MiB':>7} {'wrk MiB':>7} {'ckpt MiB':>8} {'wr/ep MiB':>8}  check")
    report: dict[str, Any] = {"cores": host["cores"], "machine": host,
                              "args": {k: v for k, v in vars(args).items() if v is not None and k not in ("child",)},
                              "results": []}

    def record(workload: str, engine: str, mode: str, summary: dict[str, Any], correct: str) -> None:
        print_row(workload, engine, mode, summary, correct)
        report["results"].append({"workload": workload, "engine": engine, "mode": mode, "check": correct, **summary})

    for name in [n for n in STREAMING if n in workloads]:
        w = workload_log(name, work, ab, args.shards, args.resend)
        for mode in modes:
            epochs = args.epochs if mode == "warm" else min(args.cold_epochs, args.epochs)
            for engine in [e for e in engines if name not in OURS_ONLY or e == "volley"]:
                place = work / f"{name}-{engine}-{mode}"
                shutil.rmtree(place, ignore_errors=True)
                empty = args.empty_epochs if engine == "volley" and mode == "warm" and name == "A" else 0
                result = run_mode(engine, w, place, mode, epochs, empty)
                if epochs == args.epochs:
                    check = checked_apart(name, engine, w, place, work)
                else:
                    check = "(partial run)"
                summary = summarize(result)
                if "empty_epoch_s" in result:
                    summary["empty_epoch_median_s"] = statistics.median(result["empty_epoch_s"])
                record(name, engine, mode, summary, check)
    for floor in [n for n in AGGREGATION_OF if n in workloads]:
        log = workload_log("As" if floor in STRING_KEYED else "Ad" if floor in DEDUPLICATED else floor, work, ab,
                           args.shards, args.resend).events
        w = Workload(floor, log, ab, args.shards)
        result = spawn("floor", w, work / f"{floor}-floor", list(range(args.epochs)))
        record(floor, "spark", "warm", summarize(result), "-")
    scaled: dict[str, list[str]] = {}  # C, S: their rows' labels, the larger state first
    for name, state_keys, touched in scale_runs(args, workloads):
        label = f"{name} {keys_label(state_keys)}"
        scaled.setdefault(name, []).append(label)
        events = work / f"scaling-{state_keys}-{touched}"
        w = Workload("C", events, scaling_log(events, state_keys, touched, args.epochs), args.shards)
        for engine in engines:
            place = work / f"{name}{state_keys}-{engine}"
            shutil.rmtree(place, ignore_errors=True)
            result = spawn(engine, w, place, list(range(len(w.files))))
            result["batches"] = result["batches"][1:]  # the state-building epoch is set-up
            record(label, engine, "warm", summarize(result), checked_apart("C", engine, w, place, work))
    print_notes(report, scaled)
    print_summary(report, scaled)
    if args.profile:
        print_profile(report)
    # a run of a few workloads or one engine leaves the whole table's file as it was
    whole = set(workloads) >= set(ALL_WORKLOADS.split(",")) and {"volley", "peer"} <= set(engines)
    finish("compare" if whole else "compare-partial", report, work, keep=bool(args.workdir))


@dataclass(frozen=True)
class Target:
    """One line of the summary: the warm row ``ours`` against its peer's (records/s,
    at least ``peer_x`` times) and against the row ``floor`` (median epoch seconds, at
    most ``floor_x`` times: the median of per-file pairs when ``floor`` is the one
    timed beside each epoch, ``FLOOR_OF`` or ``BESIDE_A``, else median against median);
    None: no target."""

    ours: str
    peer_x: float | None
    floor: str | None
    floor_x: float | None


TARGETS = (Target("A", 2.5, "DP", 1.5), Target("B", 3.0, "DBP", 1.6), Target("As", None, "A", 1.1),
           Target("Ad", 2.0, "A", 1.6), Target("At", None, "A", 1.15), Target("Bsl", 2.0, "DBsl", None),
           Target("Bse", 2.0, "DBse", None))
SCALE_X = {"C": 1.5, "S": 1.3}  # the larger state's epoch against the smaller's


def summary_rows(report: dict[str, Any], scaled: dict[str, list[str]]) -> list[dict[str, Any]]:
    """The issue's targets as measured in this run, one row per workload that ran."""
    res = {(r["workload"], r["engine"]): r for r in report["results"] if r["mode"] == "warm"}
    targets = list(TARGETS) + [Target(labels[0], None, labels[1], SCALE_X[name])
                               for name, labels in scaled.items() if len(labels) == 2]
    rows = []
    for target in targets:
        ours = res.get((target.ours, "volley"))
        if ours is None:
            continue
        peer = res.get((target.ours, "peer"))
        floor = (res.get((target.floor, "volley")) or res.get((target.floor, "spark"))) if target.floor else None
        peer_ratio = ours["records_per_s"] / peer["records_per_s"] if peer and peer["records_per_s"] else None
        paired = target.floor in (FLOOR_OF.get(target.ours), BESIDE_A.get(target.ours)) and ours.get("paired_floor_ratio")
        floor_ratio = (ours["paired_floor_ratio"] if paired else
                       ours["median_s"] / floor["median_s"] if floor and floor["median_s"] else None)
        missed = [what for what, ok in (("check", ours["check"].startswith("ok")),
                                        ("peer", peer_ratio is None or target.peer_x is None or peer_ratio >= target.peer_x),
                                        ("floor", floor_ratio is None or target.floor_x is None
                                         or floor_ratio <= target.floor_x)) if not ok]
        unmeasured = [what for what, x, ratio in (("peer", target.peer_x, peer_ratio),
                                                 ("floor", target.floor_x, floor_ratio)) if x and ratio is None]
        if missed:
            verdict = "missed: " + ", ".join(missed)
        elif unmeasured:
            verdict = "not measured: " + ", ".join(unmeasured)
        else:
            verdict = "met" if target.peer_x or target.floor_x else "-"
        rows.append({"workload": target.ours, "ours_records_per_s": ours["records_per_s"],
                     "peer_records_per_s": peer["records_per_s"] if peer else None, "ours_per_peer": peer_ratio,
                     "ours_per_peer_target": target.peer_x, "floor": target.floor,
                     "floor_median_s": floor["median_s"] if floor else None, "ours_median_s": ours["median_s"],
                     "ours_per_floor": floor_ratio, "ours_per_floor_paired": bool(paired),
                     "ours_per_floor_target": target.floor_x, "verdict": verdict})
    return rows


def print_summary(report: dict[str, Any], scaled: dict[str, list[str]]) -> None:
    """The summary table (warm runs), kept as ``report["summary"]``."""
    rows = summary_rows(report, scaled)
    report["summary"] = rows

    def ratio(x: float | None, target: float | None, sign: str) -> str:
        return "-" if x is None else f"{x:.2f}x" + (f" ({sign}{target:g}x)" if target else "")

    def num(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    print(f"\n{'workload':<9} {'ours rec/s':>10} {'peer rec/s':>10} {'ours/peer (target)':>19} {'floor':<8} "
          f"{'floor s':>7} {'ours s':>7} {'ours/floor (target)':>19}  verdict")
    for r in rows:
        print(f"{r['workload']:<9} {r['ours_records_per_s']:>10,.0f} {num(r['peer_records_per_s'], ',.0f'):>10} "
              f"{ratio(r['ours_per_peer'], r['ours_per_peer_target'], '>='):>19} {r['floor'] or '-':<8} "
              f"{num(r['floor_median_s'], '.2f'):>7} {r['ours_median_s']:>7.2f} "
              f"{ratio(r['ours_per_floor'], r['ours_per_floor_target'], '<='):>19}{'*' if r['ours_per_floor_paired'] else ' '} "
              f"{r['verdict']}")
    if any(r["ours_per_floor_paired"] for r in rows):
        print("* ours/floor: the median of per-file pairs, the floor timed right after each of our epochs in one "
              "process (floor s and ours s: each row's own median)")


PROFILE = {  # per engine: its phases in order (the top-level ones, then those inside them)
    "volley": ("read_transform", "state_stage", "sinks", "rest", "pre_step", "side_output", "restore", "merge",
               "flush", "snapshot"),
    "peer": ("latestOffset", "getBatch", "queryPlanning", "addBatch", "walCommit", "commitOffsets", "rest",
             "fn_collect", "fn_delta_commit"),
}
PROFILE_HIDDEN = {"volley": set(), "peer": {"triggerExecution", "fn_total", "sink_delta"}}  # the whole or a copy


def print_profile(report: dict[str, Any]) -> None:
    """Each engine's median phases of an epoch (seconds), with any phase not named in
    ``PROFILE`` after those; ``rest``: the epoch's time less its top-level phases."""
    notes = {"volley": "ours: read_transform + state_stage + sinks + rest = the epoch; pre_step (a deduplication's "
                       "probe job) and side_output (bad and late records, the watermark) inside read_transform; restore..snapshot are summed over the shards inside "
                       "state_stage, sink_* inside sinks",
             "peer": "peer: latestOffset..commitOffsets + rest = the micro-batch (triggerExecution, with the no-data "
                     "batch that emits the last windows); fn_* inside addBatch (the foreachBatch)"}
    for engine, names in PROFILE.items():
        rows = [r for r in report["results"] if r["engine"] == engine and r["phases"]]
        if not rows:
            continue
        seen = {p for r in rows for p in r["phases"]} - set(names) - PROFILE_HIDDEN[engine]
        columns = list(names) + sorted(seen)
        widths = [max(6, len(c)) for c in columns]
        print(f"\n{notes[engine]}")
        print(f"{'workload':<9} {'mode':<5} {'med s':>6} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
        for r in rows:
            ph = r["phases"]
            print(f"{r['workload']:<9} {r['mode']:<5} {r['median_s']:>6.2f} "
                  + " ".join(f"{ph[c]:>{w}.2f}" if c in ph else f"{'-':>{w}}" for c, w in zip(columns, widths, strict=True)))


def handover_floor_line(floor: str, what: str, row: dict[str, Any], a: dict[str, Any] | None, ours: str,
                        ours_row: dict[str, Any] | None, target: float) -> str:
    """A handover floor paired with DP (DPt, DPD): its ratio and seconds beyond DP, and
    what ``ours`` / A would be with no cost of ours beyond it, against what it is (paired
    when ``ours`` took turns with A, ``BESIDE_A``)."""
    extra = row["paired_floor_extra_s"]
    line = f"{ours}'s handover floor {floor} ({what}): {floor} / DP {row['paired_floor_ratio']:.2f}x, {floor} - DP {extra:+.2f} s"
    if a:
        line += (f"; with no cost of ours beyond it {ours} / A would be {(a['median_s'] + extra) / a['median_s']:.2f}x "
                 f"(target <= {target}x)")
        if ours_row:
            paired = ours_row.get("paired_floor_ratio")
            line += (f", against {ours} / A {paired:.2f}x (paired)" if paired else
                     f", against {ours} / A {ours_row['median_s'] / a['median_s']:.2f}x")
    return line


def print_notes(report: dict[str, Any], scaled: dict[str, list[str]]) -> None:
    """What the summary does not show: pairs with the floor timed right after each
    epoch, the handover floors against theirs, checkpoint writes, the empty epoch."""
    res = {(r["workload"], r["engine"], r["mode"]): r for r in report["results"]}
    lines = []
    for name, floor in (FLOOR_OF | BESIDE_A).items():
        row = res.get((name, "volley", "warm")) or res.get((name, "spark", "warm"))
        if row and row.get("paired_floor_ratio"):
            lines.append(f"{name} / {floor}: {row['paired_floor_ratio']:.2f}x, median of per-file pairs timed "
                         "one right after the other in one process")
    strings, ints, handover = (res.get((name, engine, "warm")) for name, engine in
                               (("As", "volley"), ("A", "volley"), ("DPs", "spark")))
    if strings and ints and handover and handover.get("paired_floor_extra_s") is not None:
        extra, more = handover["paired_floor_extra_s"], strings.get("paired_floor_extra_s")
        lines.append(f"As - A {more:+.2f} s (paired); of that, Spark's handover of string keys (DPs - DP, no state) "
                     f"{extra:+.2f} s: with no cost of ours for strings As / A would be "
                     f"{(ints['median_s'] + extra) / ints['median_s']:.2f}x" if more is not None else
                     f"As / A: {strings['median_s'] / ints['median_s']:.2f}x; Spark's handover of string keys alone "
                     f"(DPs - DP) {extra:+.2f} s")
    dedup = res.get(("Ad", "volley", "warm"))
    if dedup:
        f = dedup["figures"]
        lines.append(f"Ad: ours dropped {f.get('duplicates', 0):,} re-sent records as duplicates and "
                     f"{f.get('dedup_late', 0):,} as late (over 10 minutes behind the watermark)")
    a = res.get(("A", "volley", "warm"))
    design, peer = res.get(("DPW", "spark", "warm")), res.get(("A", "peer", "warm"))
    if design and design.get("paired_floor_ratio"):
        line = (f"A's design floor DPW (DP, and the state writes and the Delta commit every A epoch makes, "
                f"bench/design_floor.py): no code of ours brings A / DP under DPW / DP {design['paired_floor_ratio']:.2f}x "
                "(target <= 1.5x)")
        if peer and peer["records_per_s"]:
            line += f", nor A / peer over DPW / peer {design['records_per_s'] / peer['records_per_s']:.2f}x (target >= 2.5x)"
        if a and a.get("paired_floor_ratio"):
            line += (f"; A / DPW {a['paired_floor_ratio'] / design['paired_floor_ratio']:.2f}x (the two pairs with DP "
                     "divided) is what A's own work costs beyond it")
        lines.append(line)
    for floor, ours, what, target in (
            ("DPt", "At", "DP with each key's latest event time as one more partial, read from the event_time column: "
             "what Spark and the handover add for an event-time TTL before any state or index work", 1.15),
            ("DPD", "Ad", "DP after every record's trip through a Python task of the shard owning its event id, "
             "deciding nothing: the least a deduplication before A adds whatever its code", 1.6)):
        row = res.get((floor, "spark", "warm"))
        if row and row.get("paired_floor_extra_s") is not None:
            lines.append(handover_floor_line(floor, what, row, a, ours, res.get((ours, "volley", "warm")), target))
    exchange, trip = res.get(("DPX", "spark", "warm")), res.get(("DPD", "spark", "warm"))
    if exchange and trip and None not in (exchange.get("paired_floor_extra_s"), trip.get("paired_floor_extra_s")):
        lines.append(f"Of DPD - DP, the records' exchange by event id in the JVM (DPX - DP, what Spark's own plan pays) "
                     f"{exchange['paired_floor_extra_s']:+.2f} s (DPX / DP {exchange['paired_floor_ratio']:.2f}x), their trip "
                     f"to Python and back {trip['paired_floor_extra_s'] - exchange['paired_floor_extra_s']:+.2f} s")
    for labels in scaled.values():
        rows = [res.get((label, "volley", "warm")) for label in labels]
        if len(rows) == 2 and rows[0] and rows[1]:
            lines.append(f"{labels[0]} / {labels[1]}: checkpoint written per epoch "
                         + " vs ".join(f"{(r['written_per_epoch_bytes'] or 0) / MiB:.1f}" for r in rows) + " MiB")
    for row in report["results"]:  # whether the slowest epoch was one whose shards compacted
        epochs = [e for e in row.get("per_epoch", []) if e.get("compacted_shards") is not None]
        if row["engine"] == "volley" and row["mode"] == "warm" and epochs:
            slowest = max(epochs, key=lambda e: e["seconds"])
            compacting = [f"{e['epoch']} ({len(e['compacted_shards'])})" for e in epochs if e["compacted_shards"]]
            line = (f"{row['workload']}: slowest epoch {slowest['epoch']}, {slowest['seconds']:.2f} s, its shards "
                    f"compacted {slowest['compacted_shards']}; epochs that compacted (shards): "
                    f"{', '.join(compacting) or 'none'}")
            split = [[e for e in epochs if bool(e["compacted_shards"]) is did] for did in (True, False)]
            if all(split):
                line += "; medians of the epochs that compacted and of the others: " + " against ".join(
                    f"{statistics.median(e['seconds'] for e in part):.2f} s (snapshots summed "
                    f"{statistics.median(e['snapshot_s'] or 0.0 for e in part):.2f} s)" for part in split)
            lines.append(line)
    if a and "empty_epoch_median_s" in a:
        lines.append(f"empty epoch, warm: {a['empty_epoch_median_s']:.2f} s end to end (target < 0.5 s)")
    print("\n" + "\n".join(lines))
    report["notes"] = lines


if __name__ == "__main__":
    main()
