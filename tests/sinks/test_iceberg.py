"""IcebergSink on SqlCatalogs backed by SQLite and by a real PostgreSQL, with the
warehouse on local disk and on a real S3 server (SeaweedFS): one catalog commit
per epoch, the epoch recorded in the table's own properties, re-commits and
racing writers change nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from pyiceberg.catalog import load_catalog
from pyiceberg.table import Table

from tests.sinks.commit_worker import epoch_output, race
from tests.sinks.helpers import PIPELINE, ROWS, ctx, frame, reference
from volley_dagster.sinks.base import CommitContext, SinkCommitResult, SinkPosition
from volley_dagster.sinks.iceberg import IcebergSink, sqlite_catalog

TABLE = "volley.payments"
ALL = ["sqlite-local", "sqlite-s3", "postgres-local", "postgres-s3"]




def load(catalog: dict[str, str], name: str = TABLE) -> Table:
    """The table through a catalog of our own, not the sink's."""
    return load_catalog("volley", **catalog).load_table(name)


def epochs_of(table: Table) -> list[tuple[str | None, str | None]]:
    return [(s.summary.additional_properties.get("volley.pipeline") if s.summary else None,
             s.summary.additional_properties.get("volley.epoch") if s.summary else None)
            for s in table.snapshots()]


@pytest.mark.parametrize("iceberg_catalog", ALL, indirect=True)
@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_epochs_equal_reference(iceberg_catalog: dict[str, str], mode: str) -> None:
    sink = IcebergSink(TABLE, iceberg_catalog, mode=mode)
    assert sink.committed_epoch(PIPELINE) is None
    metadata_files = []
    for epoch in range(1, 5):
        result = sink.commit(epoch_output(epoch, ROWS), ctx(epoch))
        assert not result.skipped and result.rows == ROWS and result.conflicts == 0
        assert sink.committed_epoch(PIPELINE) == epoch
        metadata_files.append(load(iceberg_catalog).metadata_location)
    pd.testing.assert_frame_equal(frame(sink.read()), reference(mode, range(1, 5)), check_dtype=False)

    table = load(iceberg_catalog)
    assert table.properties["volley.payments.iceberg.epoch"] == "4"
    # the sink's properties are its marks: pyiceberg's retries are off in its own transactions only
    assert {k for k in table.properties if not k.startswith("volley.")} == set()
    # Every snapshot names the pipeline and epoch that made it; one catalog commit
    # (one new metadata file) per epoch.
    tags = epochs_of(table)
    assert {p for p, _ in tags} == {PIPELINE}
    assert sorted({int(e) for _, e in tags if e}) == [1, 2, 3, 4]
    assert len(set(metadata_files)) == 4
    assert table.current_snapshot().summary.additional_properties["volley.epoch"] == "4"


@pytest.mark.parametrize("iceberg_catalog", ["sqlite-local", "postgres-s3"], indirect=True)
@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_recommitting_a_held_epoch_changes_nothing(iceberg_catalog: dict[str, str], mode: str) -> None:
    sink = IcebergSink(TABLE, iceberg_catalog, mode=mode)
    for epoch in range(1, 4):
        sink.commit(epoch_output(epoch, ROWS), ctx(epoch))
    table = load(iceberg_catalog)
    location, snapshots, before = table.metadata_location, len(table.snapshots()), frame(sink.read())
    current = table.current_snapshot().snapshot_id

    for epoch, output in [(3, epoch_output(3, ROWS)), (2, epoch_output(2, ROWS)), (1, epoch_output(9, ROWS))]:
        result = sink.commit(output, ctx(epoch))
        assert result == SinkCommitResult(skipped=True, held_epoch=3, conflicts=0, mode=mode,
                                         position=SinkPosition(snapshot_id=current))

    table = load(iceberg_catalog)
    assert (table.metadata_location, len(table.snapshots())) == (location, snapshots)
    assert table.properties["volley.payments.iceberg.epoch"] == "3"
    pd.testing.assert_frame_equal(frame(sink.read()), before)


@pytest.mark.parametrize("iceberg_catalog", ALL, indirect=True)
def test_committed_epoch_comes_from_the_table(iceberg_catalog: dict[str, str]) -> None:
    sink = IcebergSink(TABLE, iceberg_catalog)
    assert sink.committed_epoch(PIPELINE) is None  # no namespace, no table yet
    for epoch in (1, 2, 3):
        sink.commit(epoch_output(epoch, ROWS), ctx(epoch))
    # Another pipeline commits after: the current snapshot is no longer ours.
    sink.commit(epoch_output(1, ROWS), ctx(1, pipeline="refunds"))

    # Expire every snapshot but the current one: the epoch lives in table properties.
    table = load(iceberg_catalog)
    current = table.current_snapshot().snapshot_id
    table.maintenance.expire_snapshots().by_ids(
        [s.snapshot_id for s in table.snapshots() if s.snapshot_id != current]).commit()
    table = load(iceberg_catalog)
    assert [s.snapshot_id for s in table.snapshots()] == [current]
    assert epochs_of(table) == [("refunds", "1")]

    fresh = IcebergSink(TABLE, iceberg_catalog)  # its own catalog connection
    assert fresh.committed_epoch(PIPELINE) == 3
    assert fresh.committed_epoch("refunds") == 1
    assert fresh.committed_epoch("unknown") is None
    assert fresh.commit(epoch_output(3, ROWS), ctx(3)).skipped is True
    assert fresh.read().num_rows == 4 * ROWS


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_a_table_made_elsewhere_keeps_its_properties_and_a_lost_race_still_lands_once(tmp_path: Path, mode: str) -> None:
    """The owner's table keeps pyiceberg's rebasing retries for its other writers (here
    7 of them); the sink never changes that property, and its own commit, losing a
    race, is not rebased onto the winner: the epoch lands once."""
    catalog = sqlite_catalog(tmp_path)
    cat = load_catalog("volley", **catalog)
    cat.create_namespace("volley")
    owned = {"commit.retry.num-retries": "7", "owner": "team-a"}
    cat.create_table(TABLE, schema=epoch_output(1, ROWS).schema, properties=owned)
    rival = IcebergSink(TABLE, catalog, mode=mode)
    sink = _InterleavedSink(rival, ctx(1), TABLE, catalog, mode=mode)
    result = sink.commit(epoch_output(1, ROWS), ctx(1))
    assert result.skipped and result.held_epoch == 1 and result.conflicts == 1
    assert sink.commit(epoch_output(2, ROWS), ctx(2)).skipped is False
    table = load(catalog)
    assert {k: v for k, v in table.properties.items() if not k.startswith("volley.")} == owned
    assert table.properties["volley.payments.iceberg.epoch"] == "2"
    assert sorted({int(e) for _, e in epochs_of(table) if e}) == [1, 2]
    pd.testing.assert_frame_equal(frame(sink.read()), reference(mode, range(1, 3)), check_dtype=False)


def test_upsert_by_several_key_columns(tmp_path: Path) -> None:
    """Key ranges over-select (eu..us × 1..2 also holds eu/2 and us/1): the rows
    the range catches but the epoch does not replace are written back."""
    sink = IcebergSink(TABLE, path=tmp_path, mode="upsert", key_columns=["region", "merchant_id"])
    first = pa.table({"region": ["eu", "eu", "us", "us"], "merchant_id": [1, 2, 1, 2], "total": [1.0, 2.0, 3.0, 4.0]})
    second = pa.table({"region": ["eu", "us", "ap"], "merchant_id": [1, 2, 1], "total": [10.0, 40.0, 5.0]})
    sink.commit(first, ctx(1))
    sink.commit(second, ctx(2))
    got = sink.read().to_pandas().sort_values(["region", "merchant_id"]).reset_index(drop=True)
    assert got.to_dict("list") == {"region": ["ap", "eu", "eu", "us", "us"], "merchant_id": [1, 1, 2, 1, 2],
                                   "total": [5.0, 10.0, 2.0, 3.0, 40.0]}


class _InterleavedSink(IcebergSink):
    """Lets a second, real writer commit the same epoch after this one has
    checked the table and started its transaction: a deterministic race."""

    def __init__(self, rival: IcebergSink, rival_ctx: CommitContext, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rival: IcebergSink | None = rival
        self.rival_ctx = rival_ctx

    def _stage(self, txn: Any, table: Any, output: pa.Table, keys: Any, summary: Any, replace: bool,
               expired: pa.Table) -> dict[str, Any]:
        if self.rival is not None:
            rival, self.rival = self.rival, None
            assert rival.commit(output, self.rival_ctx).skipped is False
        return super()._stage(txn, table, output, keys, summary, replace, expired)


@pytest.mark.parametrize("iceberg_catalog", ["sqlite-local", "postgres-local"], indirect=True)
@pytest.mark.parametrize("mode", ["append", "upsert"])
@pytest.mark.parametrize("existing", [False, True], ids=["new-table", "existing-table"])
def test_losing_a_race_skips(iceberg_catalog: dict[str, str], mode: str, existing: bool) -> None:
    if existing:
        IcebergSink(TABLE, iceberg_catalog, mode=mode).commit(epoch_output(1, ROWS), ctx(1))
    epoch = 2 if existing else 1
    rival = IcebergSink(TABLE, iceberg_catalog, mode=mode)
    sink = _InterleavedSink(rival, ctx(epoch), TABLE, iceberg_catalog, mode=mode)
    result = sink.commit(epoch_output(epoch, ROWS), ctx(epoch))
    assert result.skipped and result.held_epoch == epoch and result.conflicts == 1
    table = load(iceberg_catalog)
    assert sorted({int(e) for _, e in epochs_of(table) if e}) == list(range(1, epoch + 1))
    pd.testing.assert_frame_equal(frame(sink.read()), reference(mode, range(1, epoch + 1)), check_dtype=False)


@pytest.mark.parametrize(("iceberg_catalog", "mode"), [("sqlite-local", "append"), ("postgres-s3", "upsert")],
                         indirect=["iceberg_catalog"])
def test_two_processes_commit_each_epoch_once(iceberg_catalog: dict[str, str], mode: str, tmp_path: Path) -> None:
    """Epoch 1 races the table's creation too; epoch 2 races on an existing table."""
    load_catalog("volley", **iceberg_catalog)  # the catalog's own tables; the sink table is raced
    epochs = [1, 2]
    results = race("iceberg", {"table": TABLE, "catalog": iceberg_catalog, "mode": mode}, PIPELINE, epochs, ROWS,
                   tmp_path / "sync")

    for epoch in epochs:
        landed = [r for r in results if r["epoch"] == epoch and not r["skipped"]]
        assert len(landed) == 1, f"epoch {epoch}: {results}"
    sink = IcebergSink(TABLE, iceberg_catalog, mode=mode)
    assert sink.committed_epoch(PIPELINE) == 2
    assert sorted({int(e) for _, e in epochs_of(load(iceberg_catalog)) if e}) == epochs
    pd.testing.assert_frame_equal(frame(sink.read()), reference(mode, range(1, 3)), check_dtype=False)
