"""Consistency checks between the epoch log, the state snapshots and the sinks'
own histories. Dagster exposes them as asset checks; they need no Spark."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from volley_dagster.errors import SnapshotError
from volley_dagster.runner import EpochRunner
from volley_dagster.sinks.base import Sink
from volley_dagster.sources.offsets import Backlog
from volley_dagster.state.digests import FileDigest
from volley_dagster.state.store import verify_snapshot


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


ROW_COUNT_WINDOW = 32  # the last committed epochs ``check_sink`` compares by default


def check_sink(runner: EpochRunner, sink: Sink, epochs: range | None = None) -> list[CheckOutcome]:
    """The sink holds this lineage's last committed epoch, and each epoch of ``epochs``
    (default: the last ``ROW_COUNT_WINDOW`` committed) once, with the manifest's row
    count. Only those epochs' manifests and the sink's history back to them are read,
    so a check costs the same at any age of the pipeline. Epochs before the sink's own
    retained history (Delta log cleanup, Iceberg snapshot expiry) are not compared;
    the metadata says where that history begins (``history_truncated``)."""
    pipeline = runner.pipeline.name
    committed = runner.committed_epoch()
    mark = sink.committed_mark(pipeline)
    held: int | None = None
    whose = ""
    lineage = runner.log.lineage() if committed else None
    if lineage is not None and mark is not None:
        if lineage.owns(mark):
            held = lineage.epoch_of(mark)
        else:
            whose = f" (it holds {mark.describe()}, not this lineage's)"
    outcomes = [
        CheckOutcome(
            "recorded_epoch",
            held == committed or (committed == 0 and mark is None),
            f"sink {sink.name!r} records epoch {held} of this lineage{whose}; the last committed epoch is {committed}",
            {"sink_epoch": held if held is not None else 0, "committed_epoch": committed},
        )
    ]
    window = epochs if epochs is not None else range(max(1, committed - ROW_COUNT_WINDOW + 1), committed + 1)
    window = range(max(1, window.start), min(window.stop, committed + 1))
    history: dict[int, list[int]] = {}
    first_held: int | None = None
    complete = True
    if lineage is not None and window:
        binding = runner.log.sink_binding(sink.name)
        if binding is not None:  # this lineage's epochs before it met the sink's choice are not in it
            window = range(max(window.start, binding.first_epoch), window.stop)
        offset = binding.offset if binding is not None else 0
        retained = sink.history_from(pipeline, window.start + offset)
        complete = retained.complete
        for commit in retained.commits:
            if lineage.owns(commit.mark) and (epoch := lineage.epoch_of(commit.mark)) in window:
                history.setdefault(epoch, []).append(commit.rows)
        first_held = min(history, default=None)
    duplicated = sorted(e for e, commits in history.items() if len(commits) > 1)
    outcomes.append(
        CheckOutcome(
            "no_duplicate_epochs",
            not duplicated,
            f"epochs committed more than once: {duplicated}" if duplicated
            else f"{len(history)} epochs of {_span(window)}, each once",
            {"duplicated_epochs": len(duplicated)},
        )
    )
    # without its older history, the sink's record of the window begins at its oldest commit held
    checked = window if complete else range(first_held if first_held is not None else window.stop, window.stop)
    mismatched: list[str] = []
    for epoch in checked:
        manifest = runner.log.committed_manifest(epoch)
        commits = history.get(epoch)
        if commits is None:
            mismatched.append(f"epoch {epoch}: missing")
        elif commits != [manifest.records_out]:
            mismatched.append(f"epoch {epoch}: {commits} rows, manifest says {manifest.records_out}")
    unchecked = len(window) - len(checked)
    truncation = (f"; epochs {_span(range(window.start, checked.start))} are no longer in the sink's own history "
                  "(its retention removed them) and were not compared" if unchecked else "")
    outcomes.append(
        CheckOutcome(
            "row_counts",
            not mismatched,
            ("; ".join(mismatched[:5]) if mismatched
             else f"row counts of {len(checked)} epochs ({_span(checked)}) match their manifests") + truncation,
            {"mismatched_epochs": len(mismatched), "epochs_checked": len(checked),
             "first_checked_epoch": checked.start if checked else 0, "last_checked_epoch": checked.stop - 1 if checked else 0,
             "history_truncated": not complete, "epochs_not_in_sink_history": unchecked},
        )
    )
    return outcomes


def _span(epochs: range) -> str:
    return "none" if not epochs else str(epochs.start) if len(epochs) == 1 else f"{epochs.start}..{epochs.stop - 1}"


def check_latest_snapshot(runner: EpochRunner, since: int | None = None, full: bool = False) -> CheckOutcome:
    """``check_snapshot`` of the last committed epoch."""
    return check_snapshot(runner, runner.committed_epoch(), since, full)


def check_snapshot(runner: EpochRunner, epoch: int, since: int | None = None, full: bool = False) -> CheckOutcome:
    """A committed epoch's snapshots hold every file of the manifest, of its size,
    and every file new since epoch ``since`` (default: the one before) matches its
    SHA-256. A file shared with that epoch's snapshot (the same name, size and digest,
    and the same inode when both are on this disk: RocksDB checkpoints hardlink the SSTs
    an epoch did not rewrite) was hashed when it was new, so the check costs what the
    epochs changed, not the size of the state (minutes for tens of GB). A caller whose
    run committed several epochs passes the epoch before its first. ``full`` hashes
    every file: a deep check for bit rot in files that stopped changing long ago (RocksDB's
    block checksums catch it too, when the block is read). A snapshot a blocking check
    flagged is checked ``full`` until it passes (``volley_dagster/dagster/blocking.py``)."""
    if epoch == 0:
        return CheckOutcome("snapshot_checksums", True, "no committed epoch yet")
    base = epoch - 1 if since is None else since
    log = runner.log
    previous = log.state_shards(base) if not full and 1 <= base < epoch and log.is_committed(base) else {}
    files = hashed = hashed_bytes = 0
    try:
        for shard, snap in log.state_shards(epoch).items():  # after a rescale: its rewrite
            path = log.root / snap.path
            verify_snapshot(path, snap.files)  # every file there, of its recorded size
            before = previous.get(shard)
            new = {name: meta for name, meta in snap.files.items()
                   if before is None or not _shared(path / name, meta, log.root / before.path / name, before.files.get(name))}
            verify_snapshot(path, new, full=True)
            files += len(snap.files)
            hashed += len(new)
            hashed_bytes += sum(int(meta["size"]) for meta in new.values())
    except SnapshotError as exc:
        return CheckOutcome("snapshot_checksums", False,
                            f"epoch {epoch}: {exc}; restore the epoch's snapshots from the snapshot store, or rescale "
                            "from an older epoch's", {"epoch": epoch})
    what = "every file hashed" if full or not previous else f"{hashed} new since epoch {base} hashed, the rest shared with it"
    return CheckOutcome("snapshot_checksums", True, f"epoch {epoch}: {files} files match ({what})",
                        {"epoch": epoch, "files": files, "files_hashed": hashed, "bytes_hashed": hashed_bytes,
                         "since_epoch": base if previous else 0})


def _shared(path: Path, meta: FileDigest, before_path: Path, before: FileDigest | None) -> bool:
    """Whether a snapshot file is the one the earlier snapshot recorded: the same size
    and digest in both manifests, and the same inode while the earlier one is on disk
    (a copy, as a restore from S3 makes, is hashed)."""
    if before is None or (before["size"], before["sha256"]) != (meta["size"], meta["sha256"]):
        return False
    try:
        earlier = before_path.stat()
    except FileNotFoundError:
        return True  # retention removed the earlier snapshot: the manifests say the same file
    now = path.stat()
    return (earlier.st_dev, earlier.st_ino) == (now.st_dev, now.st_ino)


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
