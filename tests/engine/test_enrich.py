"""Enrichment with a versioned dimension table on real Spark, Delta, Iceberg and
Parquet: each epoch reads the version pinned when it was cut, so a retry after a
``kill -9`` equals the first attempt although the table changed in between, and the
next epoch reads the new version; inner and left joins against a reference, with
their counts; a broadcast-size table and one Spark must shuffle; a key on two rows
and a rewritten Parquet file are named errors."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import write_deltalake

from tests.engine.test_crash_recovery import run_until_killed
from tests.helpers import enriched_payments, log_records, merchants_table, reference_enriched
from volley_dagster import (
    ConfigError,
    DeltaDimension,
    DimensionPinRejectedError,
    DimensionVersionLostError,
    DuplicateDimensionKeyError,
    EpochRunner,
    FileLog,
    IcebergDimension,
    ParquetDimension,
    Pipeline,
    count,
    sum_,
    tumbling,
)
from volley_dagster.demo.events import generate
from volley_dagster.errors import is_retryable
from volley_dagster.settings import RunSettings
from volley_dagster.sinks.iceberg import sqlite_catalog
from volley_dagster.spark.stage import plan_epoch

PER_FILE, KEYS = 1_500, 300


def assert_state(runner: EpochRunner, expected: pd.DataFrame) -> None:
    got = runner.read_state().to_pandas().sort_values("merchant_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(got[list(expected.columns)], expected.sort_values("merchant_id").reset_index(drop=True),
                                  check_dtype=False, check_exact=False, rtol=1e-9)


def combined(*parts: pd.DataFrame) -> pd.DataFrame:
    """The state after epochs each joined with its own version: sums add, the region is the latest."""
    frames = pd.concat(parts, keys=range(len(parts)), names=["part", "row"]).reset_index()
    g = frames.sort_values("part").groupby("merchant_id", sort=True)
    return pd.DataFrame({"fees": g["fees"].sum(min_count=1), "events": g["events"].sum(),
                         "region": g["region"].last()}).reset_index()


@pytest.mark.parametrize(("point", "shard"), [("shard_after_snapshot", 1),
                                             pytest.param("after_sink_delta", None, marks=pytest.mark.deep)])
def test_a_retry_after_kill_9_reads_the_pinned_version_and_the_next_epoch_the_new_one(spark, tmp_path, point, shard):
    """Killed with epoch 2's shard 1 snapshotted (nothing committed), or with its Delta
    sink committed: either way the retry reads the version epoch 2 pinned."""
    generate(tmp_path / "events", 3, PER_FILE, KEYS)
    write_deltalake(tmp_path / "merchants", merchants_table(KEYS, 0))
    died = run_until_killed(tmp_path, point, 2, shard=shard, kind="payments_enriched", max_records=PER_FILE)
    assert died.returncode == -9, died.stderr[-3000:]
    assert EpochRunner(enriched_payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state",
                       spark=spark).log.dimension_pin(2, "merchants").version == "0"
    # the table changes while epoch 2 is half done
    write_deltalake(tmp_path / "merchants", merchants_table(KEYS, 1), mode="overwrite")

    runner = EpochRunner(enriched_payments(tmp_path / "events", tmp_path / "out", tables=tmp_path / "tables"), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    assert [r.epoch for r in runner.run_available()] == [2, 3]
    records = log_records(3, PER_FILE, KEYS)
    v0, v1 = merchants_table(KEYS, 0), merchants_table(KEYS, 1)
    expected = combined(reference_enriched(records.slice(0, 2 * PER_FILE), v0),
                        reference_enriched(records.slice(2 * PER_FILE), v1))
    assert_state(runner, expected)
    assert {e: runner.result(e).enrichments["merchants"].version for e in (1, 2, 3)} == {1: "0", 2: "0", 3: "1"}
    # each epoch once in the Delta sink (after_sink_delta: it held epoch 2 from the killed attempt)
    delta = runner.pipeline.sinks[1]
    assert delta.epoch_history("payments_enriched") == {e: [runner.result(e).records_out] for e in (1, 2, 3)}
    upserted = delta.read().to_pandas().sort_values("merchant_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(upserted[["merchant_id", "fees", "events", "region"]],
                                  expected.sort_values("merchant_id").reset_index(drop=True), check_dtype=False)
    # inner: every record of a merchant the table lacks is dropped, and counted
    active = records.to_pandas().query("status == 'active'")
    missing = ~active["merchant_id"].isin(v0.column("merchant_id").to_pylist())
    dropped = sum(runner.result(e).enrichments["merchants"].dropped for e in (1, 2, 3))
    assert dropped == int(missing.sum()) > 0
    third = runner.result(3).enrichments["merchants"]
    assert runner.result(3).records_aggregated == third.records - third.dropped


def test_a_left_join_keeps_records_without_a_match_and_counts_them(spark, tmp_path):
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    write_deltalake(tmp_path / "merchants", merchants_table(KEYS, 0))
    runner = EpochRunner(enriched_payments(tmp_path / "events", tmp_path / "out", how="left"), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    results = runner.run_available()
    records = log_records(2, PER_FILE, KEYS)
    assert_state(runner, reference_enriched(records, merchants_table(KEYS, 0), how="left"))
    active = records.to_pandas().query("status == 'active'")
    unmatched = int((active["merchant_id"] % 7 == 3).sum())
    assert sum(r.enrichments["merchants"].unmatched for r in results) == unmatched > 0
    assert all(r.enrichments["merchants"].dropped == 0 for r in results)
    assert sum(r.records_aggregated for r in results) == len(active)


def test_an_enriched_window_pipeline_counts_through_its_side_output_job(spark, tmp_path):
    """Windows run a side-output job before the state stage: the join is counted there."""
    generate(tmp_path / "events", 2, 600, KEYS)
    write_deltalake(tmp_path / "merchants", merchants_table(KEYS, 0))
    pipeline = (
        Pipeline("fees_per_minute")
        .source(FileLog(tmp_path / "events", format="parquet"))
        .where("status = 'active'")
        .enrich(DeltaDimension(tmp_path / "merchants"), on="merchant_id", columns=["fee_rate"], how="inner")
        .with_column("fee", "amount * fee_rate")
        .key_by("merchant_id")
        .window(tumbling("1 minute"), on="event_time", max_out_of_orderness="10 minutes")
        .aggregate(fees=sum_("fee"), events=count())
        .with_shards(2)
    )
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=600), spark=spark)
    results = runner.run_available() + runner.flush()
    assert sum(r.late_records for r in results) == 0
    fired = pa.concat_tables([r.output for r in results if r.output is not None]).to_pandas()
    per_key = fired.groupby("merchant_id")[["fees", "events"]].sum().reset_index()
    expected = reference_enriched(log_records(2, 600, KEYS), merchants_table(KEYS, 0))
    pd.testing.assert_frame_equal(per_key.sort_values("merchant_id").reset_index(drop=True),
                                  expected[["merchant_id", "fees", "events"]], check_dtype=False, rtol=1e-9)
    active = log_records(2, 600, KEYS).to_pandas().query("status == 'active'")
    assert sum(r.enrichments["merchants"].dropped for r in results) == int((active["merchant_id"] % 7 == 3).sum())


@pytest.mark.parametrize("threshold", ["10485760", "-1"], ids=["broadcast", "shuffle"])
def test_a_broadcast_size_table_and_one_spark_must_shuffle_give_the_reference(spark, tmp_path, threshold):
    """``-1``: the table is over Spark's broadcast threshold, as a big table is."""
    generate(tmp_path / "events", 1, PER_FILE, KEYS)
    write_deltalake(tmp_path / "merchants", merchants_table(KEYS, 0))
    runner = EpochRunner(enriched_payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    before = spark.conf.get("spark.sql.autoBroadcastJoinThreshold")
    spark.conf.set("spark.sql.autoBroadcastJoinThreshold", threshold)
    try:
        rng = runner.cut_next()
        assert rng is not None
        pin = runner.log.dimension_pin(1, "merchants")
        assert pin is not None and pin.version == "0"
        plan = plan_epoch(spark, runner.pipeline, rng, {"merchants": pin})
        physical = plan.keyed._jdf.queryExecution().sparkPlan().toString()
        runner.run_available()
    finally:
        spark.conf.set("spark.sql.autoBroadcastJoinThreshold", before)
    if threshold == "-1":
        assert "BroadcastHashJoin" not in physical and ("SortMergeJoin" in physical or "ShuffledHashJoin" in physical)
    else:
        assert "BroadcastHashJoin" in physical
    assert_state(runner, reference_enriched(log_records(1, PER_FILE, KEYS), merchants_table(KEYS, 0)))


def test_a_key_on_two_rows_fails_naming_it_and_the_fixed_table_is_read_next(spark, tmp_path):
    generate(tmp_path / "events", 1, PER_FILE, KEYS)
    merchants = merchants_table(KEYS, 0)
    write_deltalake(tmp_path / "merchants", pa.concat_tables([merchants, merchants.slice(5, 1)]))
    runner = EpochRunner(enriched_payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    with pytest.raises(DuplicateDimensionKeyError, match=r"epoch 1: dimension table 'merchants'.*version 0.*\(6,\)"):
        runner.run_available()
    assert runner.log.last_committed() == 0 and runner.log.dimension_pin(1, "merchants") is None  # set aside
    write_deltalake(tmp_path / "merchants", merchants, mode="overwrite")
    (result,) = runner.run_available()
    assert result.enrichments["merchants"].version == "1"
    assert_state(runner, reference_enriched(log_records(1, PER_FILE, KEYS), merchants))


def test_a_version_lacking_a_column_is_set_aside_and_the_table_that_gains_it_is_read(spark, tmp_path):
    generate(tmp_path / "events", 1, PER_FILE, KEYS)
    merchants = merchants_table(KEYS, 0)
    write_deltalake(tmp_path / "merchants", merchants.drop_columns(["region"]))
    runner = EpochRunner(enriched_payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    with pytest.raises(DimensionPinRejectedError, match=r"'merchants'.*version 0 has no column \['region'\]"):
        runner.run_available()
    assert is_retryable(DimensionPinRejectedError("x", "merchants", "0"))  # the sensor's recovery tries again
    write_deltalake(tmp_path / "merchants", merchants, mode="overwrite", schema_mode="overwrite")
    (result,) = runner.run_available()
    assert result.enrichments["merchants"].version == "1"
    assert_state(runner, reference_enriched(log_records(1, PER_FILE, KEYS), merchants))


def test_iceberg_and_parquet_dimensions_read_their_pins(spark, tmp_path):
    generate(tmp_path / "events", 2, PER_FILE, KEYS)
    catalog = sqlite_catalog(tmp_path / "catalog")
    from pyiceberg.catalog import load_catalog

    cat = load_catalog("volley", **catalog)
    cat.create_namespace("dims")
    table = cat.create_table("dims.merchants", merchants_table(KEYS, 0).schema)
    table.append(merchants_table(KEYS, 0))
    iceberg = IcebergDimension("dims.merchants", catalog=catalog, name="merchants")
    runner = EpochRunner(enriched_payments(tmp_path / "events", tmp_path / "out", dimension=iceberg), tmp_path / "state", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    first = runner.cut_next()
    assert first is not None
    table.overwrite(merchants_table(KEYS, 1))  # after the cut: epoch 1 still reads the first snapshot
    runner.run_available()
    records = log_records(2, PER_FILE, KEYS)
    assert_state(runner, combined(reference_enriched(records.slice(0, PER_FILE), merchants_table(KEYS, 0)),
                                  reference_enriched(records.slice(PER_FILE), merchants_table(KEYS, 1))))

    # Parquet: pinned by its files; a file rewritten after the pin cannot be read as pinned
    (tmp_path / "dim").mkdir()
    pq.write_table(merchants_table(KEYS, 0), tmp_path / "dim" / "part-0.parquet")
    parquet = ParquetDimension(tmp_path / "dim", name="merchants")
    other = EpochRunner(enriched_payments(tmp_path / "events", tmp_path / "out2", dimension=parquet), tmp_path / "state2", RunSettings(max_records_per_epoch=PER_FILE), spark=spark)
    assert other.cut_next() is not None
    pq.write_table(merchants_table(KEYS, 1), tmp_path / "dim" / "part-0.parquet")
    with pytest.raises(DimensionVersionLostError, match="part-0.parquet was rewritten after an epoch pinned it"):
        other.run_next()
    twice = enriched_payments(tmp_path / "events", tmp_path / "out3", dimension=parquet).enrich(
        ParquetDimension(tmp_path / "dim", name="again"), on="merchant_id", columns=["fee_rate"])
    with pytest.raises(ConfigError, match=r"enrich\('again'\): the records already have columns \['fee_rate'\]"):
        EpochRunner(twice, tmp_path / "state3", spark=spark).run_next()
