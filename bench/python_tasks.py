"""What a Python stage costs before any work: Spark jobs of 1, 2, 4 and 8 tasks, each a
``mapInArrow`` that hands its one row back (the shape of an epoch's shard stage and a
deduplication's probe), against the same jobs in the JVM alone, with the executor
reaching its Python workers over loopback TCP and over a Unix socket
(``spark.python.unix.domain.socket.enabled``, what ``spark/session.py`` sets). Each
transport runs in its own process, since the setting is read when Spark starts; the two
take turns for ``--rounds``.

    ./dev bench python_tasks [--rounds 2] [--reps 11]

Prints the medians per job and transport; writes bench/results/python_tasks.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import RESULTS  # noqa: E402

TASKS = (1, 2, 4, 8)
TRANSPORTS = {"tcp": "false", "unix": "true"}


def handed_back(batches: Iterator[Any]) -> Iterator[Any]:
    yield from batches


def child(transport: str, reps: int) -> dict[str, dict[str, float]]:
    """Medians (seconds) of each job in one Spark, after one warm-up run of each."""
    from volley_dagster.spark.session import get_or_create_spark

    spark = get_or_create_spark(conf={"spark.python.unix.domain.socket.enabled": TRANSPORTS[transport]})

    def median(run: Any) -> float:
        run()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    out = {}
    for n in TASKS:
        rows = spark.range(0, n, 1, n)
        out[str(n)] = {"jvm_s": median(rows.toArrow),
                       "python_s": median(lambda rows=rows: rows.mapInArrow(handed_back, "id bigint").toArrow())}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--child", choices=sorted(TRANSPORTS))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reps)))
        return
    runs: dict[str, list[dict[str, dict[str, float]]]] = {t: [] for t in TRANSPORTS}
    for _ in range(args.rounds):
        for transport in TRANSPORTS:
            cmd = [sys.executable, __file__, "--child", transport, "--reps", str(args.reps)]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs[transport].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'tasks':>5} {'jvm ms':>8} " + " ".join(f"{t + ' ms':>9}" for t in TRANSPORTS) + "  unix/tcp  (medians over rounds)")
    summary = {}
    for n in map(str, TASKS):
        jvm = statistics.median(r[n]["jvm_s"] for t in TRANSPORTS for r in runs[t])
        python = {t: statistics.median(r[n]["python_s"] for r in runs[t]) for t in TRANSPORTS}
        summary[n] = {"jvm_s": jvm, **{f"{t}_s": s for t, s in python.items()}}
        print(f"{n:>5} {jvm * 1000:>8.0f} " + " ".join(f"{python[t] * 1000:>9.0f}" for t in TRANSPORTS)
              + f"  {python['unix'] / python['tcp']:>8.2f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "python_tasks.json").write_text(json.dumps({"rounds": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
