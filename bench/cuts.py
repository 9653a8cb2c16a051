"""Epochs cut inside files, as ``max_records_per_epoch`` cuts most real ones: workload B
(``bench/workloads.py``, 1-minute tumbling windows appended to Delta) over the demo's
events, warm, each epoch ``--epoch-records`` long so that it ends inside a file.

The footers of the row groups an epoch touches only bound its event times: a row group
that straddles the cut shows an earlier epoch's earliest time (so records look late) and
a later epoch's latest (so W[N], which the shard tasks need before they start, is not
known). Before each epoch runs, two ways of learning its latest event time are timed in
turn on its plan: Spark's ``max()`` over the epoch's rows (the cheapest job there is) and
the driver's read of the one column of the row groups its segments touch
(``NativeParquetFile.time_statistics``, which the epoch now runs); the two must agree.
Then the epoch runs, and its side-output phase (the side-output job, if one ran) is
recorded.

    ./dev bench cuts [--records 6000000] [--keys 1000000] [--epochs 6] [--epoch-records 750000]

Prints the medians of both ways (the first epoch, which warms Spark, left out) and their
ratio, and the epochs' median seconds and side-output phase; writes bench/results/cuts.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import finish, log_arguments  # noqa: E402
from bench.compare import spark_session, volley_runner  # noqa: E402
from bench.workloads import Workload, event_log  # noqa: E402
from volley_dagster.spark.plan import plan_epoch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser, records=6_000_000, epochs=6)
    parser.add_argument("--epoch-records", type=int, default=750_000)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-cuts-"))
    files = event_log(work / "events", args.epochs, args.records, args.keys, None)
    spark = spark_session(args.shards)
    runner = volley_runner(Workload("B", work / "events", files, args.shards), work / "B", spark)
    runner.settings = replace(runner.settings, max_records_per_epoch=args.epoch_records)
    ways: dict[str, list[float]] = {"spark max()": [], "column read": []}
    epochs: list[dict[str, float]] = []
    while (rng := runner.cut_next()) is not None:
        plan = plan_epoch(spark, runner.pipeline, rng)
        clock = plan.event_time
        assert clock is not None and plan.files_as_read, "B over local Parquet: the epoch's rows are its files'"
        latest: dict[str, int | None] = {}
        for name in (list(ways) if rng.epoch % 2 else list(ways)[::-1]):
            t = time.perf_counter()
            if name == "spark max()":
                latest[name] = plan.keyed.agg(clock.maxima(clock.event_us())[""]).first()[0]
            else:
                latest[name] = max(f.time_statistics(clock.time_column, seg.start, seg.end).latest_us or 0
                                   for seg, f in plan.files_as_read)
            ways[name].append(time.perf_counter() - t)
        assert len(set(latest.values())) == 1, f"epoch {rng.epoch}: the two ways disagree: {latest}"
        t = time.perf_counter()
        result = runner.run(rng.epoch)
        epochs.append({"epoch": rng.epoch, "records": result.records_in, "seconds": time.perf_counter() - t,
                       "side_output": result.durations["side_output"],
                       "inside_files": sum(1 for seg, f in plan.files_as_read if not f.is_all_of(seg))})
    medians = {name: statistics.median(s[1:]) for name, s in ways.items()}
    print(f"{args.records:,} events over {args.keys:,} keys in {args.epochs} files, epochs of "
          f"{args.epoch_records:,} records ({len(epochs)}), {args.shards} shards, workload B, warm")
    for name, median in medians.items():
        print(f"{name:<12} {median:6.3f} s  (epochs 2-{len(epochs)}: {', '.join(f'{s:.3f}' for s in ways[name][1:])})")
    ratio = medians["column read"] / medians["spark max()"]
    print(f"column read / spark max(): {ratio:.2f}x")
    later = epochs[1:]
    print(f"epochs: {statistics.median(e['seconds'] for e in later):.2f} s median, side-output phase "
          f"{statistics.median(e['side_output'] for e in later):.3f} s median")
    report = {"args": vars(args), "latest_event_time_s": ways, "median_s": medians, "ratio": ratio, "epochs": epochs}
    print("->", finish("cuts", report, work, keep=args.workdir is not None))


if __name__ == "__main__":
    main()
