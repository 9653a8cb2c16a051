"""An epoch log written directly, without Spark: ranges and manifests of empty epochs,
through the project's ``EpochLog``, for what a Dagster test needs of a root's age
(how many epochs, when each committed), not of its state."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.result import EpochResult
from volley_dagster.sources.offsets import EpochRange


def write_history(root: Path, pipeline: str, committed: int, cut: int,
                  committed_at: datetime | None = None, every: timedelta = timedelta(seconds=5)) -> EpochLog:
    """Epochs 1..``cut`` cut (reading nothing: a source folder with no files has nothing
    after them either), 1..``committed`` committed, one every ``every`` up to
    ``committed_at`` (default: now)."""
    log = EpochLog(root)
    last = committed_at or datetime.now(timezone.utc)
    for epoch in range(1, cut + 1):
        log.record_offsets(EpochRange(epoch, {}, {}))
        if epoch <= committed:
            at = last - (committed - epoch) * every
            log.write_manifest(EpochResult(pipeline, epoch, {}, 0, 0, 0, 0, 0, 0, 0, 0, {}, {}, {"total": 0.0},
                                           committed_at=at.isoformat()))
    return log
