"""The whole path on a real S3 server (SeaweedFS): the source log under an S3
prefix read by Spark tasks through boto3, and both tables on S3."""

from __future__ import annotations

import uuid

from tests.conftest import BUCKET
from tests.helpers import assert_state_equal, log_records, reference_state
from volley_dagster import EpochRunner, FileLog, Pipeline, count, sum_
from volley_dagster.demo.events import generate
from volley_dagster.settings import RunSettings
from volley_dagster.sinks import DeltaSink, IcebergSink, sqlite_catalog


def test_source_and_tables_on_s3(spark, seaweedfs, tmp_path):
    s3 = seaweedfs.s3
    prefix = f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}"
    generate(f"{prefix}/events", 3, 1_000, 200, partitions=2, storage_options=s3.boto3_options())
    pipeline = (
        Pipeline("s3_payments")
        .source(FileLog(f"{prefix}/events", storage_options=s3.boto3_options()))
        .where("status = 'active'")
        .key_by("merchant_id")
        .aggregate(total=sum_("amount"), events=count())
        .sink(DeltaSink(f"{prefix}/delta", mode="upsert", s3=s3))
        .sink(IcebergSink("s3.changes", catalog={**sqlite_catalog(tmp_path / "cat"), "warehouse": f"{prefix}/iceberg"},
                          mode="append", s3=s3))
        .with_shards(2)
    )
    runner = EpochRunner(pipeline, tmp_path / "state", RunSettings(max_records_per_epoch=1_200), spark=spark)
    results = runner.run_available()
    assert [r.records_in for r in results] == [1_200, 1_200, 600]
    expected = reference_state(log_records(3, 1_000, 200))[["merchant_id", "total", "events"]]
    assert_state_equal(runner.read_state(), expected)
    delta, iceberg = pipeline.sinks
    assert_state_equal(delta.read(), expected)
    assert iceberg.read().num_rows == sum(r.records_out for r in results)
    assert delta.committed_epoch("s3_payments") == iceberg.committed_epoch("s3_payments") == 3
