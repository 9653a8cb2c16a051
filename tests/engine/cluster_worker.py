"""Runs the payments pipeline on a Spark standalone cluster, in its own process
(the suite's pytest process already holds a local SparkContext, and a process
holds one): ``python -m tests.engine.cluster_worker MASTER_URL BASE MAX_RECORDS``.

Prints one JSON line per committed epoch: its records, the driver's pid and its
descendants (the driver JVM), and per shard the pid of the process that ran the
shard task with that process's ancestors from /proc (pid and what each is), read
right after the epoch while the reused Python workers are still alive.

``VOLLEY_PAUSE_DIR``/``VOLLEY_PAUSE_MAX_S`` in the environment are passed on to
the executors (``spark.executorEnv``) for the pause points in ``faults.py``.
"""

import json
import os
import sys
from pathlib import Path

from harness.processes import proc_ancestors, proc_cmdline, proc_descendants
from harness.spark_cluster import EXECUTOR_CLASS
from tests.helpers import payments
from volley_dagster import EpochRunner
from volley_dagster.faults import PAUSE_DIR_ENV, PAUSE_MAX_ENV
from volley_dagster.settings import RunSettings
from volley_dagster.spark.session import get_or_create_spark

SHARDS = 4

CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.task.maxFailures": "4",
    "spark.driver.memory": "1g",
    "spark.executor.memory": "512m",
    "spark.executor.cores": "1",
    "spark.excludeOnFailure.enabled": "false",
    "spark.locality.wait": "0s",  # a retried task goes to whichever executor is free
    # a reducer fetching from a dead executor fails at once instead of retrying for 15 s
    "spark.shuffle.io.maxRetries": "1",
    "spark.shuffle.io.retryWait": "1s",
    # start once both workers' executors registered, so shard tasks spread over them
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
}


def kind(pid: int) -> str:
    cmd = proc_cmdline(pid)
    if EXECUTOR_CLASS in cmd:
        return "executor"
    if "org.apache.spark.deploy.worker.Worker" in cmd:
        return "worker"
    if "pyspark.daemon" in cmd:
        return "python-daemon"
    return cmd.split(" ", 1)[0].rsplit("/", 1)[-1] or "?"


if __name__ == "__main__":
    master, base, max_records, driver_host = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    # a master off loopback: the engine leaves the driver's address to the configuration
    conf = {**CONF, "spark.driver.host": driver_host, "spark.driver.bindAddress": driver_host}
    for env in (PAUSE_DIR_ENV, PAUSE_MAX_ENV):
        if env in os.environ:
            conf[f"spark.executorEnv.{env}"] = os.environ[env]
    spark = get_or_create_spark(master=master, conf=conf, app_name="volley cluster test")
    pipeline = payments(base / "events", base / "out", shards=SHARDS, tables=base / "tables")
    runner = EpochRunner(pipeline, base / "state", RunSettings(max_records_per_epoch=max_records, keep_epochs=3), spark=spark)
    while (result := runner.run_next()) is not None:
        shards = {}
        for shard, info in result.shards.items():
            pid = info.task_pid
            shards[shard] = {"task_pid": pid, "ancestors": [[a, kind(a)] for a in proc_ancestors(pid)],
                             "bytes_new": info.bytes_new, "bytes_total": info.snapshot.bytes_total,
                             "compacted": info.compacted}
        print(json.dumps({
            "epoch": result.epoch,
            "records_in": result.records_in,
            "state_bytes": result.state_bytes,
            "state_bytes_written": result.state_bytes_written,
            "driver_pid": os.getpid(),
            "driver_descendants": proc_descendants(os.getpid()),
            "shards": shards,
        }), flush=True)
    spark.stop()
