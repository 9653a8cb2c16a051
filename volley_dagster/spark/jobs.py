"""How many Spark jobs an epoch's attempt ran, for its figures (``spark_jobs``): the
attempt's jobs run in a job group of their own, counted by Spark's status tracker
afterwards. On Spark Connect, whose client has no status tracker, nothing is counted."""

from __future__ import annotations

import contextlib
import uuid
from typing import Callable, Iterator

from pyspark.sql import SparkSession


@contextlib.contextmanager
def counted_jobs(spark: SparkSession, description: str) -> Iterator[Callable[[], int | None]]:
    """Run the block's Spark jobs (started from this thread) in a group of their own;
    yields how to count them (None: cannot)."""
    try:
        context = spark.sparkContext
    except Exception:  # Spark Connect: no SparkContext in the client
        yield lambda: None
        return
    group = f"volley-{uuid.uuid4().hex[:12]}"
    context.setJobGroup(group, description)
    try:
        yield lambda: len(context.statusTracker().getJobIdsForGroup(group))
    finally:
        context.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
        context.setLocalProperty("spark.job.description", None)  # type: ignore[arg-type]
