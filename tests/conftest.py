"""Fixtures shared by the whole suite: one SparkSession per test session."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def spark():
    from volley_dagster.spark.session import get_or_create_spark

    session = get_or_create_spark(master="local[2]", conf={"spark.sql.shuffle.partitions": "4"})
    yield session
    session.stop()
