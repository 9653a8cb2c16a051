"""Fixtures shared by the whole suite: one SparkSession, one SeaweedFS (S3), one
PostgreSQL and one Spark standalone cluster per test session, each on 127.0.0.1,
started (only when a test asks for it) and stopped here."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from harness.kafka import KafkaCluster, start_kafka
from harness.netns import VethNamespace
from harness.postgres import Postgres, start_postgres
from harness.seaweedfs import SeaweedFS, start_seaweedfs
from harness.spark_cluster import SparkCluster, start_spark_cluster

BUCKET = "volley-sinks"

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
# Resident state mirrors (volley_dagster/state/resident.py) of this run's checkpoint roots
# go to a folder of its own, removed at the end, not to the machine's /dev/shm.
_RESIDENT = tempfile.mkdtemp(prefix="volley-test-resident-")
os.environ["VOLLEY_RESIDENT_STATE_DIR"] = _RESIDENT
atexit.register(shutil.rmtree, _RESIDENT, True)


_SPARK_FIXTURES = {"spark", "spark_cluster"}
_SERVER_FIXTURES = {"seaweedfs", "postgres", "kafka"}  # real servers, started once per session
_SPARK_FOLDERS = {"engine", "dagster", "ui", "properties"}  # their tests start Spark, in-process or in workers
# under xdist the longest groups start first: the UI tests are a third of the suite's
# time on one worker; the pure-logic folders fill the end
_FIRST_TO_LAST = ("ui", "properties", "engine", "dagster")
_TESTS = Path(__file__).resolve().parent


def _folder(item: pytest.Item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(_TESTS).parts[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``spark`` every test that starts Spark, and ``server`` every test that needs
    S3, PostgreSQL or Kafka, so ``./dev test --fast`` (``-m "not spark and not server"``)
    is the pure-logic lane: the clock, key encoding, manifests, the lease, kernels, the
    sink-commit rules on local tables.
    Under xdist, orders the folders longest first (every worker collects the same
    order; ``--no-loadscope-reorder`` keeps it); one process keeps the files' order."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if _folder(item) in _SPARK_FOLDERS or _SPARK_FIXTURES & fixtures:
            item.add_marker(pytest.mark.spark)
        callspec = getattr(item, "callspec", None)  # a parameter may ask for one ("s3", "postgres-s3")
        params = set(callspec.id.split("-")) if callspec is not None else set()
        if _SERVER_FIXTURES & fixtures or params & {"s3", "postgres"}:
            item.add_marker(pytest.mark.server)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {folder: n for n, folder in enumerate(_FIRST_TO_LAST)}
        items.sort(key=lambda item: rank.get(_folder(item), len(rank)))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``./dev test`` runs two xdist workers: a file's tests stay on one worker, in
    order, with their module fixtures; every UI test (each a real ``dagster dev`` with
    its own warm Spark) runs on one worker, so two never compete for the cores."""
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/ui" if path.startswith("tests/ui/") else path

    return SuiteScheduling(config, log)  # type: ignore[arg-type]


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
def kafka() -> Iterator[KafkaCluster]:
    cluster = start_kafka()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    server = start_postgres()  # raises with `apt-get install -y postgresql` when absent
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A standalone master and two 1-core workers (each with its own work dir); tests
    drive it from their own processes (tests/engine/cluster_worker.py). The master and
    the driver listen on a veth pair's address, and worker 1 runs inside a network
    namespace of its own (harness/netns.py): its executors reach them as a remote
    machine's would, never at 127.0.0.1."""
    netns = VethNamespace.create()
    try:
        cluster = start_spark_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, cores_per_worker=1,
                                      netns=netns, netns_workers=frozenset({1}))
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        netns.delete()
