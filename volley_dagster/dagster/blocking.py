"""A blocking check that failed, kept in the checkpoint root until the checks pass again.

A blocking check (checksums, recorded epoch, each epoch once, row counts) says the
data is wrong, so its failure must outlive the run that saw it: the run fails, but
the next run over new epochs would otherwise check only what it changed, and a file
of the flagged snapshot, hardlinked into the next one, counts as shared and is never
hashed again. So the failure is recorded in ``<checkpoint root>/blocking_checks.json``,
and while it is there:

- the sensor and the schedule request no run (the skip reason and the
  ``epochs_progress`` check name it and say what to do);
- every run's checks cover the flagged epochs again, hashing the flagged snapshot
  in full, and the record goes once they all pass;
- retention keeps the snapshots from ``keep_epochs`` before the flagged epochs on, so
  the sound state before the damage is still there to restore or rescale from (in the
  runs of the pipeline's Dagster jobs, whose runner ``make_runner`` builds; a runner of
  the CLI or the API over the same root does not read the record).

A person clears it by fixing what the checks name and materializing the last
committed epoch's partition (its run re-runs the checks), or, to resume without a
fix, by deleting the file (``clear_blocking_failure``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from volley_dagster.checkpoint.epoch_log import EpochLog, epoch_key
from volley_dagster.io.atomic import read_json, write_json_atomic

RECORD = "blocking_checks.json"


@dataclass(frozen=True)
class BlockingFailure:
    """What failed, over which epochs, and in which run."""

    pipeline: str
    first: int  # the epochs the failing checks covered
    last: int
    snapshot_epoch: Optional[int]  # the epoch whose snapshot failed its checksums (None: only table checks failed)
    checks: tuple[str, ...]  # "payments/state snapshot_checksums", ...
    descriptions: tuple[str, ...]  # each failed check's own description
    run_id: str
    failed_at: str  # ISO time

    @property
    def epochs(self) -> range:
        return range(self.first, self.last + 1)

    def describe(self, root: Path) -> str:
        """The skip reason and the progress check's description: what failed, and what to do."""
        what = "; ".join(f"{check}: {text}" for check, text in zip(self.checks, self.descriptions, strict=True))
        rehash = (f", hashing epoch {self.snapshot_epoch}'s snapshot in full" if self.snapshot_epoch is not None
                  else "")
        return (f"stopped: blocking check(s) of {self.pipeline!r} failed over epochs {self.first}..{self.last} in run "
                f"{self.run_id or '(none)'}: {what}. No epoch is requested until they pass, and retention keeps the "
                f"snapshots before them. Fix what they name, then materialize partition {epoch_key(self.last)} "
                f"(or the last committed one): its run re-runs the checks over epochs {self.first}.. on{rehash}, and "
                f"the pipeline resumes once they pass. To resume without a fix, delete {root / RECORD}")


def blocking_failure(root: Path) -> Optional[BlockingFailure]:
    """The recorded failure under the checkpoint root ``root``, if any."""
    path = root / RECORD
    if not path.exists():
        return None
    d = read_json(path)
    return BlockingFailure(d["pipeline"], int(d["first"]), int(d["last"]), d.get("snapshot_epoch"),
                           tuple(d["checks"]), tuple(d["descriptions"]), d.get("run_id", ""), d.get("failed_at", ""))


def record_blocking_failure(root: Path, failure: BlockingFailure) -> None:
    write_json_atomic(root / RECORD, {**asdict(failure), "checks": list(failure.checks),
                                      "descriptions": list(failure.descriptions)})


def clear_blocking_failure(root: Path) -> bool:
    """Remove the record (the checks passed, or a person resumes without a fix); True if there was one."""
    try:
        (root / RECORD).unlink()
    except FileNotFoundError:
        return False
    return True


def kept_epochs(root: Path, keep: int) -> int:
    """The ``keep_epochs`` a run uses: ``keep``, or, while a failure is recorded, enough
    that no epoch it may commit (any cut one) removes the snapshots of the ``keep``
    epochs up to the first flagged one."""
    failure = blocking_failure(root)
    if failure is None:
        return keep
    return max(keep, EpochLog(root).last_cut() - failure.first + keep)
