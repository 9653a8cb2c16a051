"""Dagster resources: swappable settings for the engine's runtime parts."""


from typing import Optional

from dagster import ConfigurableResource
from pyspark.sql import SparkSession

from volley_dagster.spark.session import get_or_create_spark


class SparkResource(ConfigurableResource):
    """``local[*]`` by default; a standalone master URL or a Spark Connect URL when set."""

    master: Optional[str] = None
    remote: Optional[str] = None

    def session(self) -> SparkSession:
        return get_or_create_spark(master=self.master, remote=self.remote)


class CheckpointResource(ConfigurableResource):
    """Where a pipeline's epoch log and snapshots live, and how many to keep."""

    root: str
    keep_epochs: int = 3
    max_records_per_epoch: int = 1_000_000
