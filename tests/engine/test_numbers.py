"""Numbers never change silently in state: an int64 sum that would wrap across epochs
fails the epoch naming the key, and a decimal column is refused, not turned into float64."""

from __future__ import annotations

from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from volley_dagster import AggregateOverflowError, ConfigError, EpochRunner, FileLog, MemorySink, Pipeline, count, sum_
from volley_dagster.settings import RunSettings


def write_log(root, batches: list[pa.Table]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for i, batch in enumerate(batches):
        pq.write_table(batch, root / f"part-{i:05d}.parquet")


def pipeline(root) -> Pipeline:
    return (Pipeline("totals").source(FileLog(root, format="parquet")).key_by("account")
            .aggregate(total=sum_("amount"), n=count()).sink(MemorySink()).with_shards(2))


def test_an_int64_sum_that_would_wrap_across_epochs_fails_naming_the_key(spark, tmp_path):
    big = 2**62
    write_log(tmp_path / "log", [
        pa.table({"account": ["acme", "small"], "amount": pa.array([big, 1], pa.int64())}),
        pa.table({"account": ["acme", "small"], "amount": pa.array([big, 2], pa.int64())}),  # acme: 2**63
    ])
    runner = EpochRunner(pipeline(tmp_path / "log"), tmp_path / "state", RunSettings(max_records_per_epoch=2), spark=spark)
    runner.run_next()
    with pytest.raises(AggregateOverflowError, match=r"epoch 2: sum\('amount'\) as 'total' leaves int64 for 1 key\(s\), e\.g\. \['acme'\]"):
        runner.run_next()
    assert runner.committed_epoch() == 1
    state = {r["account"]: r["total"] for r in runner.read_state().to_pylist()}
    assert state == {"acme": big, "small": 1}  # epoch 1's, never a wrapped value
    assert list(runner.pipeline.sinks[0].epochs["totals"]) == [1]


def test_a_decimal_column_is_refused_not_made_float(spark, tmp_path):
    amounts = pa.array([Decimal("0.10"), Decimal("0.20")], pa.decimal128(10, 2))
    write_log(tmp_path / "log", [pa.table({"account": ["a", "a"], "amount": amounts})])
    runner = EpochRunner(pipeline(tmp_path / "log"), tmp_path / "state", spark=spark)
    with pytest.raises(ConfigError, match=r"column 'amount' of type decimal\(10,2\).*CAST\(amount \* 100 AS BIGINT\)"):
        runner.run_next()
    assert runner.committed_epoch() == 0

    exact = pipeline(tmp_path / "log").with_column("amount", "CAST(amount * 100 AS BIGINT)")
    cents = EpochRunner(exact, tmp_path / "cents", spark=spark)
    cents.run_next()
    assert cents.read_state().to_pylist() == [{"account": "a", "total": 30, "n": 2}]
