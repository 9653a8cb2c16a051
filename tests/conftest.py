"""Fixtures shared by the whole suite: one SparkSession, one SeaweedFS (S3) and
one PostgreSQL per test session, each on 127.0.0.1, started and stopped here."""

from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

from tests.servers import Postgres, SeaweedFS, start_postgres, start_seaweedfs

BUCKET = "volley-sinks"

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def spark():
    from volley_dagster.spark.session import get_or_create_spark

    session = get_or_create_spark(master="local[2]", conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"), bucket=BUCKET)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    server = start_postgres()  # raises with `apt-get install -y postgresql` when absent
    try:
        yield server
    finally:
        server.stop()
