"""Dagster resources: the engine's runtime settings, swappable per deployment.

Secrets come in through ``EnvVar`` (``DeltaResource(secret_access_key=EnvVar("AWS_SECRET_ACCESS_KEY"))``)
and never reach metadata or logs: only ``describe()`` output does, which omits them.
"""

from pathlib import Path
from typing import Callable, Optional

from dagster import ConfigurableResource
from pydantic import field_validator
from pyspark.sql import SparkSession

from volley_dagster.checkpoint.epoch_log import local_root
from volley_dagster.checkpoint.s3_snapshots import S3SnapshotStore
from volley_dagster.deploy import TableSettings
from volley_dagster.io.s3 import S3Endpoint
from volley_dagster.sinks.iceberg import sqlite_catalog
from volley_dagster.sinks.lineage import check_choice
from volley_dagster.spark.session import get_or_create_spark
from volley_dagster.spark.warm import WarmSparkUnavailable, find_or_start, warm_session
from volley_dagster.state.options import RocksDBOptions
from volley_dagster.state.resident import ResidentStateCache


class SparkResource(ConfigurableResource):
    """A standalone master URL (``spark://host:7077``) or a Spark Connect URL
    (``sc://host:15002``) when set. Otherwise, with ``warm`` (the default), the warm
    Spark: a supervised local Spark Connect server that every run reaches in about a
    second (``volley_dagster/spark/warm.py``), under ``warm_home`` (default
    ``$DAGSTER_HOME/warm-spark``); a run that cannot reach it falls back to a local
    Spark of its own, and says so. ``warm=False``: a local Spark per run.

    ``spark_config``: any ``spark.*`` key (as ``dagster_pyspark.PySparkResource`` takes
    it), applied over the engine's defaults; on a cluster whose executors run on
    other machines, ``spark.driver.host`` and ``spark.driver.bindAddress`` name the
    driver's address (127.0.0.1 is only the default of a local or loopback master).
    The warm Spark is shared and started with the defaults, so a run with a
    ``spark_config`` starts its own."""

    master: Optional[str] = None
    remote: Optional[str] = None
    warm: bool = True
    warm_home: Optional[str] = None
    spark_config: dict[str, str] = {}

    def session(self, log: Optional[Callable[[str], None]] = None) -> SparkSession:
        say = log or (lambda _message: None)
        if self.master or self.remote or not self.warm or self.spark_config or _classic_session_active():
            spark = get_or_create_spark(master=self.master, remote=self.remote, conf=self.spark_config)
            say(f"Spark: {self.remote or spark.sparkContext.master}")
            return spark
        try:
            warm = find_or_start(Path(self.warm_home) if self.warm_home else None)
        except WarmSparkUnavailable as exc:
            say(f"Spark: falling back to a local Spark for this run: {exc}")
            return get_or_create_spark()
        assert warm.url is not None
        say(f"Spark: the warm Spark Connect server at {warm.url}")
        return warm_session(warm.url, warm.session_id)  # a retried step may find a restarted server


def _classic_session_active() -> bool:
    """A process that already runs a local Spark (tests, a notebook) keeps using it:
    PySpark cannot switch a process between classic and Connect sessions."""
    active = SparkSession.getActiveSession()
    return active is not None and not type(active).__module__.startswith("pyspark.sql.connect")


class S3Resource(ConfigurableResource):
    """An S3-compatible endpoint for the tables; empty means local paths."""

    endpoint_url: Optional[str] = None
    access_key_id: Optional[str] = None
    secret_access_key: Optional[str] = None
    region: str = "us-east-1"

    def endpoint(self) -> Optional[S3Endpoint]:
        if not self.endpoint_url:
            return None
        if not (self.access_key_id and self.secret_access_key):
            raise ValueError(f"S3 endpoint {self.endpoint_url}: set access_key_id and secret_access_key too")
        return S3Endpoint(self.endpoint_url, self.access_key_id, self.secret_access_key, self.region)


class CheckpointResource(ConfigurableResource):
    """Where a pipeline's epoch log and snapshots live (``<root>/<pipeline>``), how
    many snapshots to keep and how large an epoch may be. ``root`` is a local or
    shared POSIX path (a URI is a ``ConfigError``); ``snapshot_store_uri``
    (``s3://bucket/prefix``) also keeps every shard snapshot on S3, incrementally,
    for executors that do not share the root's disk (``<uri>/<pipeline>``)."""

    root: str
    keep_epochs: int = 3
    max_records_per_epoch: int = 1_000_000
    snapshot_store_uri: Optional[str] = None
    s3: Optional[S3Resource] = None
    lease_wait_s: float = 120.0  # how long a run waits for another run of the pipeline to give up its lease
    resident_state_mib: Optional[int] = None  # shard state kept in memory between epochs: None = the
    # environment's VOLLEY_RESIDENT_STATE_MIB (default 1024), 0 = off (docs/architecture.md)
    compact_together: Optional[int] = None  # shards whose RocksDB compacts in the same epoch (their turn,
    # every 10 epochs): a cluster's task slots; None = this machine's cores, what local[*] runs at once
    compact_in_background: bool = True  # the driver's compactor folds committed snapshots, not the shard
    # tasks (state/compactor.py); off: each shard compacts in its own task, on the epoch's critical path

    @field_validator("root")
    @classmethod
    def _root_is_a_path(cls, root: str) -> str:
        """Refused when the resource is built (an ``EnvVar`` once resolved, at a run's or a
        tick's resource init), before anything writes to ``./s3:``."""
        local_root(root)
        return root

    def rocksdb(self) -> RocksDBOptions:
        if self.compact_together is None:
            return RocksDBOptions(compact_in_background=self.compact_in_background)
        return RocksDBOptions(compact_together=self.compact_together, compact_in_background=self.compact_in_background)

    def resident_state(self) -> Optional[ResidentStateCache]:
        return ResidentStateCache.from_env(self.resident_state_mib)

    def snapshot_store(self, pipeline: str) -> Optional[S3SnapshotStore]:
        if not self.snapshot_store_uri:
            return None
        endpoint = self.s3.endpoint() if self.s3 is not None else None
        return S3SnapshotStore(f"{self.snapshot_store_uri.rstrip('/')}/{pipeline}", endpoint)


class TablesResource(ConfigurableResource):
    """Where the pipelines' Delta tables and Iceberg catalog live.

    The Iceberg catalog is any catalog pyiceberg loads (``load_catalog``):
    ``iceberg_catalog_properties`` are its properties as pyiceberg documents them
    (``type``: ``rest``, ``sql``, ``glue``, ``hive``; ``uri``, ``warehouse``, ...), merged by
    pyiceberg over its own configuration of the catalog named ``volley`` (``.pyiceberg.yaml``,
    ``PYICEBERG_CATALOG__VOLLEY__*``: where a token or credential belongs). Without them,
    ``iceberg_catalog_uri`` selects a SQL catalog (``postgresql+psycopg2://...``), and
    with neither the embedded SQLite catalog under ``warehouse``.
    ``on_foreign_lineage``: "fail", "replace" or "continue" when a table holds the
    pipelines' epochs from another checkpoint root (``volley_dagster/sinks/lineage.py``)."""

    warehouse: str
    iceberg_catalog_uri: Optional[str] = None
    iceberg_catalog_properties: dict[str, str] = {}
    s3: Optional[S3Resource] = None
    on_foreign_lineage: str = "fail"

    def settings(self) -> TableSettings:
        endpoint = self.s3.endpoint() if self.s3 is not None else None
        if self.iceberg_catalog_properties and self.iceberg_catalog_uri:
            raise ValueError("tables: set iceberg_catalog_properties or iceberg_catalog_uri, not both "
                             "(a SQL catalog's uri goes among the properties)")
        if self.iceberg_catalog_properties:
            catalog = dict(self.iceberg_catalog_properties)
        elif self.iceberg_catalog_uri:
            catalog = {"type": "sql", "uri": self.iceberg_catalog_uri, "warehouse": f"{self.warehouse}/iceberg"}
        elif self.warehouse.startswith("s3://"):
            raise ValueError("an S3 warehouse needs an Iceberg catalog (iceberg_catalog_properties or "
                             "iceberg_catalog_uri): the SQLite catalog file must be local")
        else:
            catalog = sqlite_catalog(f"{self.warehouse}/iceberg")
        if endpoint is not None:
            catalog = {**endpoint.iceberg_properties(), **catalog}
        return TableSettings(
            warehouse=self.warehouse,
            iceberg_catalog=catalog,
            delta_storage_options=endpoint.delta_storage_options() if endpoint is not None else None,
            on_foreign_lineage=check_choice("tables", self.on_foreign_lineage),
        )
