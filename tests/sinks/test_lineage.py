"""The commit decision of ``sinks/lineage.py`` on the marks a sink can hold."""

from __future__ import annotations

import pytest

from volley_dagster.checkpoint.epoch_log import EpochLog
from volley_dagster.errors import ConfigError, SinkLineageError
from volley_dagster.io.atomic import read_json, write_json_atomic
from volley_dagster.sinks import MemorySink
from volley_dagster.sinks.lineage import Lineage, SinkBinding, SinkMark, decide

OURS = Lineage("ours", unlabelled_through=2)


def want(epoch: int, digest: str = "d") -> SinkMark:
    return SinkMark(epoch, "ours", epoch, digest)


def test_own_marks_commit_the_next_epoch_and_skip_what_they_hold() -> None:
    assert decide("s", None, want(1), OURS, None)
    assert decide("s", SinkMark(4, "ours", 4, "x"), want(5), OURS, None)
    assert not decide("s", SinkMark(5, "ours", 5, "d"), want(5), OURS, None)
    assert not decide("s", SinkMark(7, "ours", 7, "x"), want(5), OURS, None)
    # marks written before lineages: this root's up to where it adopted its lineage
    assert decide("s", SinkMark(2), want(3), OURS, None)
    with pytest.raises(SinkLineageError, match="unrecorded lineage"):
        decide("s", SinkMark(3), want(4), OURS, None)


def test_a_missing_epoch_or_another_range_is_refused() -> None:
    with pytest.raises(SinkLineageError, match=r"epochs 5\.\.6 are missing"):
        decide("s", SinkMark(4, "ours", 4, "x"), want(7), OURS, None)
    with pytest.raises(SinkLineageError, match="over another source range"):
        decide("s", SinkMark(5, "ours", 5, "other"), want(5), OURS, None)


def test_a_binding_lets_the_first_epoch_follow_the_foreign_one_only() -> None:
    foreign = SinkMark(9, "theirs", 9, "t")
    binding = SinkBinding("s", "continue", foreign, first_epoch=1)
    with pytest.raises(SinkLineageError, match="lineage theirs"):
        decide("s", foreign, want(1), OURS, None)
    assert decide("s", foreign, SinkMark(1 + binding.offset, "ours", 1, "d"), OURS, binding)
    with pytest.raises(SinkLineageError):  # a third lineage wrote since
        decide("s", SinkMark(10, "third", 1, "z"), SinkMark(2 + binding.offset, "ours", 2, "d"), OURS, binding)


def test_a_root_from_before_lineages_adopts_one_that_owns_its_committed_epochs(tmp_path) -> None:
    log = EpochLog(tmp_path)
    log.check_identity({"pipeline": "p", "layout": {"num_shards": 1}})
    assert len(log.lineage().id) == 32 and log.lineage() == log.lineage()  # written once
    legacy = {k: v for k, v in read_json(tmp_path / "pipeline.json").items() if k != "lineage"}
    write_json_atomic(tmp_path / "pipeline.json", legacy)
    adopted = log.lineage()
    assert adopted.unlabelled_through == 0 and adopted == log.lineage() == EpochLog(tmp_path).lineage()
    assert (tmp_path / "lineage.json").exists() and "lineage" not in read_json(tmp_path / "pipeline.json")
    log.check_identity({"pipeline": "p", "layout": {"num_shards": 1}})  # the lineage is not part of the layout


def test_an_unknown_choice_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="on_foreign_lineage must be one of"):
        MemorySink(on_foreign_lineage="overwrite")  # type: ignore[arg-type]
