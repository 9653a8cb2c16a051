"""The same engine over Spark Connect (a real server from the pyspark package's
own jars): results equal the reference, and task-side engine errors surface as
themselves through the Connect client."""

from __future__ import annotations

import socket

import pytest

from tests.helpers import assert_state_equal, log_records, payments, reference_state
from volley_dagster import EpochRunner, SourceError
from volley_dagster.demo.events import generate
from volley_dagster.spark.connect import start_connect_server
from volley_dagster.spark.stage import plan_epoch, run_stage


@pytest.fixture(scope="module")
def connect(tmp_path_factory):
    from pyspark.sql import SparkSession

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_connect_server(port, "local[2]", tmp_path_factory.mktemp("connect") / "server.log")
    session = SparkSession.builder.remote(server.url).create()
    try:
        yield session
    finally:
        session.stop()
        server.stop()


def test_epochs_over_spark_connect(connect, tmp_path):
    generate(tmp_path / "events", 2, 1_500, 200)
    runner = EpochRunner(payments(tmp_path / "events", tmp_path / "out"), tmp_path / "state", spark=connect,
                         max_records_per_epoch=2_000)
    assert [r.records_in for r in runner.run_available()] == [2_000, 1_000]
    assert_state_equal(runner.read_state(), reference_state(log_records(2, 1_500, 200)))

    generate(tmp_path / "events", 1, 500, 200, first_file=2)
    rng = runner.cut_next()
    plan = plan_epoch(connect, runner.pipeline, rng)
    path = tmp_path / "events" / "events-000002.parquet"
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(SourceError, match="changed after its epoch was cut"):
        run_stage(connect, runner.pipeline, rng, plan, merge=None)
