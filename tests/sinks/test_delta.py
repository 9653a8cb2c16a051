"""DeltaSink on the local filesystem and on a real S3 server (SeaweedFS): epochs
land once, the table's own txn action says which, and racing writers of one
epoch leave exactly one copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from tests.sinks.commit_worker import epoch_output, race
from tests.sinks.helpers import PIPELINE, ROWS, ctx, frame, reference
from volley_dagster.errors import ConfigError, SinkCommitError, is_retryable
from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.sinks.base import CommitContext, SinkCommitResult, SinkPosition
from volley_dagster.sinks.delta import DeltaSink


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """DeltaSink keyword arguments naming a fresh table on local disk or on S3."""
    if request.param == "local":
        return {"uri": str(tmp_path / "table")}
    s3: S3Endpoint = request.getfixturevalue("s3")
    return {"uri": request.getfixturevalue("s3_prefix") + "/table", "s3": s3}




def delta_table(location: dict[str, Any]) -> DeltaTable:
    s3 = location.get("s3")
    return DeltaTable(location["uri"], storage_options=s3.delta_storage_options() if s3 else None)


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_epochs_equal_reference(location: dict[str, Any], mode: str) -> None:
    sink = DeltaSink(**location, mode=mode)
    assert sink.committed_epoch(PIPELINE) is None
    for epoch in range(1, 5):
        result = sink.commit(epoch_output(epoch, ROWS), ctx(epoch))
        assert not result.skipped and result.rows == ROWS and result.mode == mode
        assert result.position.version == epoch - 1  # one Delta commit per epoch, the first creates the table
        assert sink.committed_epoch(PIPELINE) == epoch
    pd.testing.assert_frame_equal(frame(sink.read()), reference(mode, range(1, 5)), check_dtype=False)

    history = delta_table(location).history()
    tagged = sorted((int(h["volley.epoch"]), h["volley.pipeline"]) for h in history if "volley.epoch" in h)
    assert tagged == [(e, PIPELINE) for e in range(1, 5)]
    assert {h["operation"] for h in history} == ({"WRITE"} if mode == "append" else {"WRITE", "MERGE"})


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_recommitting_a_held_epoch_changes_nothing(location: dict[str, Any], mode: str) -> None:
    sink = DeltaSink(**location, mode=mode)
    for epoch in range(1, 4):
        sink.commit(epoch_output(epoch, ROWS), ctx(epoch))
    version, before = delta_table(location).version(), frame(sink.read())

    # The same epoch again, an older epoch, and an older epoch with other rows: all skipped.
    for epoch, output in [(3, epoch_output(3, ROWS)), (2, epoch_output(2, ROWS)), (1, epoch_output(9, ROWS))]:
        result = sink.commit(output, ctx(epoch))
        assert result == SinkCommitResult(skipped=True, held_epoch=3, conflicts=0, mode=mode, position=SinkPosition(version=version))

    table = delta_table(location)
    assert table.version() == version
    assert table.transaction_version(f"{PIPELINE}/delta") == 3  # never moved backwards
    pd.testing.assert_frame_equal(frame(sink.read()), before)


def test_committed_epoch_comes_from_the_table(location: dict[str, Any]) -> None:
    sink = DeltaSink(**location, mode="append")
    assert sink.committed_epoch(PIPELINE) is None  # no table yet
    for epoch in (1, 2):
        sink.commit(epoch_output(epoch, ROWS), ctx(epoch))
    sink.commit(epoch_output(1, ROWS), ctx(1, pipeline="refunds"))

    # A fresh sink object (no shared state) reads the txn actions from the log.
    fresh = DeltaSink(**location, mode="append")
    assert fresh.committed_epoch(PIPELINE) == 2
    assert fresh.committed_epoch("refunds") == 1
    assert fresh.committed_epoch("unknown") is None
    # The app id is <pipeline>/<sink name>: another sink on the same table holds nothing.
    assert DeltaSink(**location, name="mirror").committed_epoch(PIPELINE) is None
    assert delta_table(location).transaction_version(f"{PIPELINE}/delta") == 2


def test_txn_action_is_in_the_delta_log(tmp_path: Path) -> None:
    """The commit file carries the same ``txn`` action Spark writes for
    ``txnAppId``/``txnVersion``, plus commitInfo naming pipeline and epoch."""
    sink = DeltaSink(tmp_path / "t", mode="upsert")
    sink.commit(epoch_output(1, ROWS), ctx(1))
    sink.commit(epoch_output(2, ROWS), ctx(2))
    actions = [json.loads(line) for line in (tmp_path / "t" / "_delta_log" / f"{1:020d}.json").read_text().splitlines()]
    txns = [a["txn"] for a in actions if "txn" in a]
    assert [(t["appId"], t["version"]) for t in txns] == [(f"{PIPELINE}/delta", 2)]
    info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
    assert (info["volley.pipeline"], info["volley.epoch"], info["operation"]) == (PIPELINE, "2", "MERGE")


def test_upsert_by_several_key_columns(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "t", mode="upsert", key_columns=["region", "merchant_id"])
    first = pa.table({"region": ["eu", "eu", "us", "us"], "merchant_id": [1, 2, 1, 2], "total": [1.0, 2.0, 3.0, 4.0]})
    second = pa.table({"region": ["eu", "us", "ap"], "merchant_id": [1, 2, 1], "total": [10.0, 40.0, 5.0]})
    sink.commit(first, ctx(1))
    result = sink.commit(second, ctx(2))
    assert (result.counts["inserted"], result.counts["updated"]) == (1, 2)
    got = sink.read().to_pandas().sort_values(["region", "merchant_id"]).reset_index(drop=True)
    assert got.to_dict("list") == {"region": ["ap", "eu", "eu", "us", "us"], "merchant_id": [1, 1, 2, 1, 2],
                                   "total": [5.0, 10.0, 2.0, 3.0, 40.0]}


class _InterleavedSink(DeltaSink):
    """Lets a second, real writer commit the same epoch right after this one has
    checked the table and before it commits: a deterministic race."""

    def __init__(self, rival: DeltaSink, rival_ctx: CommitContext, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rival: DeltaSink | None = rival
        self.rival_ctx = rival_ctx

    def _write_rows(self, table: Any, output: pa.Table, keys: Any, props: Any, replace: bool,
                    expired: pa.Table) -> dict[str, Any]:
        if self.rival is not None:
            rival, self.rival = self.rival, None
            assert rival.commit(output, self.rival_ctx).skipped is False
        return super()._write_rows(table, output, keys, props, replace, expired)


@pytest.mark.parametrize("mode", ["append", "upsert"])
@pytest.mark.parametrize("existing", [False, True], ids=["new-table", "existing-table"])
def test_losing_a_race_skips(location: dict[str, Any], mode: str, existing: bool) -> None:
    if existing:
        DeltaSink(**location, mode=mode).commit(epoch_output(1, ROWS), ctx(1))
    epoch = 2 if existing else 1
    sink = _InterleavedSink(DeltaSink(**location, mode=mode), ctx(epoch), **location, mode=mode)
    result = sink.commit(epoch_output(epoch, ROWS), ctx(epoch))
    assert result.skipped and result.held_epoch == epoch and result.conflicts == 1
    assert delta_table(location).version() == epoch - 1  # the rival's commit only
    pd.testing.assert_frame_equal(frame(sink.read()), reference(mode, range(1, epoch + 1)), check_dtype=False)


@pytest.mark.parametrize(("location", "mode"), [("local", "append"), ("s3", "upsert")], indirect=["location"])
def test_two_processes_commit_each_epoch_once(location: dict[str, Any], mode: str, tmp_path: Path) -> None:
    """Epoch 1 races the table's creation too; epochs 2 and 3 race on an existing table."""
    kwargs = {"uri": location["uri"], "mode": mode}
    if "s3" in location:
        kwargs["storage_options"] = location["s3"].delta_storage_options()
    epochs = [1, 2, 3]
    results = race("delta", kwargs, PIPELINE, epochs, ROWS, tmp_path / "sync")

    for epoch in epochs:
        landed = [r for r in results if r["epoch"] == epoch and not r["skipped"]]
        assert len(landed) == 1, f"epoch {epoch}: {results}"
    sink = DeltaSink(**location, mode=mode)
    assert sink.committed_epoch(PIPELINE) == 3
    assert delta_table(location).version() == 2  # three commits in all
    pd.testing.assert_frame_equal(frame(sink.read()), reference(mode, range(1, 4)), check_dtype=False)


def test_a_commit_the_table_refuses_is_a_sink_commit_error_naming_sink_table_and_epoch(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path / "delta", name="balances")
    sink.commit(epoch_output(1, ROWS), ctx(1))
    wrong = pa.table({"merchant_id": pa.array(["not", "a", "number"])})  # the table's schema differs
    with pytest.raises(SinkCommitError, match=rf"sink 'balances' \(delta {tmp_path}/delta\): epoch 2 did not commit: ") as err:
        sink.commit(wrong, ctx(2))
    assert err.value.__cause__ is not None and "volley" not in type(err.value.__cause__).__module__
    assert sink.committed_epoch(PIPELINE) == 1 and is_retryable(err.value)


def test_an_epoch_column_holds_the_epoch_that_last_wrote_each_row(tmp_path: Path) -> None:
    sink = DeltaSink(str(tmp_path / "table"), mode="upsert", epoch_column="written_in")
    outputs = {epoch: epoch_output(epoch, ROWS) for epoch in (1, 2)}
    for epoch, output in outputs.items():
        sink.commit(output, ctx(epoch))
    rows = sink.read().to_pandas().set_index("merchant_id")["written_in"]
    last_written = {k: epoch for epoch, out in outputs.items() for k in out.column("merchant_id").to_pylist()}
    assert rows.to_dict() == {k: f"{e:010d}" for k, e in last_written.items()}  # the Dagster partition key
    assert sink.location().epoch_column == "written_in"
    clash = DeltaSink(str(tmp_path / "other"), epoch_column="total")
    with pytest.raises(ConfigError, match="epoch_column 'total' is already an output column"):
        clash.commit(epoch_output(1, ROWS), ctx(1))
