"""What one writer per pipeline costs: taking and giving back the lease, and the
fencing check each install, sink commit and manifest makes, against the floor of
one crash-safe exclusive file create (what an epoch's manifest write costs anyway).

    ./dev bench lease [--reps 500]

Prints medians and p95 in milliseconds, and the ratios to the floor.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from volley_dagster.checkpoint.lease import PipelineLease
from volley_dagster.io.atomic import create_json_exclusive

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, reps: int) -> list[float]:
    out = []
    for i in range(reps):
        t = time.perf_counter()
        fn(i)
        out.append((time.perf_counter() - t) * 1000)
    return sorted(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=500)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="volley-bench-lease-"))
    floor = timed(lambda i: create_json_exclusive(root / "floor" / f"{i}.json", {"epoch": i}), args.reps)
    cycle = timed(lambda i: PipelineLease(root / "pipe").acquire().release(), args.reps)
    held = PipelineLease(root / "pipe").acquire()
    check = timed(lambda i: held.fence.check("bench"), args.reps)
    held.release()

    def row(name: str, ms: list[float]) -> str:
        median, p95 = statistics.median(ms), ms[int(len(ms) * 0.95)]
        return f"{name:<34} {median:>8.3f} {p95:>8.3f} {median / statistics.median(floor):>8.2f}x"

    print(f"{'(ms, ' + str(args.reps) + ' reps)':<34} {'median':>8} {'p95':>8} {'vs floor':>9}")
    print(row("floor: one exclusive file create", floor))
    print(row("lease: acquire + release", cycle))
    print(row("fence check (per install/commit)", check))


if __name__ == "__main__":
    main()
