"""The epoch log's head (last cut, last committed) is found in O(log N) probes, and
a hand-broken ``pipeline.json`` is named with what to do. No Spark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from volley_dagster.checkpoint.epoch_log import EpochLog, epoch_key
from volley_dagster.errors import StateLayoutError
from volley_dagster.sources.offsets import EpochRange


def fabricate(root: Path, cut: int, committed: int) -> EpochLog:
    log = EpochLog(root)
    for epoch in range(1, cut + 1):
        log.record_offsets(EpochRange(epoch, {}, {}))
        if epoch <= committed:
            (log.epoch_dir(epoch) / "manifest.json").write_text("{}")
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
    ('{"pipeline": "payments", "key_column": "k", "aggregate": {}, "layout": {"num_shards": 4}}', "lacks ['layout.num_shards'"),
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
