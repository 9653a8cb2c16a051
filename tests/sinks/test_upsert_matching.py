"""What an upsert matches and what it keeps, the same at Delta and Iceberg: a column
another writer added keeps its values (in the rows the epoch does not touch, and in
the rows it updates, as Delta's ``when_matched_update_all`` keeps them); a key with a
null component matches the same key (nulls equal, as deduplication compares them),
so writing it again replaces its row instead of adding one."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from deltalake import Field as DeltaField
from pyiceberg.catalog import load_catalog
from pyiceberg.types import StringType

from tests.sinks.helpers import PIPELINE, ctx
from volley_dagster.sinks.delta import DeltaSink
from volley_dagster.sinks.iceberg import IcebergSink, sqlite_catalog
from volley_dagster.sinks.table import TableSink

TABLE = "volley.upserts"


def make(kind: str, tmp_path: Path, key_columns: list[str] | None = None) -> TableSink:
    if kind == "delta":
        return DeltaSink(tmp_path / "delta", mode="upsert", key_columns=key_columns)
    return IcebergSink(TABLE, path=tmp_path / "iceberg", mode="upsert", key_columns=key_columns)


def add_notes(kind: str, tmp_path: Path) -> None:
    """A second writer adds the column ``note`` and fills it in every row (``n<id>``),
    through the table library itself, not the sink."""
    if kind == "delta":
        table = DeltaTable(tmp_path / "delta")
        table.alter.add_columns([DeltaField("note", "string", nullable=True)])
        table.update(updates={"note": "concat('n', cast(merchant_id as string))"})
        return
    table = load_catalog("volley", **sqlite_catalog(tmp_path / "iceberg")).load_table(TABLE)
    with table.update_schema() as update:
        update.add_column("note", StringType())
    rows = table.scan().to_arrow()
    notes = pa.array([f"n{m}" for m in rows.column("merchant_id").to_pylist()], pa.string())
    table.overwrite(rows.set_column(rows.column_names.index("note"), "note", notes))


def totals(merchants: list[int], total: float, expired: list[bool] | None = None) -> pa.Table:
    columns: dict[str, Any] = {"merchant_id": pa.array(merchants, pa.int64()),
                               "total": pa.array([total] * len(merchants), pa.float64())}
    if expired is not None:
        columns["expired"] = pa.array(expired, pa.bool_())
    return pa.table(columns)


def contents(sink: TableSink, columns: list[str]) -> list[tuple[Any, ...]]:
    return sorted(zip(*sink.read().select(columns).to_pydict().values(), strict=True), key=repr)


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_an_upsert_keeps_a_column_another_writer_added(tmp_path: Path, kind: str) -> None:
    sink = make(kind, tmp_path)
    sink.commit(totals([1, 2, 3, 4], 1.0), ctx(1))
    add_notes(kind, tmp_path)
    # 2 updates and 5 is new; Iceberg rewrites 3 and 4 (in the range 2..5), not 1
    assert not sink.commit(totals([2, 5], 2.0), ctx(2)).skipped
    # the same MERGE deletes 3 and updates 4 (Delta: ``when_matched_update``, not ``_all``)
    assert not sink.commit(totals([4, 3], 3.0, expired=[False, True]), replace(ctx(3), expiry_column="expired")).skipped

    assert sink.read().column_names == ["merchant_id", "total", "note"]
    assert contents(sink, ["merchant_id", "total", "note"]) == [
        (1, 1.0, "n1"), (2, 2.0, "n2"), (4, 3.0, "n4"), (5, 2.0, None)]
    assert sink.committed_epoch(PIPELINE) == 3


def keyed(rows: list[tuple[str | None, int | None, float]], expired: list[bool] | None = None) -> pa.Table:
    """Rows keyed by ``(region, merchant_id)``, either of which may be null (a
    deduplication over both keeps one such record per key, nulls included)."""
    region, merchant, total = zip(*rows, strict=True) if rows else ((), (), ())
    columns: dict[str, Any] = {"region": pa.array(region, pa.string()), "merchant_id": pa.array(merchant, pa.int64()),
                               "total": pa.array(total, pa.float64())}
    if expired is not None:
        columns["expired"] = pa.array(expired, pa.bool_())
    return pa.table(columns)


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_a_key_with_a_null_component_is_replaced_not_added(tmp_path: Path, kind: str) -> None:
    sink = make(kind, tmp_path, key_columns=["region", "merchant_id"])
    epochs = [
        keyed([("eu", 1, 1.0), ("eu", None, 1.0), (None, None, 1.0), ("us", 2, 1.0)]),
        keyed([("eu", None, 2.0), (None, None, 2.0), (None, 3, 2.0)]),  # two again, one new
        keyed([("eu", 1, 3.0)]),  # a range without nulls: the null keys' rows stay as they are
        keyed([("eu", None, 4.0), (None, 3, 0.0)], expired=[False, True]),  # (null, 3) expires
        keyed([(None, None, 5.0)]),  # no value but nulls in either column
    ]
    for epoch, output in enumerate(epochs, start=1):
        result = sink.commit(output, replace(ctx(epoch), expiry_column="expired"))
        assert not result.skipped
        if kind == "delta" and epoch == 2:
            assert (result.counts["inserted"], result.counts["updated"]) == (1, 2)

    assert contents(sink, ["region", "merchant_id", "total"]) == sorted(
        [("eu", 1, 3.0), ("eu", None, 4.0), (None, None, 5.0), ("us", 2, 1.0)], key=repr)
