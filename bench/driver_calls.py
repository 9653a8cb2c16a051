"""What planning an epoch costs the driver: its round trips to Spark's JVM (py4j), per
epoch, with their time, by the engine's call site that made them, for each workload
against A in the same run. Building DataFrames is a round trip per call (most of them
analysed in the JVM at once), whatever the epoch's size: at 10M records it is a fixed
part of each epoch, which ``compare --profile`` shows only inside ``read_transform``
and ``state_stage``.

    ./dev bench driver_calls [--records 1200000] [--keys 100000] [--epochs 6] [--shards 4]
                             [--workloads A,Ad] [--top 8]

The first two epochs of each workload warm up; the others are counted. Prints, per
workload, the median epoch, the round trips and their seconds an epoch (and the ratio
to A's), then the call sites that cost most; writes bench/results/driver_calls.json.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import finish, log_arguments  # noqa: E402
from bench.compare import spark_session, volley_runner, workload_log  # noqa: E402
from bench.workloads import event_log  # noqa: E402

ENGINE = str(ROOT / "volley_dagster")
WARM_UP = 2


class RoundTrips:
    """Every py4j command the driver sends while ``counting``, by the innermost engine
    frame that sent it (``?``: none, e.g. py4j freeing a Java object from a finalizer)."""

    def __init__(self) -> None:
        self.counting = False
        self.by_site: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])

    def install(self) -> None:
        from py4j.clientserver import ClientServerConnection

        send: Callable[[Any, str], Any] = ClientServerConnection.send_command
        trips = self

        def counted(connection: Any, command: str) -> Any:
            if not trips.counting:
                return send(connection, command)
            t = time.perf_counter()
            try:
                return send(connection, command)
            finally:
                trips.add(time.perf_counter() - t)

        ClientServerConnection.send_command = counted

    def add(self, seconds: float) -> None:
        frames = [f for f in traceback.extract_stack(limit=40) if f.filename.startswith(ENGINE)]
        site = f"{Path(frames[-1].filename).relative_to(ENGINE)}:{frames[-1].lineno} ({frames[-1].name})" if frames else "?"
        entry = self.by_site[site]
        entry[0] += 1
        entry[1] += seconds


def measure(name: str, work: Path, events: tuple[str, ...], args: argparse.Namespace,
            trips: RoundTrips) -> dict[str, Any]:
    w = workload_log(name, work, events, args.shards, "head")
    runner = volley_runner(w, work / f"run-{name}", spark_session(args.shards))
    trips.by_site.clear()
    seconds = []
    for index in range(len(events)):
        runner.settings = replace(runner.settings, max_records_per_epoch=w.records(index))
        trips.counting = index >= WARM_UP
        t = time.perf_counter()
        runner.run_next()
        seconds.append(time.perf_counter() - t)
    trips.counting = False
    counted = len(events) - WARM_UP
    sites = sorted(trips.by_site.items(), key=lambda kv: -kv[1][1])
    return {
        "workload": name,
        "epoch_median_s": statistics.median(seconds[WARM_UP:]),
        "calls_per_epoch": sum(n for n, _ in trips.by_site.values()) / counted,
        "seconds_per_epoch": sum(s for _, s in trips.by_site.values()) / counted,
        "sites": [{"site": site, "calls_per_epoch": n / counted, "ms_per_epoch": s / counted * 1000}
                  for site, (n, s) in sites],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    log_arguments(parser, records=1_200_000, keys=100_000, epochs=6)
    parser.add_argument("--workloads", default="A,Ad")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    if args.epochs <= WARM_UP:
        parser.error(f"--epochs must be more than the {WARM_UP} that warm up")
    names = list(dict.fromkeys(["A", *args.workloads.split(",")]))  # A first: the others' yardstick
    work = Path(args.workdir or tempfile.mkdtemp(prefix="volley-driver-calls-"))
    events = event_log(work / "events", args.epochs, args.records, args.keys, None)
    trips = RoundTrips()
    trips.install()
    results = [measure(name, work, events, args, trips) for name in names]
    base = results[0]
    print(f"{'workload':<9}{'epoch s':>8}{'trips':>8}{'trips s':>9}{'share':>7}{'trips / A':>10}{'trips s / A':>12}")
    for r in results:
        r["share_of_epoch"] = r["seconds_per_epoch"] / r["epoch_median_s"]
        print(f"{r['workload']:<9}{r['epoch_median_s']:>8.2f}{r['calls_per_epoch']:>8.0f}{r['seconds_per_epoch']:>9.3f}"
              f"{r['share_of_epoch']:>7.0%}{r['calls_per_epoch'] / base['calls_per_epoch']:>9.2f}x"
              f"{r['seconds_per_epoch'] / base['seconds_per_epoch']:>11.2f}x")
    for r in results:
        print(f"\n{r['workload']}: the call sites that cost most, an epoch")
        for s in r["sites"][:args.top]:
            print(f"  {s['calls_per_epoch']:6.1f} trips {s['ms_per_epoch']:6.1f} ms  {s['site']}")
    report = {"args": vars(args), "results": results}
    print(f"\nwrote {finish('driver_calls', report, work, keep=args.workdir is not None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
