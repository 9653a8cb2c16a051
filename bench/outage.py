"""An S3 outage under ``dagster dev`` with the shipped backoff (10 s doubling to 5
minutes): ``./dev bench outage [--minutes 10] [--workdir DIR]``. Prints how many runs
failed while S3 was down, and how long after it came back the first epoch and every
landed record were committed; nobody acts on the pipeline. The same scenario as
``tests/ui/test_outage.py`` (``harness/outage.py``), at full scale."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.outage import run_outage  # noqa: E402
from volley_dagster.recovery import Backoff  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long S3 stays down")
    parser.add_argument("--land-every", type=float, default=20.0, help="seconds between landed files")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    base = Path(args.workdir or tempfile.mkdtemp(prefix="volley-outage-"))
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    defaults = Backoff()
    print(f"shipped backoff: {defaults.first_s:.0f}s doubling to {defaults.max_s:.0f}s, {defaults.retries_in_run} "
          f"retries in a run; outage {args.minutes:.0f} min, a file every {args.land_every:.0f}s", flush=True)
    report = run_outage(base, land_every_s=args.land_every, backoff=None, outage_s=args.minutes * 60,
                        heal_within_s=defaults.max_s * 3 + 300, say=lambda m: print(m, flush=True))
    print(report.describe())
    bound = defaults.max_s
    print(f"first epoch after the outage: {report.first_commit_after_s:.1f}s after S3 returned "
          f"(one backoff step is at most {bound:.0f}s): {'ok' if report.first_commit_after_s <= bound + 60 else 'LATE'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
