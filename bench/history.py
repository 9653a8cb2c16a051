"""Does anything grow with the age of a pipeline? (issue 30, item 5)

    ./dev bench history --epochs 1000,200000          # the sizes, ascending
    ./dev bench history --epochs 1000,50000 --repeat 7 --keep

Runs a few real epochs of the demo payments pipeline (local Delta and Iceberg tables)
through the Dagster code location on a real SQLite DagsterInstance, so that the
checkpoint root holds a real pipeline.json, manifests, snapshots and tables; then,
for each size N in turn, SYNTHESISES the pipeline's history up to epoch N without
running those epochs, and measures what a sensor tick, a run, the asset checks and
the UI's partition query cost. What is synthesised, and what is not, is printed.

The history is grown in place from one size to the next:

- the epoch log: ``epochs/<key>/offsets.json`` and ``manifest.json`` of every epoch
  (then compacted into ``epochs/archive/`` as retention would have done),
  copies of a real committed EMPTY epoch (cut with nothing new and run: its shards
  carried forward) with the epoch number, cut and commit times (one epoch per 5 s,
  ending now) and snapshot paths rewritten; every range starts and ends at the real
  end of the source, so positions stay consistent and the source holds no more files
  than the real epochs read;
- snapshots only for the last ``keep_epochs`` (hardlinks of the real snapshot files,
  as a carried-forward epoch has) and ``retention.json`` at N - keep_epochs, as
  retention leaves a root;
- the sinks: one real empty commit per table for each of the last 32 epochs (what
  the row-count check reads), tagged as those epochs; the sink history before them
  is NOT synthesised (a real Delta log would hold N commits and its checkpoints);
- the instance: the dynamic partitions of the last ``Deployment.partitions_kept``
  epochs (as the sensor's ``prune_history`` keeps them) and a runless materialization
  of each of the pipeline's assets per kept partition (the real empty epoch's
  metadata, epoch rewritten); runs, their event logs and check evaluations are NOT
  synthesised (the instance holds only the bench's real runs).

Measured at each size, median of ``--repeat``:

- sensor tick (``build_sensor_context`` + ``payments_new_data``, as the tests' ``tick()``)
  with nothing new, and with one new file landed (the cut it makes is undone after);
- run overhead for one empty epoch: an epoch cut with nothing new, run by the epochs
  job's ``execute_in_process`` (no Spark job: shards carried forward, empty sink
  commits, then the run's checks); and the no-op re-run of an already committed epoch;
- the asset checks (``volley_dagster/dagster/epochs.check_results``);
- the backlog of a local file log read through its N-th file, one file waiting (what a
  tick lists: from the read position on);
- the UI's partition query (``assetNodeOrError { partitionKeys assetPartitionStatuses }``
  for the state asset) against a real ``dagster dev`` over the same instance.

Then the ratio of the largest size to the smallest (target: at most 1.5x), and a
cProfile of a tick with nothing new at the largest size. Writes bench/results/history.json.
Needs Spark: run it as ``flock /tmp/volley-spark.lock ./dev bench history ...``.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import shutil
import statistics
import sys
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dagster import AssetKey, AssetMaterialization, DagsterInstance, build_sensor_context  # noqa: E402
from sqlalchemy import event  # noqa: E402
from sqlalchemy.engine import Engine  # noqa: E402

from bench.common import finish  # noqa: E402
from bench.history_location import definitions, deployment, resources  # noqa: E402
from harness.dagster_dev import dagster_dev  # noqa: E402
from volley_dagster.checkpoint.epoch_log import epoch_key  # noqa: E402
from volley_dagster.dagster.epochs import check_results, make_runner, partitions_name  # noqa: E402
from volley_dagster.dagster.keys import PipelineKeys  # noqa: E402
from volley_dagster.demo.events import generate  # noqa: E402
from volley_dagster.io.atomic import dump_json, read_json, write_json_atomic  # noqa: E402
from volley_dagster.sinks.base import CommitContext  # noqa: E402
from volley_dagster.sources.file_log import FileLog  # noqa: E402
from volley_dagster.sources.offsets import Position  # noqa: E402
from volley_dagster.spark.session import get_or_create_spark  # noqa: E402
from volley_dagster.verify import ROW_COUNT_WINDOW  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SENSOR = "payments_new_data"
JOB = "payments_epochs_job"
STATE = AssetKey(["payments", "state"])
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # the runs' own log stays in the instance
CADENCE_S = 5.0  # the synthesised epochs are one every 5 s, the last one now
REAL_FILES = 3  # real data epochs before the empty template epoch
FIGURES = [
    ("tick_idle_s", "sensor tick, nothing new"),
    ("tick_new_file_s", "sensor tick, one new file"),
    ("run_empty_epoch_s", "run of one empty epoch"),
    ("engine_empty_epoch_s", "  of which the engine's epoch"),
    ("run_noop_s", "run re-running a committed epoch"),
    ("checks_s", "asset checks (check_results)"),
    ("graphql_partitions_s", "UI partition query (GraphQL)"),
    ("source_backlog_s", "source backlog, log read through N"),
]


class Bench:
    def __init__(self, base: Path, instance: DagsterInstance, records: int, keys: int, materialize: str) -> None:
        self.base, self.instance, self.records, self.keys = base, instance, records, keys
        self.materialize = materialize
        self.defs = definitions(base)
        self.deployment = deployment(base)
        self.checkpoints, self.tables = resources(base)
        self.runner = make_runner(self.deployment, self.checkpoints, self.tables)  # cuts and reads; no Spark
        self.log = self.runner.log
        self.pipeline = self.runner.pipeline
        self.partitions = partitions_name(self.deployment)
        self.cursor: str | None = None
        self.next_file = 0
        self.template_epoch = 0
        self.template: dict[str, Any] = {}
        self.materialized_through = 0
        self.sink_marks_through = 0

    # -- the real epochs ---------------------------------------------------------------

    def tick(self, cursor: str | None = None):
        """One sensor evaluation as the daemon does it (tests/dagster/test_location.py ``tick``)."""
        with build_sensor_context(instance=self.instance, cursor=cursor, resources=self.defs.resources,
                                  definitions=self.defs) as ctx:
            result = self.defs.resolve_sensor_def(SENSOR)(ctx)
        for req in result.dynamic_partitions_requests or []:
            self.instance.add_dynamic_partitions(req.partitions_def_name, list(req.partition_keys))
        return result

    def run_range(self, first: int, last: int | None = None):
        job = self.defs.resolve_job_def(JOB)
        tags = {"dagster/asset_partition_range_start": epoch_key(first),
                "dagster/asset_partition_range_end": epoch_key(last or first)}
        result = job.execute_in_process(instance=self.instance, tags=tags, raise_on_error=False, run_config=QUIET)
        if not result.success:
            raise SystemExit(f"run of epochs {first}..{last or first} failed: "
                             f"{[str(e.event_specific_data.error) for e in result.all_events if e.is_failure][:1]}")
        return result

    def land_file(self) -> Path:
        name = generate(self.base / "events", 1, self.records, self.keys, first_file=self.next_file)[0]
        self.next_file += 1
        return self.base / "events" / name

    def cut_empty(self) -> int:
        """What a cut with nothing new records (the sensor cuts none: a run needs one)."""
        rng = self.runner.cut_next(allow_empty=True)
        assert rng is not None and rng.records == 0
        self.instance.add_dynamic_partitions(self.partitions, [epoch_key(rng.epoch)])
        return rng.epoch

    def real_epochs(self) -> None:
        """Files landed one per tick, the run the sensor requests, then one empty epoch:
        the template of the synthesised history."""
        for _ in range(REAL_FILES):
            self.land_file()
            self.cursor = self.tick(self.cursor).cursor
        self.run_range(1, self.log.last_cut())
        self.template_epoch = self.cut_empty()
        self.run_range(self.template_epoch)
        e = self.template_epoch
        self.template = {
            "offsets": read_json(self.log.epoch_dir(e) / "offsets.json"),
            "manifest": read_json(self.log.epoch_dir(e) / "manifest.json"),
            "metadata": {key: self.instance.fetch_materializations(key, limit=1).records[0]
                         .asset_materialization.metadata for key in self._asset_keys()},
        }
        self.saved_snapshots = self.base / "template-snapshots"  # retention prunes the template's own
        shutil.copytree(self.log.snapshots_dir(e), self.saved_snapshots, copy_function=os.link)
        delta = next(s for s in self.pipeline.sinks if s.name == "balances")
        self.empty_output = delta.read().schema.empty_table()
        self.materialized_through = self.sink_marks_through = e

    def _asset_keys(self) -> list[AssetKey]:
        keys = PipelineKeys(self.pipeline.name)
        return [keys.state] + [keys.sink(sink) for sink in self.pipeline.sinks]

    # -- the synthesised history ---------------------------------------------------------

    def grow(self, n: int) -> dict[str, float]:
        """Synthesise epochs last committed + 1 .. n, and the instance's history to match."""
        spent: dict[str, float] = {}
        first = self.log.last_committed() + 1
        assert self.log.last_cut() == first - 1, "the bench leaves no epoch cut but uncommitted"
        keep = self.checkpoints.keep_epochs
        t = time.perf_counter()
        self._write_epochs(first, n, keep)
        spent["epoch_log_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self._sink_marks(n)
        spent["sink_commits_s"] = time.perf_counter() - t
        t = time.perf_counter()
        added, removed = self._partitions(n)
        spent["partitions_s"] = time.perf_counter() - t
        t = time.perf_counter()
        events = self._materializations(n)
        spent["materializations_s"] = time.perf_counter() - t
        print(f"  synthesised epochs {first:,}..{n:,}: epoch log {spent['epoch_log_s']:.1f}s, "
              f"sink commits {spent['sink_commits_s']:.1f}s, "
              f"partitions +{added:,} -{removed:,} {spent['partitions_s']:.1f}s, "
              f"{events:,} materializations {spent['materializations_s']:.1f}s "
              f"({events / max(spent['materializations_s'], 1e-9):.0f}/s)", flush=True)
        spent.update(partitions_added=added, partitions_removed=removed, materializations=events)
        return spent

    def _write_epochs(self, first: int, n: int, keep: int) -> None:
        """The files a real epoch leaves, as ``EpochLog`` writes them (``dump_json``): the
        template's bytes with the epoch-bearing values substituted."""
        offsets, manifest = self.template["offsets"], self.template["manifest"]
        template_key = epoch_key(self.template_epoch)
        shards = {s: {**entry, "snapshot": entry["snapshot"].replace(template_key, "@@KEY@@")}
                  for s, entry in manifest["shards"].items()}
        sinks = {name: {**r, "sink_epoch": "@@EPOCH@@"} for name, r in manifest["sinks"].items()}
        manifest_text = dump_json({**manifest, "epoch": "@@EPOCH@@", "committed_at": "@@AT@@", "shards": shards,
                                   "sinks": sinks}).decode()
        offsets_text = dump_json({**offsets, "epoch": "@@EPOCH@@", "cut_at_us": "@@CUT@@"}).decode()
        now = time.time()
        snapshot_from = n - keep + 1
        for e in range(first, n + 1):
            key, at = epoch_key(e), now - (n - e) * CADENCE_S
            d = self.log.epoch_dir(e)
            d.mkdir(parents=True)
            (d / "offsets.json").write_text(offsets_text.replace('"@@EPOCH@@"', str(e))
                                            .replace('"@@CUT@@"', str(int((at - 0.2) * 1e6))))
            (d / "manifest.json").write_text(
                manifest_text.replace('"@@EPOCH@@"', str(e)).replace("@@KEY@@", key)
                .replace("@@AT@@", datetime.fromtimestamp(at, timezone.utc).isoformat()))
            if e >= snapshot_from:
                self._snapshots(e)
        for p in (self.log.root / "snapshots").iterdir():  # what retention leaves: the last keep_epochs
            if p.name.isdigit() and int(p.name) < snapshot_from:
                shutil.rmtree(p)
        write_json_atomic(self.log.root / "retention.json", {"side_outputs_through": n - keep})
        while True:  # what retention has done by then: the folders past it compacted into archives
            archived = self.log.archives.through()
            self.log.prune(n, keep)
            if self.log.archives.through() == archived:
                break

    def _snapshots(self, epoch: int) -> None:
        """Hardlinks of the template's snapshot files, as a carried-forward epoch has them."""
        template_key = epoch_key(self.template_epoch)
        for entry in self.template["manifest"]["shards"].values():
            dst = self.log.root / entry["snapshot"].replace(template_key, epoch_key(epoch))
            dst.mkdir(parents=True)
            for f in (self.saved_snapshots / Path(entry["snapshot"]).name).iterdir():
                os.link(f, dst / f.name)

    def _sink_marks(self, n: int) -> None:
        """One empty commit per table for each of the last ROW_COUNT_WINDOW epochs (the
        window the row-count check reads), tagged as those epochs."""
        lineage = self.log.lineage()
        for e in range(max(self.sink_marks_through + 1, n - ROW_COUNT_WINDOW + 1), n + 1):
            digest = self.log.offsets(e).digest()
            for sink in self.pipeline.sinks:
                ctx = _SynthesisedCommit(self.pipeline.name, e, self.pipeline.output_keys(), lineage, digest,
                                    self.log.sink_binding(sink.name), retired_columns=self.log.retired_columns(),
                                    expiry_column=self.pipeline.expiry_column())
                sink.commit(self.empty_output, ctx)
        self.sink_marks_through = n

    def _window(self, n: int) -> range:
        return range(max(1, n - self.deployment.partitions_kept + 1), n + 1)

    def _partitions(self, n: int) -> tuple[int, int]:
        window = self._window(n)
        have = set(self.instance.get_dynamic_partitions(self.partitions))
        new = [epoch_key(e) for e in window if epoch_key(e) not in have]
        self.instance.add_dynamic_partitions(self.partitions, new)
        old = [k for k in have if int(k) < window.start]
        for k in old:
            self.instance.delete_dynamic_partition(self.partitions, k)
        return len(new), len(old)

    def _materializations(self, n: int) -> int:
        """One runless materialization per asset and kept partition, written with SQLite's
        ``synchronous=OFF`` (a write speed-up for the synthesis only; the measurements
        run with the instance's own settings)."""
        count = 0
        event.listen(Engine, "connect", _unsynchronised)
        try:
            for e in range(max(self.materialized_through + 1, self._window(n).start), n + 1):
                for asset, metadata in self.template["metadata"].items():
                    if self.materialize == "state" and asset != STATE:
                        continue
                    md = {k: (e if k == "epoch" else v) for k, v in metadata.items()}
                    self.instance.report_runless_asset_event(
                        AssetMaterialization(asset_key=asset, partition=epoch_key(e), metadata=md))
                    count += 1
        finally:
            event.remove(Engine, "connect", _unsynchronised)
        self.materialized_through = n
        return count

    # -- the measurements ---------------------------------------------------------------

    def tick_idle(self) -> float:
        t = time.perf_counter()
        result = self.tick(self.cursor)
        spent = time.perf_counter() - t
        assert not result.run_requests, result
        self.cursor = result.cursor
        return spent

    def tick_new_file(self) -> float:
        """A tick that cuts the epoch of a landed file; the cut is undone after (the file,
        the offsets, the partition), so the history stays as synthesised."""
        committed = self.log.last_committed()
        landed = self.land_file()
        t = time.perf_counter()
        result = self.tick(self.cursor)
        spent = time.perf_counter() - t
        assert self.log.last_cut() == committed + 1 and result.run_requests, (result, self.log.last_cut())
        shutil.rmtree(self.log.epoch_dir(committed + 1))
        if self.instance.has_dynamic_partition(self.partitions, epoch_key(committed + 1)):
            self.instance.delete_dynamic_partition(self.partitions, epoch_key(committed + 1))
        landed.unlink()
        self.next_file -= 1
        return spent

    def run_empty(self) -> tuple[float, float]:
        epoch = self.cut_empty()
        t = time.perf_counter()
        self.run_range(epoch)
        spent = time.perf_counter() - t
        manifest = self.log.committed_manifest(epoch)
        assert manifest.records_in == 0 and all(s.read_mode == "carried_forward" for s in manifest.shards.values())
        self.materialized_through = self.sink_marks_through = epoch  # a real run did both
        return spent, manifest.durations["total"]

    def run_noop(self) -> float:
        t = time.perf_counter()
        self.run_range(self.log.last_committed())
        return time.perf_counter() - t

    def source_backlog(self, n: int) -> float:
        """The backlog of a file log read through its n-th file, one new file waiting: what
        a tick lists. The n - 1 files before the read position are empty files, as a
        listing from the position only reads their names."""
        folder = self.base / "long-source"
        folder.mkdir(exist_ok=True)
        have = sum(1 for _ in os.scandir(folder))
        for i in range(max(0, have - 2), n - 1):
            (folder / f"f-{i:09d}.parquet").write_bytes(b"")
        for i in (n - 1, n):
            generate(folder, 1, self.records, self.keys, first_file=0)
            os.replace(folder / "events-000000.parquet", folder / f"f-{i:09d}.parquet")
        log = FileLog(folder)
        after = {"": Position(f"f-{n - 1:09d}.parquet", n - 1, self.records)}
        t = time.perf_counter()
        backlog = log.backlog(after)
        spent = time.perf_counter() - t
        assert (backlog.records, backlog.files) == (self.records, 1), backlog
        return spent

    def checks(self) -> float:
        runner = make_runner(self.deployment, self.checkpoints, self.tables)
        t = time.perf_counter()
        results = list(check_results(self.instance, runner, self.deployment))
        spent = time.perf_counter() - t
        failed = [f"{r.check_name}: {r.description}" for r in results if not r.passed]
        if failed:
            print(f"    (failing checks: {failed})")
        return spent


def _unsynchronised(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA synchronous=OFF")
    cursor.close()


class _SynthesisedCommit(CommitContext):
    """A commit of a synthesised epoch: the sink's lineage check would (rightly) refuse
    the gap of the epochs whose commits are not synthesised."""

    def should_commit(self, sink: str, held: Any) -> bool:
        return True


def median_of(repeat: int, measure: Callable[[], float]) -> tuple[float, list[float]]:
    values = [measure() for _ in range(repeat)]
    return statistics.median(values), values


def graphql_partitions(bench: Bench, home: Path, repeat: int) -> tuple[float, list[float], int]:
    """The UI's partition page query, against a real ``dagster dev`` over the bench's instance."""
    workspace = bench.base / "workspace.yaml"
    workspace.write_text(f"load_from:\n  - python_file:\n      relative_path: {ROOT / 'bench' / 'history_location.py'}\n"
                         f"      working_directory: {ROOT}\n      location_name: volley_history\n")
    with dagster_dev(workspace, dagster_yaml=ROOT / "dagster.yaml", home=home, cwd=ROOT,
                     env={"VOLLEY_BENCH_BASE": str(bench.base)}) as srv:
        keys = len(srv.client.asset_partitions(STATE.path)["keys"])  # warms the server up

        def once() -> float:
            t = time.perf_counter()
            srv.client.asset_partitions(STATE.path)
            return time.perf_counter() - t

        median, values = median_of(repeat, once)
    return median, values, keys


def profile(measure: Callable[[], Any], top: int) -> str:
    """cProfile of one measurement: the project's functions by cumulative time, then
    everything by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    measure()
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(rf"{ROOT}/(volley_dagster|assets|sensors|resources)/", top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue().replace(str(ROOT) + "/", "")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", default="1000,200000", help="history sizes, ascending")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions per figure (the median is shown)")
    parser.add_argument("--records", type=int, default=1_000, help="records per landed file")
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--workdir", default="/tmp/volley-history-bench")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--materialize", choices=["all", "state"], default="all",
                        help="synthesise materializations of every asset per kept partition, or of the state asset "
                             "only (what the UI's partition query reads; about 75 events/s on SQLite)")
    parser.add_argument("--no-graphql", action="store_true", help="skip the dagster dev query")
    parser.add_argument("--profile-top", type=int, default=25)
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.epochs.split(","))

    base = Path(args.workdir)
    shutil.rmtree(base, ignore_errors=True)
    (base / "events").mkdir(parents=True)
    home = base / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    t0 = time.perf_counter()
    get_or_create_spark(conf={"spark.sql.shuffle.partitions": "4"})  # the runs' local Spark
    report: dict[str, Any] = {"sizes": {}, "cores": os.cpu_count(), "repeat": args.repeat}
    with ExitStack() as stack:
        instance = stack.enter_context(DagsterInstance.from_config(str(home)))
        bench = Bench(base, instance, args.records, args.keys, args.materialize)
        bench.real_epochs()
        print(f"real epochs 1..{bench.template_epoch} ({REAL_FILES} files of {args.records:,} records, then one empty "
              f"epoch, the template) in {time.perf_counter() - t0:.0f}s; keep_epochs "
              f"{bench.checkpoints.keep_epochs}, partitions_kept {bench.deployment.partitions_kept:,}", flush=True)
        print(_synthesised_note(bench, args.materialize))
        profiles: dict[str, str] = {}
        for n in sizes:
            print(f"\n== {n:,} epochs ==", flush=True)
            row: dict[str, Any] = {"synthesis": bench.grow(n)}
            bench.tick_idle()  # settles the cursor (observation digest, verdicts) after the growth
            row["tick_idle_s"], row["tick_idle_all"] = median_of(args.repeat, bench.tick_idle)
            row["checks_s"], row["checks_all"] = median_of(args.repeat, bench.checks)
            runs = [bench.run_empty() for _ in range(args.repeat)]
            row["run_empty_epoch_s"] = statistics.median(r[0] for r in runs)
            row["engine_empty_epoch_s"] = statistics.median(r[1] for r in runs)
            row["run_empty_all"] = [r[0] for r in runs]
            row["run_noop_s"], row["run_noop_all"] = median_of(args.repeat, bench.run_noop)
            bench.tick_idle()
            row["tick_new_file_s"], row["tick_new_file_all"] = median_of(args.repeat, bench.tick_new_file)
            row["source_backlog_s"], row["source_backlog_all"] = median_of(args.repeat, functools.partial(bench.source_backlog, n))
            row["epochs_at_end"] = bench.log.last_committed()
            row["partitions"] = len(instance.get_dynamic_partitions(bench.partitions))
            row["epoch_folders"] = sum(1 for _ in (bench.log.root / "epochs").iterdir())
            if not args.no_graphql:
                q, values, keys = graphql_partitions(bench, home, args.repeat)
                row["graphql_partitions_s"], row["graphql_all"], row["graphql_partition_keys"] = q, values, keys
            if n == sizes[-1]:
                profiles["one sensor tick with nothing new"] = profile(bench.tick_idle, args.profile_top)
                profiles["one run of an empty epoch"] = profile(bench.run_empty, args.profile_top)
            report["sizes"][n] = row
            _print_size(n, row)
    _print_ratios(sizes, report["sizes"])
    for what, text in profiles.items():
        print(f"\ncProfile of {what} at {sizes[-1]:,} epochs (project functions by cumulative time, then "
              f"everything by own time):")
        print(text)
    report["profiles"] = profiles
    path = finish("history", report, base, args.keep)
    print(f"wrote {path}" + (f"; kept {base}" if args.keep else ""))


def _synthesised_note(bench: Bench, materialize: str) -> str:
    assets = "per asset" if materialize == "all" else "of the state asset only (--materialize state)"
    return (
        "synthesised per size (not run): epochs/<key>/offsets.json + manifest.json for every epoch, then compacted by "
        "retention into epochs/archive/ (copies of the real "
        f"empty epoch {bench.template_epoch}, epoch, times and snapshot paths rewritten; empty ranges at the source's real "
        f"end); snapshots of the last {bench.checkpoints.keep_epochs} epochs (hardlinks) and retention.json; one empty "
        f"commit per table for each of the last {ROW_COUNT_WINDOW} epochs; dynamic partitions of the last "
        f"{bench.deployment.partitions_kept:,} epochs and one runless materialization {assets} per kept partition.\n"
        "NOT synthesised: the tables' history before the last 32 epochs, Dagster runs and their event logs, check "
        "evaluations, sensor ticks; the source holds only the real files. Measured epochs and runs are real. "
        "The source backlog figure reads a second local file log of N files (N - 1 empty ones before the read "
        "position), as a tick lists it."
    )


def _print_size(n: int, row: dict[str, Any]) -> None:
    print(f"  {n:,} epochs (last committed {row['epochs_at_end']:,}; {row['epoch_folders']:,} epoch folders, "
          f"{row['partitions']:,} partitions)")
    for key, label in FIGURES:
        if key in row:
            print(f"  {label:34s} {row[key] * 1000:9.1f} ms")


def _print_ratios(sizes: list[int], rows: dict[int, dict[str, Any]]) -> None:
    small, large = rows[sizes[0]], rows[sizes[-1]]
    print(f"\n{'figure (median)':34s} {sizes[0]:>10,} {sizes[-1]:>10,}   ratio  (target <= 1.5x)")
    for key, label in FIGURES:
        if key in small and key in large:
            ratio = large[key] / small[key] if small[key] else float("nan")
            verdict = "ok" if ratio <= 1.5 else "OVER"
            print(f"{label:34s} {small[key] * 1000:8.1f}ms {large[key] * 1000:8.1f}ms {ratio:6.2f}x  {verdict}")


if __name__ == "__main__":
    main()
