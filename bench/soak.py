"""Run the demo's three pipelines under ``dagster dev`` with a random fault every 1-3
minutes and nobody acting, then check every table exactly (``harness/soak.py``).

    ./dev bench soak [--minutes 60] [--seed 76] [--land-every-s 5] [--workdir DIR]

Prints each fault as it is injected, then the faults by kind, the runs by status, the
longest any file waited for its epoch to commit, and the oracle's verdict; exits 1 when
the verdict is FAIL. Writes bench/results/soak.json."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.common import RESULTS
from harness.soak import run_soak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=76)
    parser.add_argument("--land-every-s", type=float, default=5.0)
    parser.add_argument("--workdir", default=None, help="keep the soak's folder here (default: a temp dir)")
    args = parser.parse_args()
    base = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="volley-soak-"))
    report = run_soak(base, minutes=args.minutes, seed=args.seed, land_every_s=args.land_every_s,
                      say=lambda line: print(line, flush=True))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps({
        "minutes": report.seconds / 60, "files": report.files, "faults": dict(report.faults),
        "missed": dict(report.missed), "runs": dict(report.runs), "restarts": report.restarts,
        "longest_wait_s": report.longest_wait_s, "healed_s": report.healed_s, "human_actions": report.human_actions,
        "verdicts": {v.pipeline: {"passed": v.passed, "checks": v.checks, "problems": v.problems}
                     for v in report.verdicts}}, indent=1))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
