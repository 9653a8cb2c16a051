"""Where a small epoch's time goes, on one timeline: the driver before Spark's first
stage (the DataFrames planned through py4j, then, from the last job's ``toArrow``,
optimised and code-generated in the JVM), each stage and each of its tasks (launch, run,
the JVM's CPU in it), and the driver after the last stage (output, sinks, manifest,
pruning). An epoch of a few thousand records pays these whatever its size; ``compare
--profile`` shows them only inside its phases.

    ./dev bench epoch_timeline [--records 200000] [--keys 20000] [--epochs 10] [--shards 4]
                               [--workloads A,B] [--show 2]

The first ``WARM_UP`` epochs of each workload warm up. Prints, per workload, the medians
of the timeline's parts over the other epochs (``JVM plan``: from the state stage's
``toArrow`` to its job's first stage), then the last ``--show`` epochs task by
task; writes bench/results/epoch_timeline.json. Reads Spark's status store (what its UI
shows), kept with the UI off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import finish, log_arguments  # noqa: E402
from bench.compare import spark_session, volley_runner, workload_log  # noqa: E402
from bench.workloads import event_log  # noqa: E402

WARM_UP = 3


class ArrowCollects:
    """When the driver asks Spark for a job's rows as Arrow (``DataFrame.toArrow``): the
    state stage's job is the epoch's last."""

    def __init__(self) -> None:
        self.started: list[float] = []

    def install(self) -> None:
        from pyspark.sql.classic.dataframe import DataFrame

        to_arrow, started = DataFrame.toArrow, self.started

        def timed(df: Any) -> Any:
            started.append(time.time())
            return to_arrow(df)

        DataFrame.toArrow = timed  # type: ignore[method-assign,assignment]


class StatusStore:
    """Spark's own record of stages and tasks (``AppStatusStore``), read through py4j."""

    def __init__(self, spark: Any) -> None:
        context = spark.sparkContext
        self.store = context._jsc.sc().statusStore()
        self.no_quantiles = context._gateway.new_array(context._jvm.double, 0)
        self.seen: set[int] = set(self._stages())

    def _stages(self) -> dict[int, Any]:
        found, stages = {}, self.store.stageList(None, False, False, self.no_quantiles, None).iterator()
        while stages.hasNext():
            stage = stages.next()
            found[stage.stageId()] = stage
        return found

    def new_stages(self, since: float) -> list[dict[str, Any]]:
        """The stages that ran since the last call (skipped ones left out), times in seconds after ``since``."""
        fresh = {k: s for k, s in self._stages().items() if k not in self.seen}
        self.seen |= set(fresh)
        out = []
        for stage_id in sorted(fresh):
            stage = fresh[stage_id]
            if not stage.submissionTime().isDefined() or not stage.completionTime().isDefined():
                continue
            tasks, found = [], self.store.taskList(stage_id, stage.attemptId(), 10_000).iterator()
            while found.hasNext():
                task = found.next()
                metrics = task.taskMetrics().get()
                launch = task.launchTime().getTime() / 1000 - since
                tasks.append({"index": task.index(), "launch_s": launch, "end_s": launch + task.duration().get() / 1000,
                              "run_s": metrics.executorRunTime() / 1000,
                              "deserialize_s": metrics.executorDeserializeTime() / 1000,
                              "jvm_cpu_s": metrics.executorCpuTime() / 1e9})
            out.append({"stage": stage_id, "tasks": sorted(tasks, key=lambda t: t["launch_s"]),
                        "submitted_s": stage.submissionTime().get().getTime() / 1000 - since,
                        "completed_s": stage.completionTime().get().getTime() / 1000 - since})
        return out


def epoch_parts(seconds: float, stages: list[dict[str, Any]], last_collect_s: float) -> dict[str, float]:
    """The epoch cut into: before the first stage, from the first stage's start to the
    last's end (the gaps between stages, where the JVM plans the next, inside it), after
    the last. A shard stage with more tasks than cores runs in waves: its tasks' run
    time summed against its wall.
    ``last_collect_s``: when the epoch's last ``toArrow`` was called; from there to the
    next stage, the JVM plans that job."""
    if not stages:
        raise RuntimeError("an epoch of this bench ran no Spark stage: each epoch reads a file of records")
    tasks = [t for s in stages for t in s["tasks"]]
    job_start = min((s["submitted_s"] for s in stages if s["submitted_s"] >= last_collect_s), default=last_collect_s)
    return {"epoch_s": seconds, "before_first_stage_s": stages[0]["submitted_s"],
            "last_job_planned_in_jvm_s": job_start - last_collect_s,
            "stages_s": stages[-1]["completed_s"] - stages[0]["submitted_s"],
            "after_last_stage_s": seconds - stages[-1]["completed_s"],
            "task_run_summed_s": sum(t["run_s"] for t in tasks),
            "task_jvm_cpu_summed_s": sum(t["jvm_cpu_s"] for t in tasks),
            "stages": len(stages), "tasks": len(tasks)}


def measure(name: str, work: Path, events: tuple[str, ...], args: argparse.Namespace,
            collects: ArrowCollects) -> dict[str, Any]:
    w = workload_log(name, work, events, args.shards, "tail")
    spark = spark_session(args.shards)
    runner = volley_runner(w, work / f"run-{name}", spark)
    status = StatusStore(spark)
    epochs: list[dict[str, Any]] = []
    for index in range(len(events)):
        runner.settings = replace(runner.settings, max_records_per_epoch=w.records(index))
        start = time.time()
        runner.run_next()
        seconds = time.time() - start
        stages = status.new_stages(since=start)
        last_collect = collects.started[-1] - start if collects.started and collects.started[-1] >= start else seconds
        epochs.append({"epoch": index + 1, "parts": epoch_parts(seconds, stages, last_collect), "stages": stages})
    counted = epochs[WARM_UP:]
    medians = {key: statistics.median(e["parts"][key] for e in counted) for key in counted[0]["parts"]}
    return {"workload": name, "medians": medians, "epochs": epochs}


def print_epoch(epoch: dict[str, Any]) -> None:
    parts = epoch["parts"]
    print(f"  epoch {epoch['epoch']}: {parts['epoch_s']:.3f} s; before the first stage {parts['before_first_stage_s']:.3f} s; "
          f"the last job planned in the JVM {parts['last_job_planned_in_jvm_s']:.3f} s")
    for stage in epoch["stages"]:
        print(f"    stage {stage['stage']}: +{stage['submitted_s']:.3f} to +{stage['completed_s']:.3f} s, "
              f"{len(stage['tasks'])} task(s)")
        for t in stage["tasks"]:
            print(f"      task {t['index']}: +{t['launch_s']:.3f} to +{t['end_s']:.3f} s, run {t['run_s']:.3f} s "
                  f"(deserialise {t['deserialize_s']:.3f}, JVM CPU {t['jvm_cpu_s']:.3f})")
    print(f"    after the last stage {parts['after_last_stage_s']:.3f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    log_arguments(parser, records=200_000, keys=20_000, epochs=10)
    parser.add_argument("--workloads", default="A,B")
    parser.add_argument("--show", type=int, default=2, help="the last epochs of each workload to print task by task")
    args = parser.parse_args()
    if args.epochs <= WARM_UP:
        parser.error(f"--epochs must be more than the {WARM_UP} that warm up")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-epoch-timeline-"))
    events = event_log(work / "events", args.epochs, args.records, args.keys, None)
    collects = ArrowCollects()
    collects.install()
    results = [measure(name, work, events, args, collects) for name in args.workloads.split(",")]
    print(f"\nmedians of epochs {WARM_UP + 1}-{args.epochs}, {args.records // args.epochs:,} records an epoch, "
          f"{args.shards} shards")
    print(f"{'workload':<9}{'epoch s':>8}{'before':>8}{'JVM plan':>10}{'stages':>8}{'after':>8}{'#stages':>8}"
          f"{'#tasks':>7}{'task run':>9}{'JVM CPU':>8}")
    for r in results:
        m = r["medians"]
        print(f"{r['workload']:<9}{m['epoch_s']:>8.3f}{m['before_first_stage_s']:>8.3f}"
              f"{m['last_job_planned_in_jvm_s']:>10.3f}{m['stages_s']:>8.3f}"
              f"{m['after_last_stage_s']:>8.3f}{m['stages']:>8.0f}{m['tasks']:>7.0f}{m['task_run_summed_s']:>9.3f}"
              f"{m['task_jvm_cpu_summed_s']:>8.3f}")
    for r in results:
        print(f"\n{r['workload']}:")
        for epoch in r["epochs"][max(0, len(r["epochs"]) - args.show):]:  # --show 0: none ([-0:] is all)
            print_epoch(epoch)
    report = {"args": vars(args), "results": results}
    print(f"\nwrote {finish('epoch_timeline', report, work, keep=args.workdir is not None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
