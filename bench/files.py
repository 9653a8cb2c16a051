"""What an epoch of many small files costs against one file of the same records: workload
A (``bench/workloads.py``, a running aggregate upserted to Delta) over the same events,
cut once as one file an epoch and once as ``--files-per-epoch`` files an epoch, each in
its own checkpoint root, warm in one Spark, the two taking turns epoch by epoch.

    ./dev bench files [--records 6000000] [--keys 1000000] [--epochs 6] [--files-per-epoch 50]
                      [--format parquet|json]

``--format json`` writes both logs as JSON lines, which the Python reader decodes
(as it does logs on S3) instead of Spark's own Parquet scan.

Prints the median seconds of an epoch (the first, which warms Spark, left out) each way,
and their ratio; writes bench/results/files.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import finish, log_arguments  # noqa: E402
from bench.compare import spark_session, volley_runner  # noqa: E402
from bench.workloads import Workload, event_log  # noqa: E402
from volley_dagster.demo.events import write_events  # noqa: E402
from volley_dagster.sources.storage import storage_for  # noqa: E402


def split(files: list[Path], into: Path, parts: int, fmt: str) -> tuple[str, ...]:
    """Each file as ``parts`` files of its records in order (in ``fmt``), named so they sort in it."""
    storage = storage_for(str(into))
    names = []
    for i, f in enumerate(files):
        table = pq.read_table(f)
        size = -(-table.num_rows // parts)
        for j in range(parts):
            name = f"events-{i:06d}-{j:04d}.{'jsonl' if fmt == 'json' else 'parquet'}"
            write_events(storage, name, table.slice(j * size, size), fmt)
            names.append(name)
    return tuple(names)


def main() -> None:
    parser = argparse.ArgumentParser()
    log_arguments(parser, records=6_000_000, epochs=6)
    parser.add_argument("--files-per-epoch", type=int, default=50)
    parser.add_argument("--format", choices=["parquet", "json"], default="parquet")
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-files-"))
    generated = event_log(work / "events", args.epochs, args.records, args.keys, None)
    files = [work / "events" / n for n in generated]
    ones = split(files, work / f"one-{args.format}", 1, args.format)
    many = split(files, work / f"many-{args.format}", args.files_per_epoch, args.format)
    per_epoch = args.records // args.epochs
    spark = spark_session(args.shards)
    ways = {"one file": Workload("A", work / f"one-{args.format}", ones, args.shards, args.format),
            f"{args.files_per_epoch} files": Workload("A", work / f"many-{args.format}", many, args.shards, args.format)}
    runners = {}
    for name, w in ways.items():
        runner = volley_runner(w, work / f"{name.replace(' ', '-')}-{args.format}", spark)
        runner.settings = replace(runner.settings, max_records_per_epoch=per_epoch)
        runners[name] = runner
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for epoch in range(args.epochs):
        order = list(ways) if epoch % 2 == 0 else list(ways)[::-1]
        for name in order:
            t = time.perf_counter()
            result = runners[name].run_next()
            seconds[name].append(time.perf_counter() - t)
            assert result is not None and result.records_in == per_epoch, f"{name}: epoch {epoch + 1} read {result}"
    medians = {name: statistics.median(s[1:]) for name, s in seconds.items()}
    one, many_name = list(ways)
    ratio = medians[many_name] / medians[one]
    print(f"{args.records:,} events over {args.keys:,} keys, {args.epochs} epochs of {per_epoch:,}, {args.shards} shards, "
          f"{args.format}")
    for name, median in medians.items():
        print(f"{name:<10} {median:6.2f} s an epoch  (median of epochs 2-{args.epochs}: "
              f"{', '.join(f'{s:.2f}' for s in seconds[name][1:])})")
    print(f"{many_name} / one file: {ratio:.2f}x")
    report = {"args": vars(args), "seconds": seconds, "median_s": medians, "ratio": ratio}
    print("->", finish("files", report, work, keep=args.workdir is not None))


if __name__ == "__main__":
    main()
