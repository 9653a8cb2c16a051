"""When to run a failed epoch again: exponential backoff with jitter for transient
failures, a stop for permanent ones.

An orchestrator (the Dagster sensor and schedule) hands in the failed runs of the
pipeline since its last committed epoch, newest first, each classified where it
failed (``errors.classify``); ``decide`` says whether to request the epochs now. The
decision depends only on those runs and the clock, never on state kept between
ticks, so a sensor and a schedule of one pipeline agree, and a restarted daemon
neither waits again nor forgets a wait. The budget resets as soon as an epoch
commits: only failures after the last commit count.

Rules:
- no failure since the last commit: request now;
- the newest failure is permanent (configuration, lineage, a corrupt snapshot, a
  schema): stop and name it; a person fixes the cause and launches a backfill (a new
  failure that is transient puts the pipeline back on backoff);
- otherwise the k-th consecutive failure waits ``min(max_s, first_s * 2**(k-1))``
  times a jitter in [0.5, 1] after that run ended, then requests again, forever. From
  ``alert_after`` failures on, the ``epochs_progress`` check is red while retries go on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Sequence

DEFAULT_FIRST_S = 10.0
DEFAULT_MAX_S = 300.0
DEFAULT_ALERT_AFTER = 5


@dataclass(frozen=True)
class Backoff:
    """Delays between the runs that retry a failed epoch."""

    first_s: float = DEFAULT_FIRST_S
    max_s: float = DEFAULT_MAX_S
    alert_after: int = DEFAULT_ALERT_AFTER  # consecutive failures after which the progress check turns red
    retries_in_run: int = 3  # a run's own retries of a transient failure, after the same delays, before it fails

    def __post_init__(self) -> None:
        if not (0 < self.first_s <= self.max_s):
            raise ValueError(f"backoff: need 0 < first_s <= max_s, got first_s={self.first_s}, max_s={self.max_s}")
        if self.retries_in_run < 0:
            raise ValueError(f"backoff: retries_in_run must be at least 0, got {self.retries_in_run}")
        if self.alert_after < 1:
            raise ValueError(f"backoff: alert_after must be at least 1, got {self.alert_after}")

    def delay_s(self, failures: int, salt: str = "") -> float:
        """The wait after the ``failures``-th consecutive failure. The jitter is a
        function of ``salt`` (the pipeline) and the count, so that every evaluation
        computes the same time while pipelines that failed together spread out."""
        if failures <= 0:
            return 0.0
        step = min(self.max_s, self.first_s * 2.0 ** min(failures - 1, 62))
        digest = hashlib.sha256(f"{salt}:{failures}".encode()).digest()
        jitter = int.from_bytes(digest[:8], "big") / 2.0**64
        return step * (0.5 + 0.5 * jitter)


@dataclass(frozen=True)
class FailedRun:
    """A failed run of the pipeline, as the orchestrator recorded it."""

    run_id: str
    ended_at: float  # epoch seconds
    permanent: str | None = None  # the named error when it failed permanently; None for transient or unknown


@dataclass(frozen=True)
class RecoveryDecision:
    request: bool  # request the uncommitted epochs now
    stopped: bool  # a permanent failure: nothing is requested until a person acts
    failures: int  # consecutive failed runs since the last commit
    next_at: float | None  # when the next request is due (None: now, or stopped)
    reason: str  # for a skip message and the progress check
    alert: bool  # the epochs_progress check should fail


def decide(failures: Sequence[FailedRun], now: float, backoff: Backoff, first_epoch: int, last_epoch: int,
           salt: str = "") -> RecoveryDecision:
    """``failures``: the pipeline's failed runs since its last committed epoch, newest first."""
    epochs = f"epochs {first_epoch}..{last_epoch}"
    if not failures:
        return RecoveryDecision(True, False, 0, None, f"{epochs} wait to run", False)
    newest, count = failures[0], len(failures)
    if newest.permanent is not None:
        return RecoveryDecision(
            False, True, count, None,
            f"stopped: epoch {first_epoch} failed permanently in run {newest.run_id}: {newest.permanent}. Retrying "
            f"cannot fix this; fix the cause, then launch a backfill of {epochs} (the sensor resumes once it commits)",
            True)
    due = newest.ended_at + backoff.delay_s(count, salt)
    alert = count >= backoff.alert_after
    retrying = (f"epoch {first_epoch} failed in {count} run(s) since the last commit, the newest {newest.run_id} "
                f"(transient)")
    if now >= due:
        return RecoveryDecision(True, False, count, None, f"{retrying}: requesting {epochs} again", alert)
    return RecoveryDecision(False, False, count, due,
                            f"{retrying}: backing off, next request of {epochs} at {_iso(due)} "
                            f"(in {due - now:.0f}s)", alert)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")
