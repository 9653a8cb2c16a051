"""The epoch log's head (last cut, last committed) is found in O(log N) probes; old
epochs' folders are compacted into archives that answer for them as the folders did,
a kill -9 mid-compaction included; a hand-broken ``pipeline.json`` is named with what
to do. No Spark."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from volley_dagster.checkpoint.epoch_log import EpochLog, epoch_key
from volley_dagster.dimensions.base import TablePin
from volley_dagster.errors import EpochNotCutError, StateLayoutError
from volley_dagster.result import EpochResult
from volley_dagster.sources.offsets import EpochRange, Offset

ROOT = Path(__file__).resolve().parents[2]


def manifest(epoch: int) -> EpochResult:
    return EpochResult("payments", epoch, {"0": f"{epoch - 1} -> {epoch}"}, epoch, epoch, 0, epoch, 1, 0, 0, 0, {}, {},
                       {}, committed_at=f"2026-11-25T00:00:{epoch % 60:02d}+00:00")


def fabricate(root: Path, cut: int, committed: int, span: int = 10_000) -> EpochLog:
    log = EpochLog(root, archive_span=span)
    for epoch in range(1, cut + 1):
        log.record_offsets(EpochRange(epoch, {"p": Offset(epoch - 1)}, {"p": Offset(epoch)}))
        if epoch <= committed:
            assert log.write_manifest(manifest(epoch))
    return log


@pytest.mark.parametrize(("cut", "committed"), [(0, 0), (1, 0), (1, 1), (2, 1), (7, 7), (64, 63), (1000, 517)])
def test_the_head_equals_a_full_listing(tmp_path: Path, cut: int, committed: int) -> None:
    log = fabricate(tmp_path / "root", cut, committed)
    assert log.last_cut() == cut == (log.epochs_cut()[-1] if cut else 0)
    assert log.last_committed() == committed


def test_the_head_probes_log_n_files_not_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = fabricate(tmp_path / "root", 3000, 2999)
    probes: list[str] = []
    exists = Path.exists

    def counted(self: Path) -> bool:
        probes.append(self.name)
        return exists(self)

    def no_listing(self: Path):
        raise AssertionError(f"listed {self}")

    monkeypatch.setattr(Path, "exists", counted)  # a spy on the real call
    monkeypatch.setattr(Path, "iterdir", no_listing)
    assert log.last_cut() == 3000 and log.last_committed() == 2999
    assert len(probes) <= 2 * 2 * 13  # two heads, about 2 log2(3000) probes each


@pytest.mark.parametrize("text, named", [
    ('{"pipeline": "payments", "key_column"', "is not valid JSON"),
    ('{"pipeline": "payments", "key_column": "k", "aggregate": {}}', "lacks ['layout']"),
    ('{"pipeline": "payments", "key_column": "k", "aggregate": {}, "layout": {"shards": 4}}', "lacks ['layout.num_shards']"),
    ("[]", "lacks ['pipeline'"),
])
def test_a_hand_broken_pipeline_json_is_named_with_what_to_do(tmp_path: Path, text: str, named: str) -> None:
    log = EpochLog(tmp_path / "root")
    log.root.mkdir(parents=True)
    (log.root / "pipeline.json").write_text(text)
    with pytest.raises(StateLayoutError, match=r"pipeline\.json .*restore it from a copy of the checkpoint root") as err:
        log.identity()
    assert named in str(err.value)
    assert epoch_key(1) not in json.dumps(str(err.value))  # nothing about epochs: the root itself is broken


def test_old_epochs_are_compacted_into_archives_that_answer_as_the_folders_did(tmp_path: Path) -> None:
    log = fabricate(tmp_path / "root", 47, 46, span=10)
    pin = TablePin("merchants", "delta", "7")
    log.record_dimension_pin(12, pin)
    before = {e: (log.offsets(e), log.manifest(e), log.cut_at(e)) for e in range(1, 48)}
    log.prune(46, 3)  # epochs up to 43 are past retention: two blocks a prune
    assert sorted(p.name for p in (log.root / "epochs" / "archive").iterdir()) == [
        "0000000001-0000000010.zip", "0000000011-0000000020.zip"]
    log.prune(46, 3)
    assert log.archives.through() == 40  # 41..43 do not fill a block: they wait
    assert not any((log.root / "epochs" / epoch_key(e)).exists() for e in range(1, 41))
    fresh = EpochLog(log.root, archive_span=10)
    assert {e: (fresh.offsets(e), fresh.manifest(e), fresh.cut_at(e)) for e in range(1, 48)} == before
    assert fresh.dimension_pin(12, "merchants") == pin and fresh.dimension_pin(13, "merchants") is None
    assert fresh.last_cut() == 47 and fresh.last_committed() == 46 and fresh.epochs_cut() == list(range(1, 48))
    assert all(fresh.is_committed(e) for e in range(1, 47)) and not fresh.is_committed(47)
    with pytest.raises(EpochNotCutError, match="epoch 48 has no recorded offset range"):
        fresh.offsets(48)
    assert len(list((log.root / "epochs").iterdir())) == 1 + 7  # the archive folder and epochs 41..47


def test_a_kill_9_mid_compaction_leaves_both_and_the_next_prune_finishes(tmp_path: Path) -> None:
    log = fabricate(tmp_path / "root", 15, 15, span=10)
    before = {e: log.manifest(e) for e in range(1, 16)}
    script = ("import sys; from volley_dagster.checkpoint.epoch_log import EpochLog; "
              "EpochLog(sys.argv[1], archive_span=10).prune(15, 3)")
    killed = subprocess.run([sys.executable, "-c", script, str(log.root)], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "VOLLEY_KILL_AT": "during_compaction"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (log.root / "epochs" / "archive" / "0000000001-0000000010.zip").exists()
    assert all((log.root / "epochs" / epoch_key(e)).exists() for e in range(1, 11))  # both, alike
    assert {e: EpochLog(log.root, archive_span=10).manifest(e) for e in range(1, 16)} == before
    again = EpochLog(log.root, archive_span=10)
    again.prune(15, 3)
    assert not any((log.root / "epochs" / epoch_key(e)).exists() for e in range(1, 11))
    assert {e: again.manifest(e) for e in range(1, 16)} == before and again.last_committed() == 15
