"""Expired keys (state TTL) at the table sinks, Delta and Iceberg: an upsert deletes
their rows in the epoch's own commit and never stores the ``expired`` column; an epoch
whose only rows delete keys the table lacks still commits once (Delta's MERGE would
change nothing and commit nothing); an append table keeps the rows as they are."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest

from tests.sinks.helpers import PIPELINE, ctx
from volley_dagster.sinks.delta import DeltaSink
from volley_dagster.sinks.iceberg import IcebergSink
from volley_dagster.sinks.table import TableSink


def rows(keys: list[int], expired: list[bool], epoch: int) -> pa.Table:
    return pa.table({"merchant_id": pa.array(keys, pa.int64()),
                     "total": pa.array([float(k * epoch) for k in keys], pa.float64()),
                     "expired": pa.array(expired, pa.bool_())})


def make(kind: str, mode: str, tmp_path: Path) -> TableSink:
    if kind == "delta":
        return DeltaSink(tmp_path / "delta", mode=mode)
    return IcebergSink("volley.expiry", path=tmp_path / "iceberg", mode=mode)


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_an_upsert_deletes_expired_keys_in_the_epochs_commit(tmp_path: Path, kind: str) -> None:
    sink = make(kind, "upsert", tmp_path)
    epochs = {
        1: rows([1, 2, 3, 4], [False] * 4, 1),
        2: rows([2, 3], [True, False], 2),  # 2 expires, 3 updates
        3: rows([9, 8], [True, True], 3),  # only deletes, of keys the table never held
        4: rows([1, 2], [True, False], 4),  # 1 expires; 2 is back, from empty
        5: rows([], [], 5),
    }
    for epoch, output in epochs.items():
        result = sink.commit(output, replace(ctx(epoch), expiry_column="expired"))
        assert not result.skipped and result.rows == output.num_rows
        assert sink.committed_epoch(PIPELINE) == epoch
        again = sink.commit(output, replace(ctx(epoch), expiry_column="expired"))
        assert again.skipped
    table = sink.read()
    assert "expired" not in table.column_names
    assert sorted(zip(*table.select(["merchant_id", "total"]).to_pydict().values())) == [(2, 8.0), (3, 6.0), (4, 4.0)]
    assert sink.epoch_history(PIPELINE) == {e: [t.num_rows] for e, t in epochs.items()}


@pytest.mark.parametrize("kind", ["delta", "iceberg"])
def test_an_append_table_keeps_the_expiry_rows(tmp_path: Path, kind: str) -> None:
    sink = make(kind, "append", tmp_path)
    sink.commit(rows([1, 2], [False, False], 1), replace(ctx(1), expiry_column="expired"))
    sink.commit(rows([1], [True], 2), replace(ctx(2), expiry_column="expired"))
    table = sink.read().sort_by([("expired", "ascending")])
    assert table.column("expired").to_pylist() == [False, False, True] and table.num_rows == 3
