"""Consistency checks between the epoch log, the state snapshots and the sinks'
own histories. Dagster exposes them as asset checks; they need no Spark."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from volley_dagster.errors import SnapshotError
from volley_dagster.runner import EpochRunner
from volley_dagster.sinks.base import Sink
from volley_dagster.sources.offsets import Backlog
from volley_dagster.state.store import verify_snapshot


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


def check_sink(runner: EpochRunner, sink: Sink) -> list[CheckOutcome]:
    """The sink holds this lineage's last committed epoch, each epoch once, with the
    manifest's row count."""
    pipeline = runner.pipeline.name
    committed = runner.committed_epoch()
    mark = sink.committed_mark(pipeline)
    held: int | None = None
    whose, history = "", {}
    if committed:
        lineage = runner.log.lineage()
        if mark is not None and lineage.owns(mark):
            held = lineage.epoch_of(mark)
        elif mark is not None:
            whose = f" (it holds {mark.describe()}, not this lineage's)"
        history = sink.epoch_history(pipeline, lineage)
    outcomes = [
        CheckOutcome(
            "recorded_epoch",
            held == committed or (committed == 0 and mark is None),
            f"sink {sink.name!r} records epoch {held} of this lineage{whose}; the last committed epoch is {committed}",
            {"sink_epoch": held if held is not None else 0, "committed_epoch": committed},
        )
    ]
    duplicated = sorted(e for e, commits in history.items() if len(commits) > 1)
    outcomes.append(
        CheckOutcome(
            "no_duplicate_epochs",
            not duplicated,
            f"epochs committed more than once: {duplicated}" if duplicated else f"{len(history)} epochs, each once",
            {"duplicated_epochs": len(duplicated)},
        )
    )
    mismatched: list[str] = []
    for epoch in range(1, committed + 1):
        manifest = runner.log.committed_manifest(epoch)
        commits = history.get(epoch)
        if commits is None:
            mismatched.append(f"epoch {epoch}: missing")
        elif commits != [manifest.records_out]:
            mismatched.append(f"epoch {epoch}: {commits} rows, manifest says {manifest.records_out}")
    outcomes.append(
        CheckOutcome(
            "row_counts",
            not mismatched,
            "; ".join(mismatched[:5]) if mismatched else f"row counts of {committed} epochs match their manifests",
            {"mismatched_epochs": len(mismatched)},
        )
    )
    return outcomes


def check_latest_snapshot(runner: EpochRunner) -> CheckOutcome:
    """Every file of the last committed epoch's snapshots matches its SHA-256 in the manifest."""
    epoch = runner.committed_epoch()
    if epoch == 0:
        return CheckOutcome("snapshot_checksums", True, "no committed epoch yet")
    files = 0
    try:
        for snap in runner.log.state_shards(epoch).values():  # after a rescale: its rewrite
            verify_snapshot(runner.log.root / snap.path, snap.files, full=True)
            files += len(snap.files)
    except SnapshotError as exc:
        return CheckOutcome("snapshot_checksums", False, str(exc), {"epoch": epoch})
    return CheckOutcome("snapshot_checksums", True, f"epoch {epoch}: {files} files match", {"epoch": epoch, "files": files})


def freshness_lag_s(runner: EpochRunner, now: float, backlog: Backlog | None = None) -> float:
    """How long the oldest record not yet committed has waited: in the source (its file's
    age) or in a cut epoch that has not committed (since it was cut). 0 when all is committed.
    ``backlog``: the source's, when the caller has just listed it."""
    lag = (backlog or runner.backlog()).oldest_age_s(now)
    committed, cut = runner.committed_epoch(), runner.log.last_cut()
    if cut > committed:
        lag = max(lag, now - runner.log.cut_at(committed + 1))
    return lag


def check_freshness(runner: EpochRunner, bound_s: float, now: float, backlog: Backlog | None = None) -> CheckOutcome:
    """Fails when records have waited longer than ``bound_s`` to be committed."""
    lag = freshness_lag_s(runner, now, backlog)
    fresh = lag <= bound_s
    verdict = "within" if fresh else "over"
    return CheckOutcome(
        "freshness", fresh,
        f"the oldest uncommitted record has waited {lag:.0f}s, {verdict} the {bound_s:.0f}s bound"
        + ("" if fresh else "; see the epochs_progress check and the last runs of the pipeline"),
        {"lag_s": round(lag, 3), "bound_s": bound_s},
    )
