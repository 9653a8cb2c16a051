"""Retention on the checkpoint root (``EpochLog.prune``): the side outputs (dead
letters, late records, duplicates) of an epoch go when its snapshots go, the last
``keep`` committed epochs keep theirs, and offsets and manifests stay. A prune costs
the epochs it newly expires, not the pipeline's age."""

from __future__ import annotations

from pathlib import Path

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.checkpoint.manifest import ShardEntry, ShardSnapshot
from volley_dagster.io.atomic import write_json_atomic
from volley_dagster.result import EpochResult

SIDE = ("dead_letters.parquet", "late_records.parquet", "duplicates.parquet")


def commit(log: EpochLog, epoch: int, side_outputs: bool = True) -> None:
    """An epoch as the runner leaves it on disk: offsets, the winning attempt's snapshot
    folder, its side outputs, and the manifest naming them, written last."""
    write_json_atomic(log.epoch_dir(epoch) / "offsets.json", {"epoch": epoch})
    snapshot = log.snapshots_dir(epoch) / "shard-0000-aa"
    snapshot.mkdir(parents=True)
    paths: list[str | None] = [None, None, None]
    if side_outputs:
        for i, path in enumerate(log.side_output_paths(epoch)):
            path.write_bytes(b"PAR1 records of epoch %d" % epoch)
            paths[i] = str(path.relative_to(log.root))
    shard = ShardEntry(0, ShardSnapshot(str(snapshot.relative_to(log.root)), {}, 0, "aa"), "scan")
    assert log.write_manifest(EpochResult(
        "p", epoch, {}, 1, 1, 1, 1, 1, 0, 0, 0, {0: shard}, {}, {"total": 1.0}, dead_letter_path=paths[0],
        late_records=1, late_records_path=paths[1], figures={"duplicates": 1}, duplicates_path=paths[2]))


def side_outputs(log: EpochLog) -> dict[int, list[str]]:
    return {e: sorted(p.name for p in log.side_output_paths(e) if p.exists()) for e in log.epochs_cut()
            if any(p.exists() for p in log.side_output_paths(e))}


def test_side_outputs_are_kept_as_long_as_the_snapshots_over_many_epochs(tmp_path: Path) -> None:
    log, keep = EpochLog(tmp_path / "root"), 3
    for epoch in range(1, 101):
        commit(log, epoch, side_outputs=epoch % 7 != 0)  # most epochs write some, not all
        log.prune(epoch, keep)
        retained = range(max(1, epoch - keep + 1), epoch + 1)
        assert log.retained_snapshots() == list(retained)
        assert side_outputs(log) == {e: sorted(SIDE) for e in retained if e % 7 != 0}, f"after epoch {epoch}"
        assert log.side_outputs_pruned_through() == max(0, epoch - keep)
    # the history stays: every epoch's offsets and manifest
    assert log.epochs_cut() == list(range(1, 101)) and all(log.is_committed(e) for e in range(1, 101))
    assert sorted(p.name for p in log.epoch_dir(1).iterdir()) == ["manifest.json", "offsets.json"]


def test_a_root_from_before_side_outputs_were_pruned_is_swept_once(tmp_path: Path) -> None:
    log = EpochLog(tmp_path / "root")
    for epoch in range(1, 201):
        commit(log, epoch)
    log.prune(200, 5)  # the old retention left every side output; the first prune removes them
    assert sorted(side_outputs(log)) == list(range(196, 201))
    assert log.side_outputs_pruned_through() == 195
    # later prunes start from the mark: a file put back below it is not looked for again
    log.dead_letter_path(10).write_bytes(b"restored by hand")
    commit(log, 201)
    log.prune(201, 5)
    assert sorted(side_outputs(log)) == [10, *range(197, 202)]


def test_a_prune_interrupted_before_its_mark_redoes_the_same_deletions(tmp_path: Path) -> None:
    log = EpochLog(tmp_path / "root")
    for epoch in range(1, 11):
        commit(log, epoch)
    for path in log.side_output_paths(3):  # a crash after epoch 3's files went, before the mark
        path.unlink()
    assert log.side_outputs_pruned_through() == 0
    log.prune(10, 2)
    assert sorted(side_outputs(log)) == [9, 10] and log.side_outputs_pruned_through() == 8


def test_raising_keep_later_never_brings_back_or_deletes_twice(tmp_path: Path) -> None:
    log = EpochLog(tmp_path / "root")
    for epoch in range(1, 21):
        commit(log, epoch)
        log.prune(epoch, 2)
    assert log.side_outputs_pruned_through() == 18
    commit(log, 21)
    log.prune(21, 10)  # keep raised: nothing newly expires, the mark stays
    assert sorted(side_outputs(log)) == [19, 20, 21] and log.side_outputs_pruned_through() == 18
